"""The MoE dispatch layout and combine sum on one process, CPU only: symcomm/ep/layout.py's
vectorised functions and the peer kernels' CPU twin (csrc/ep.cu's symcomm_ep_*_host, their
per-entry and per-row code) against the plain loop reference (tests/_ep_reference.py), bit for
bit, at world sizes 2 to 8 (the twin simulates any world), every top-k from 1 to 8, with
zero-token ranks, experts nobody picks, skipped (-1) and repeated ids, alignment, and the three
encodings (rows as they are, NVFP4 with linear and swizzled scales, FP8 blocks).
"""
from __future__ import annotations

import pytest
import torch

from _ep_reference import encode, group_mismatches, random_case, world_combine, world_dispatch, world_groups
import symcomm
from symcomm import fp4
from symcomm.ep import fp8, host, layout
from symcomm.operations.moe_dispatch import row_bytes

needs_twin = pytest.mark.needs_native

CASES = [  # world, tokens per rank, experts, k, align
    (2, [5, 0], 8, 1, 1),
    (2, [7, 3], 8, 2, 4),
    (3, [4, 0, 6], 9, 3, 1),
    (3, [0, 0, 2], 6, 6, 2),
    (4, [3, 5, 0, 1], 16, 4, 1),
    (4, [6, 6, 6, 6], 8, 8, 8),
    (5, [2, 9, 0, 4, 1], 10, 5, 1),
    (8, [1, 0, 3, 2, 0, 4, 1, 2], 16, 7, 2),
    (8, [3] * 8, 64, 8, 1),
    # top-k past one group of the sum's loads (csrc/ep.cuh's kSumGroup), and the largest top-k
    (2, [3, 4], 32, 12, 1),
    (4, [2, 1, 0, 3], 64, 32, 2),
]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _has_a_repeat(ids: list[torch.Tensor]) -> bool:
    """Some token names one expert in two slots, both valid (not -1)."""
    for t in ids:
        for row in t.tolist():
            valid = [i for i in row if i >= 0]
            if len(set(valid)) < len(valid):
                return True
    return False


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"w{c[0]}-k{c[3]}-a{c[4]}")
def test_layout_functions_match_the_reference(case):
    world, tokens, experts, k, align = case
    _, ids, _ = random_case(world, tokens, 32, experts, k, seed=world * 10 + k, repeat=0.25)
    assert k == 1 or _has_a_repeat(ids), "the case should repeat an id"
    received, send_rows = world_dispatch(ids, experts, max(tokens) + 1, align)
    counts = []
    for q in range(world):
        valid = layout.valid_entries(ids[q], experts)
        c, pos = layout.counts_and_positions(ids[q], valid, experts)
        counts.append(c)
        assert ((pos >= 0) == valid).all()
    table = torch.stack(counts)
    assert table.tolist() == received[0].table
    for r in range(world):
        base, expert_counts, expert_offsets = layout.placement(table, experts, r, align)
        assert expert_counts.tolist() == received[r].counts
        assert expert_offsets.tolist() == received[r].offsets
        valid = layout.valid_entries(ids[r], experts)
        _, pos = layout.counts_and_positions(ids[r], valid, experts)
        assert torch.equal(layout.send_rows(ids[r], pos, base), send_rows[r])
        pad = layout.padding_rows(expert_counts, expert_offsets, len(received[r].recv_src))
        assert pad.tolist() == [v == -1 for v in received[r].recv_src]
    cap = layout.capacity(world, max(tokens) + 1, k, experts, align)
    assert all(rec.offsets[-1] <= cap for rec in received)


def test_the_fingerprint_tells_encodings_with_equal_row_bytes_apart():
    """NVFP4 rows of 256 values and FP8 rows of 128 both take 128 bytes and 16 lane units, so one
    dispatch grid: only the encoding and the row's values in the fingerprint stop ranks that mixed
    them before rows of one encoding land where the other is read."""
    sizes = (64, row_bytes(256, torch.bfloat16, "nvfp4"), 8, 1, 4, 16)
    assert sizes[1] == row_bytes(128, torch.bfloat16, "fp8") == 128
    assert layout.fingerprint(*sizes, "nvfp4", 256, torch.bfloat16) != layout.fingerprint(*sizes, "fp8", 128,
                                                                                       torch.bfloat16)


def test_the_fingerprint_tells_fp16_and_bf16_rows_apart():
    """Unquantized fp16 and bf16 rows have the same bytes, so without the dtype in the fingerprint a
    rank would read a peer's fp16 bits as bf16 values."""
    sizes = (64, row_bytes(256, torch.float16, None), 8, 1, 4, 16, None, 256)
    assert sizes[1] == row_bytes(256, torch.bfloat16, None)
    assert layout.fingerprint(*sizes, torch.float16) != layout.fingerprint(*sizes, torch.bfloat16)


def test_capacity_is_reached_and_not_passed():
    """Every token of every rank picks all k experts of rank 0: it receives exactly capacity rows
    (less the padding of experts that got none)."""
    world, experts, k, max_tokens = 4, 8, 2, 5
    ids = [torch.tensor([[0, 1]] * max_tokens) for _ in range(world)]
    received, _ = world_dispatch(ids, experts, max_tokens)
    assert received[0].offsets[-1] == layout.capacity(world, max_tokens, k, experts, 1) == world * max_tokens * k


@needs_twin
@pytest.mark.parametrize("quant", (None, "nvfp4", "nvfp4-swizzled", "fp8"))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"w{c[0]}-k{c[3]}-a{c[4]}")
def test_the_kernels_cpu_twin_matches_the_reference(case, quant):
    world, tokens, experts, k, align = case
    swizzle = quant == "nvfp4-swizzled"
    quant = "nvfp4" if swizzle else quant
    hidden = 256 if quant == "fp8" else 48
    max_tokens = max(tokens) + 2
    dtype = torch.float16 if world % 2 else torch.bfloat16
    xs, ids, ws = random_case(world, tokens, hidden, experts, k, seed=world * 100 + k,
                              dtype=dtype, ids_dtype=torch.int32 if k % 2 else torch.int64, repeat=0.25)
    assert k == 1 or _has_a_repeat(ids), "the case should repeat an id"
    gs = 1.5 * 448 * 6 / max(float(x.float().abs().max()) for x in xs if x.numel())
    received, send_rows = world_dispatch(ids, experts, max_tokens, align)
    ranks = host.dispatch_host(list(xs), list(ids), list(ws), experts, max_tokens, quant, gs, align, swizzle)
    groups = world_groups(ids, ws, send_rows, experts, max_tokens)
    for p, (rec, got) in enumerate(zip(received, ranks)):
        where = f"rank {p}"
        assert got.expert_counts.tolist() == rec.counts, where
        assert got.expert_offsets.tolist() == rec.offsets, where
        used = rec.offsets[-1]
        assert got.recv_src[:used].tolist() == rec.recv_src, where
        assert got.table[:, :-1].tolist() == rec.table, where
        # the kernels' fingerprint (csrc/ep.cuh) is the one the a2a path computes in Python
        mark = layout.fingerprint(layout.capacity(world, max_tokens, k, experts, align), row_bytes(hidden, dtype, quant),
                                  k, align, max_tokens, experts, quant, hidden, dtype)
        assert got.table[:, -1].tolist() == [mark] * world, where
        assert torch.equal(got.send_rows[:tokens[p]], send_rows[p]), where
        assert not group_mismatches(got.recv_group, groups[p]), (where, group_mismatches(got.recv_group, groups[p]))
        # the a2a path's groups from the same entries (origin, row, weight)
        held = [r for r in range(used) if rec.recv_src[r] >= 0]
        origin = torch.tensor([rec.recv_src[r] for r in held], dtype=torch.int64)
        weight = torch.stack([ws[o // (max_tokens * k)][o // k % max_tokens, o % k] for o in origin.tolist()]) \
            if held else torch.empty(0)
        built = layout.groups(origin, torch.tensor(held, dtype=torch.int64), weight.float(), world, max_tokens, k)
        assert not group_mismatches(built, groups[p]), (where, group_mismatches(built, groups[p]))
        if rec.rows:
            filled = torch.tensor(sorted(rec.rows))
            want = [encode(xs[q][t:t + 1], quant, gs) for q, t in (rec.rows[r] for r in filled.tolist())]
            payload = torch.cat([_bytes(w[0]) for w in want])
            assert torch.equal(_bytes(got.recv)[filled], payload.view(len(filled), -1)), where
            if quant == "nvfp4":
                scales = (fp4.unswizzle_scales(got.scales, got.recv.shape[0], hidden // 16) if swizzle
                          else got.scales)
                assert torch.equal(_bytes(scales)[filled], torch.cat([w[1] for w in want])), where
            elif quant == "fp8":
                assert torch.equal(got.scales[filled], torch.cat([w[1] for w in want])), where
    if any(tokens):
        assert any(rank.recv.view(torch.uint8).ne(0xA5).any() for rank in ranks)
    # combine: expert outputs drawn per rank, in the received layout
    gen = torch.Generator().manual_seed(7)
    outs = [torch.randn(r.recv.shape[0], hidden, generator=gen).to(dtype) for r in ranks]
    for combine_quant in (None, "fp8") if hidden % 128 == 0 else (None,):
        want = world_combine(ids, ws, send_rows, outs, experts, combine_quant)
        got = host.combine_host(ranks, list(outs), list(ids), max_tokens, combine_quant)
        for q in range(world):
            assert torch.equal(_bytes(got[q]), _bytes(want[q])), f"combine {combine_quant} rank {q}"


@needs_twin
def test_twin_combine_adds_by_rank_in_slot_order_without_fusing():
    """Values whose sum depends on the association, the order and fused multiply-adds: the twin
    must give the reference's bits (each rank's entries as acc + w*y in slot order, rounded each
    step; then the ranks' partials in rank order), and the values must tell that sum from one sum
    over all slots (the per-entry combine), from reversed slots and from a fused multiply-add,
    or the test proves nothing."""
    experts, k, hidden = 8, 6, 16
    ids = [torch.tensor([[0, 4, 1, 5, 2, 6]]), torch.empty(0, k, dtype=torch.int64)]
    xs = [torch.ones(1, hidden, dtype=torch.float32), torch.empty(0, hidden, dtype=torch.float32)]
    weights = torch.tensor([-0.3, -1.0 / 3, -0.3, 1e-8, 1e-8, 1.0 / 3])
    ws = [weights[None], torch.empty(0, k)]
    values = (1.0 + 3 * 2**-23, 3.0)  # what experts 0-3 (rank 0) and 4-7 (rank 1) return
    ranks = host.dispatch_host(xs, ids, list(ws), experts, 1)
    _, send_rows = world_dispatch(ids, experts, 1)
    outs = [torch.full((r.recv.shape[0], hidden), v, dtype=torch.float32) for r, v in zip(ranks, values)]
    want = world_combine(ids, ws, send_rows, outs, experts)
    got = host.combine_host(ranks, outs, list(ids), 1)
    assert torch.equal(got[0], want[0])
    y = torch.tensor([values[0], values[1]] * 3, dtype=torch.float32)  # by slot
    zero = torch.zeros((), dtype=torch.float32)

    def by_rank(order: list[int], fused: bool) -> float:
        total = zero
        for slots in ([0, 2, 4], [1, 3, 5]):  # the slots rank 0 holds, then rank 1's
            acc = zero
            for j in (s for s in order if s in slots):
                acc = (weights[j].double() * y[j].double() + acc.double()).float() if fused else acc + weights[j] * y[j]
            total = total + acc
        return total.item()

    one_sum = zero
    for j in range(k):
        one_sum = one_sum + weights[j] * y[j]
    forward = list(range(k))
    sums = {want[0][0, 0].item(), one_sum.item(), by_rank(forward[::-1], False), by_rank(forward, True)}
    assert want[0][0, 0].item() == by_rank(forward, False)
    assert len(sums) == 4, sums


@needs_twin
def test_group_sums_never_follow_the_slots_after_a_list_ends():
    """recv_group's slots after a group's (-1, 0) are never written (a peer-push dispatch leaves
    what an earlier use of the pool left there), and the a2a combine may add up such a handle's
    groups: rows there must not be read, however large."""
    world, experts, k, hidden, max_tokens = 2, 8, 6, 16, 5
    xs, ids, ws = random_case(world, [4, 3], hidden, experts, k, seed=11)
    ranks = host.dispatch_host(list(xs), list(ids), list(ws), experts, max_tokens)
    gen = torch.Generator().manual_seed(3)
    for rank in ranks:
        listed = rank.recv_group.view(world * max_tokens, k, 2)
        held = listed[listed[:, 0, 0] >= 0]
        ended = torch.cumprod((held[..., 0] >= 0).int(), dim=1) == 0  # at and after each list's (-1, 0)
        after = ended & ~torch.cat([torch.zeros_like(ended[:, :1]), ~ended[:, :-1]], dim=1) & \
            torch.cat([torch.zeros_like(ended[:, :1]), ended[:, :-1]], dim=1)  # strictly after it
        assert after.any(), "the case should have groups shorter than k - 1"
        clean, dirty = held.clone(), held.clone()
        clean[after] = torch.tensor([-1, 0], dtype=torch.int32)
        dirty[after] = torch.tensor([123456789, 0x3F800000], dtype=torch.int32)  # a row past any buffer, weight 1
        y = torch.randn(rank.recv.shape[0], hidden, generator=gen).to(torch.bfloat16)
        assert torch.equal(layout.group_sums(y, dirty), layout.group_sums(y, clean))


@needs_twin
def test_the_twin_refuses_ranks_whose_dtypes_differ():
    """fp16 and bf16 rows have the same bytes: the dispatch's fingerprint and the combine's mark
    (csrc/ep.cuh) carry the dtype, and the twin, like the kernels, refuses ranks that differ."""
    experts, k, hidden, max_tokens = 4, 2, 16, 4
    xs, ids, ws = random_case(2, [2, 3], hidden, experts, k, seed=3)
    with pytest.raises(symcomm.CudaError, match="symcomm_ep_dispatch_host"):
        host.dispatch_host([xs[0].to(torch.float16), xs[1]], ids, list(ws), experts, max_tokens)
    ranks = host.dispatch_host(xs, ids, list(ws), experts, max_tokens)
    outs = [torch.randn(r.recv.shape[0], hidden).to(dtype) for r, dtype in zip(ranks, (torch.float16, torch.bfloat16))]
    with pytest.raises(symcomm.CudaError, match="symcomm_ep_combine_host"):
        host.combine_host(ranks, outs, list(ids), max_tokens)
    outs[0] = outs[0].to(torch.bfloat16)
    _, send_rows = world_dispatch(ids, experts, max_tokens)
    want = world_combine(ids, ws, send_rows, outs, experts)
    assert all(torch.equal(g, w) for g, w in zip(host.combine_host(ranks, list(outs), list(ids), max_tokens), want))


def test_fp8_blocks_round_trip_within_the_format():
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)) * 10
    x[1] = 0
    codes, scales = fp8.quantize(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (3, 2)
    assert torch.equal(scales[1], torch.ones(2))  # an all-zero block keeps scale 1 and codes 0
    back = fp8.dequantize(codes, scales, torch.float32)
    assert torch.equal(back[1], torch.zeros(256))
    rel = ((back - x).abs() / x.abs().clamp(min=1e-3))[[0, 2]]
    assert float(rel.max()) <= 2**-3  # e4m3 keeps 3 mantissa bits
    assert float(codes.float().abs().max()) == 448.0  # each block's largest value maps to the top code
