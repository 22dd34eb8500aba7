"""all_to_allv, MoE dispatch and combine end to end over gloo at 2 and 3 ranks (the CPU's a2a
path), against the single-process loop reference (tests/_ep_reference.py), bit for bit: rows
as they are, NVFP4 and FP8; zero-token ranks, experts nobody picks, every top-k from 1 to 8,
alignment. Every bad input raises before any communication, on every rank (and in check mode a
rank's refusal reaches its peers); torch.compile(fullgraph=True) traces the whole exchange.
"""
from __future__ import annotations

import re

import pytest
import torch

import symcomm
from _ep_reference import encode, group_mismatches, random_case, world_combine, world_dispatch, world_groups
from _spawn import run_world
from symcomm import fp4
from symcomm.pool import segment_bytes

WORLDS = (2, 3)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _tokens(world: int, case: int) -> list[int]:
    patterns = ([5, 0, 3], [0, 0, 4], [1, 6, 0], [4, 4, 4], [0, 2, 7], [3, 1, 2], [6, 0, 1], [2, 5, 5])
    return patterns[case % len(patterns)][:world]


def _check_dispatch(comm, rank, world, case, k, quant, align, experts, only=None, swizzle=False):
    hidden = 128 if quant == "fp8" else 32
    tokens = _tokens(world, case)
    max_tokens = max(tokens) + 1
    xs, ids, ws = random_case(world, tokens, hidden, experts, k, seed=100 * case + k + world, only_experts=only,
                              ids_dtype=torch.int32 if case % 2 else torch.int64)
    amax = max((float(x.float().abs().max()) for x in xs if x.numel()), default=1.0)
    gs = 448.0 * 6 / amax if quant == "nvfp4" else None
    got = comm.moe_dispatch(xs[rank], ids[rank], ws[rank], experts, max_tokens=max_tokens, quant=quant, global_scale=gs,
                        align=align, swizzle=swizzle)
    received, send_rows = world_dispatch(ids, experts, max_tokens, align)
    rec, where = received[rank], f"case {case} k {k} quant {quant} align {align} rank {rank}"
    assert got.expert_counts.tolist() == rec.counts, where
    assert got.expert_offsets.tolist() == rec.offsets, where
    assert got.handle.recv_src[:rec.offsets[-1]].tolist() == rec.recv_src, where
    assert torch.equal(got.handle.send_rows[:tokens[rank]], send_rows[rank]), where
    assert got.handle.table[:, :-1].tolist() == rec.table, where
    groups = world_groups(ids, ws, send_rows, experts, max_tokens)[rank]
    assert not group_mismatches(got.handle.recv_group, groups), (where, group_mismatches(got.handle.recv_group, groups))
    filled = sorted(rec.rows)
    if filled:
        want = [encode(xs[q][t:t + 1], quant, gs) for q, t in (rec.rows[r] for r in filled)]
        assert torch.equal(_bytes(got.x)[filled].reshape(-1), torch.cat([_bytes(w[0]).reshape(-1) for w in want])), where
        if quant is not None:
            scales = got.scales
            if swizzle:
                scales = fp4.unswizzle_scales(scales, got.x.shape[0], hidden // 16)
            assert torch.equal(_bytes(scales)[filled].reshape(-1),
                               torch.cat([_bytes(w[1]).reshape(-1) for w in want])), where
    # Expert outputs: every rank's drawn from one seed, so each rank knows all of them.
    gen = torch.Generator().manual_seed(case)
    outs = [torch.randn(got.x.shape[0], hidden, generator=gen).to(torch.bfloat16) for _ in range(world)]
    for combine_quant in (None, "fp8") if hidden % 128 == 0 else (None,):
        y = comm.moe_combine(outs[rank], got.handle, quant=combine_quant)
        want = world_combine(ids, ws, send_rows, outs, experts, combine_quant)[rank]
        assert torch.equal(_bytes(y), _bytes(want)), f"{where} combine {combine_quant}"
    return got


def _dispatch_world(rank, world):
    comm = symcomm.Communicator(timeout_s=60)
    experts = 4 * world
    case = 0
    for k in range(1, 9):
        for q, quant in enumerate((None, "nvfp4", "fp8")):
            # Each encoding meets each alignment (1, 4, 7) as k goes round; tying the alignment to
            # the case number gave every encoding one alignment only.
            _check_dispatch(comm, rank, world, case, k, quant, align=(1, 4, 7)[(k + q) % 3], experts=experts)
            case += 1
    # experts nobody picks: every token draws from two experts of the last rank and one of rank 0
    only = [0, experts - 1, experts - 2]
    got = _check_dispatch(comm, rank, world, 3, 2, None, 1, experts, only=only)
    if rank not in (0, world - 1):
        assert got.expert_offsets[-1] == 0 and got.expert_counts.tolist() == [0] * (experts // world)
    _check_dispatch(comm, rank, world, 5, 3, "nvfp4", 128, experts, swizzle=True)
    # the choice, and an all_to_allv path forcing a2a with it
    x, ids, w = torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    choice = comm.select("moe_dispatch", x, ids, w, experts, max_tokens=1)
    assert choice.algo == "a2a" and "peer-push" in choice.rejected, choice
    forced = comm.moe_dispatch(x, ids, w, experts, max_tokens=1, algo="torch").expert_counts.tolist()
    local = experts // world  # every rank's one token goes to expert 0, on rank 0
    assert forced == ([world] + [0] * (local - 1) if rank == 0 else [0] * local), forced
    assert "peer-push" in comm.capabilities()["operations"]["moe_dispatch"]
    comm.close()


@pytest.mark.parametrize("world", WORLDS)
def test_dispatch_and_combine_match_the_reference(world):
    run_world(_dispatch_world, world, timeout_s=300)


def _all_to_allv_world(rank, world):
    comm = symcomm.Communicator(check=True, timeout_s=60)
    # rank q sends (q + p) % 3 rows to rank p: zeros included; rows tagged by origin
    send = [(rank + p) % 3 for p in range(world)]
    recv = [(q + rank) % 3 for q in range(world)]
    rows = torch.cat([torch.full((n, 4), float(100 * rank + p)) for p, n in enumerate(send)])
    tags = torch.arange(sum(send), dtype=torch.int64) + 1000 * rank
    got, got_tags = comm.all_to_allv([rows, tags], send, recv)
    want = torch.cat([torch.full((n, 4), float(100 * q + rank)) for q, n in enumerate(recv)])
    assert torch.equal(got, want)
    starts = [sum((q + p) % 3 for p in range(rank)) for q in range(world)]
    want_tags = torch.cat([torch.arange(n) + starts[q] + 1000 * q for q, n in enumerate(recv)])
    assert torch.equal(got_tags, want_tags)
    single = comm.all_to_allv(rows.to(torch.bfloat16), send, recv)
    assert torch.equal(single, want.to(torch.bfloat16))
    # fp8 and an empty call on every rank
    assert comm.all_to_allv(rows.to(torch.float8_e4m3fn), send, recv).float().equal(want.to(torch.float8_e4m3fn).float())
    assert comm.all_to_allv(torch.empty(0, 3), [0] * world, [0] * world).shape == (0, 3)
    # check mode compares the counts every rank states: rank 0 claims one row too many from rank 1
    bad = list(recv)
    if rank == 0:
        bad[1] += 1
    with pytest.raises(symcomm.PeerMismatchError, match=r"rank 1 sends \d+ rows to rank 0, but rank 0 expects"):
        comm.all_to_allv(rows, send, bad)
    comm.close()


@pytest.mark.parametrize("world", WORLDS)
def test_all_to_allv_moves_uneven_rows(world):
    run_world(_all_to_allv_world, world, timeout_s=180)


def _idle_rank_world(rank, world):
    """Rank 0 sends and receives nothing; every other rank sends rows to itself only. Each rank's
    own bytes differ, so they must not decide whether it takes part: the torch path's
    all_to_all_single (and the a2a MoE path's inner one) is a collective every rank joins."""
    comm = symcomm.Communicator(timeout_s=30)
    send = [0] * world
    if rank:
        send[rank] = 3
    x = torch.arange(4.0 * send[rank]).view(send[rank], 4) + 100 * rank
    assert torch.equal(comm.all_to_allv(x, send, send), x)
    after = comm.all_to_allv(torch.full((world, 4), float(rank)), [1] * world, [1] * world)
    assert after[:, 0].tolist() == [float(q) for q in range(world)], "the next call met its own partners"
    # MoE over a2a, decode with an idle rank: rank 0 has no tokens, the others pick their own experts
    experts, hidden = 2 * world, 16
    n = 0 if rank == 0 else 3
    tokens = torch.randn(n, hidden)
    ids = torch.tensor([[2 * rank, 2 * rank + 1]] * n, dtype=torch.int32).view(n, 2)
    got = comm.moe_dispatch(tokens, ids, torch.ones(n, 2), experts, max_tokens=4)
    y = comm.moe_combine(got.x, got.handle)
    assert torch.equal(y, (tokens.double() * 2).to(tokens.dtype)), "each token comes back from its two experts"
    comm.close()


@pytest.mark.parametrize("world", WORLDS)
def test_a_rank_with_nothing_to_send_or_receive_still_takes_part(world):
    run_world(_idle_rank_world, world, timeout_s=120)


def _bad_inputs(rank, world):
    comm = symcomm.Communicator(timeout_s=30)
    E, H = 2 * world, 32
    gen = torch.Generator().manual_seed(rank)
    x, w = torch.randn(3, H, dtype=torch.bfloat16, generator=gen), torch.rand(3, 2, generator=gen)
    ids = torch.tensor([[0, 1], [1, -1], [E - 1, 0]])
    ok = dict(max_tokens=4)
    D, A = symcomm.DtypeError, symcomm.ArgumentError
    cases = [
        ((torch.arange(6).view(3, 2), ids, w, E), ok, D, "x must be bfloat16"),
        ((x[0], ids, w, E), ok, A, "x must be 2-D"),
        ((x, ids.float(), w, E), ok, D, "topk_ids must be int32 or int64"),
        ((x, ids[:2], w, E), ok, A, r"topk_ids must be \[3, k\]"),
        ((x, ids, w[:, :1].contiguous(), E), ok, A, "topk_weights must have topk_ids. shape"),
        ((x, ids, w.int(), E), ok, D, "topk_weights must be float32"),
        ((x, ids, w, E + 1), ok, A, "num_experts .* must be a multiple of the world size"),
        ((x, ids, w, True), ok, A, "num_experts must be an int"),
        ((x, torch.zeros(3, 3 * world, dtype=torch.int64), torch.ones(3, 3 * world), E), ok, A, "only"),
        ((x, ids, w, E), {}, A, "max_tokens is required"),
        ((x, ids, w, E), dict(max_tokens=2), A, r"x has 3 tokens, more than max_tokens \(2\)"),
        ((x, ids, w, E), dict(max_tokens=4, quant="int4"), A, "quant must be None, 'nvfp4' or 'fp8'"),
        ((x, ids, w, E), dict(max_tokens=4, quant="nvfp4"), A, "quant='nvfp4' needs global_scale"),
        ((x[:, :24].contiguous(), ids, w, E), dict(max_tokens=4, quant="nvfp4", global_scale=1.0), A, "multiple of 16"),
        ((x, ids, w, E), dict(max_tokens=4, quant="fp8"), A, "multiple of 128 for FP8"),
        ((x.float(), ids, w, E), dict(max_tokens=4, quant="fp8"), D, "quant='fp8' takes bfloat16 or float16 x"),
        ((x, ids, w, E), dict(max_tokens=4, global_scale=2.0), A, "global_scale is NVFP4's"),
        ((x, ids, w, E), dict(max_tokens=4, swizzle=True), A, "swizzle=True lays out NVFP4"),
        ((x, ids, w, E), dict(max_tokens=4, align=0), A, "align must be an int"),
        ((x, ids + E, w, E), ok, A, r"topk_ids\[0, 0\] = .* is outside \[-1,"),
        ((x, torch.tensor([[0, 0], [1, -1], [0, 1]]), w, E), ok, A, r"topk_ids\[0\] names expert 0 twice"),
        ((x, ids, w, E), dict(max_tokens=4, out=(1, 2)), A, "out must be a Dispatched"),
    ]
    for args, kwargs, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            comm.moe_dispatch(*args, **kwargs)
    # moe_dispatch_nbytes refuses the same sizes, with the same rule (a pool sized for arguments
    # the dispatch then refuses, or the reverse, would surface only at the first step)
    wide_ids, wide_w = torch.zeros(3, 3 * world, dtype=torch.int64), torch.ones(3, 3 * world)
    for rows, topk_ids, topk_weights, sizes, error, pattern in [
        (x, ids, w, dict(num_experts=E + 1, max_tokens=4), A, "multiple of the world size"),
        (x, wide_ids, wide_w, dict(num_experts=E, max_tokens=4), A, "only"),
        (x, ids, w, dict(num_experts=E, max_tokens=None), A, "max_tokens is required"),
        (x, ids, w, dict(num_experts=E, max_tokens=1 << 30), A, r"must stay below 2\*\*31"),
        (x, ids, w, dict(num_experts=E, max_tokens=4, quant="int4"), A, "quant must be None"),
        (x, ids, w, dict(num_experts=E, max_tokens=4, quant="fp8"), A, "multiple of 128 for FP8"),
        (x.float(), ids, w, dict(num_experts=E, max_tokens=4, quant="fp8"), D, "takes bfloat16 or float16"),
        (x, ids, w, dict(num_experts=E, max_tokens=4, swizzle=True), A, "swizzle=True lays out NVFP4"),
        (x, ids, w, dict(num_experts=E, max_tokens=4, align=0), A, "align must be an int"),
    ]:
        with pytest.raises(error, match=pattern):
            comm.moe_dispatch(rows, topk_ids, topk_weights, **sizes)
        with pytest.raises(error, match=pattern):
            symcomm.moe_dispatch_nbytes(world, topk=topk_ids.shape[1], hidden=H, dtype=rows.dtype, **sizes)
    got = comm.moe_dispatch(x, ids, w, E, max_tokens=4)  # nothing was half-sent: the ranks still agree
    with pytest.raises(A, match=r"out.x has shape"):
        comm.moe_dispatch(x, ids, w, E, max_tokens=5, out=got)
    y = torch.zeros(got.x.shape, dtype=torch.bfloat16)
    for args, kwargs, error, pattern in [
        ((y, "handle"), {}, A, "handle must be the EpHandle"),
        ((y[1:], got.handle), {}, A, "expert_out has shape"),
        ((y.float(), got.handle), {}, D, "expert_out must be torch.bfloat16"),
        ((y, got.handle), dict(quant="nvfp4"), A, "quant must be None or 'fp8'"),
        ((y, got.handle), dict(quant="fp8"), A, "multiple of 128"),
        ((y, got.handle), dict(out=torch.zeros(2, H, dtype=torch.bfloat16)), A, "out has shape"),
    ]:
        with pytest.raises(error, match=pattern):
            comm.moe_combine(*args, **kwargs)
    # float32 rows are never quantized, on any path: quant must not decide a path (moe_dispatch.check_quant_dtype)
    wide = comm.moe_dispatch(x.float(), ids, w, E, max_tokens=4)
    with pytest.raises(D, match="quant='fp8' takes bfloat16 or float16 expert_out"):
        comm.moe_combine(torch.zeros(wide.x.shape[0], H), wide.handle, quant="fp8")
    selfish = [1] * world
    selfish[rank] = 2
    for args, pattern in [((torch.zeros(3, 2), [1] * (world + 1), [1] * world), "send_sizes must have one entry"),
                          ((torch.zeros(world + 2, 2), [1] * world, [1] * world), "rows, but send_sizes add up"),
                          ((torch.zeros(world, 2), [1] * world, [-1] + [1] * (world - 1)), r"recv_sizes\[0\] must be"),
                          ((torch.zeros(world + 1, 2), selfish, [1] * world),
                           rf"send_sizes\[{rank}\] \(2\) and recv_sizes\[{rank}\] \(1\) must be equal")]:
        with pytest.raises(A, match=pattern):
            comm.all_to_allv(*args)
    buf = torch.zeros(2 * world, 2)
    with pytest.raises(A, match="overlaps"):
        comm.all_to_allv(buf[:world], [1] * world, [1] * world, out=buf[1:world + 1])
    # Still in step: each expert returns the row it was sent, so a token comes back as itself
    # times the sum of its valid entries' weights (token 1's second entry is -1).
    valid = (ids >= 0).float()
    want = (x.double() * (w.double() * valid).sum(1, keepdim=True)).to(torch.bfloat16)
    torch.testing.assert_close(comm.moe_combine(got.x, got.handle), want)
    comm.close()
    # check mode: one rank's refusal reaches its peers, who raise with its reason
    comm = symcomm.Communicator(check=True, timeout_s=30)
    if rank == 1:
        with pytest.raises(A, match="more than max_tokens"):
            comm.moe_dispatch(x, ids, w, E, max_tokens=2)
    else:
        with pytest.raises(symcomm.PeerMismatchError, match="rank.* 1 rejected the call.*more than max_tokens"):
            comm.moe_dispatch(x, ids, w, E, max_tokens=4)
    with pytest.raises(symcomm.PeerMismatchError, match=r"max_tokens \(rank 0: 4, rank 1: 5"):
        comm.moe_dispatch(x, ids, w, E, max_tokens=5 if rank == 1 else 4)
    got = comm.moe_dispatch(x, ids, w, E, max_tokens=4)
    if rank == 1:
        with pytest.raises(A, match="multiple of 128"):
            comm.moe_combine(y, got.handle, quant="fp8")
    else:
        with pytest.raises(symcomm.PeerMismatchError, match="rejected the call.*multiple of 128"):
            comm.moe_combine(y, got.handle)
    x2 = torch.randn(3, 128, dtype=torch.bfloat16)
    got2 = comm.moe_dispatch(x2, ids, w, E, max_tokens=4)
    y2 = torch.zeros(got2.x.shape, dtype=torch.bfloat16)
    with pytest.raises(symcomm.PeerMismatchError, match=r"quant \(rank 0: none, rank 1: fp8"):
        comm.moe_combine(y2, got2.handle, quant="fp8" if rank == 1 else None)
    # CPU ids are checked in build(); a rank with a repeated id refuses, its peers learn why
    dup = torch.tensor([[0, 0], [1, -1], [0, 1]]) if rank == 0 else ids
    with pytest.raises(A if rank == 0 else symcomm.PeerMismatchError, match="names expert 0 twice"):
        comm.moe_dispatch(x, dup, w, E, max_tokens=4)
    comm.close()


@pytest.mark.parametrize("world", WORLDS)
def test_every_bad_input_raises_before_communication_on_every_rank(world):
    run_world(_bad_inputs, world, timeout_s=180)


def _disagreeing_ranks(rank, world):
    """Without check mode, the a2a path itself stops ranks that passed another dtype to a dispatch
    or another quant to a combine, on every rank, before a row moves; then an agreeing call gives
    the reference's bits, so the communicator is still usable."""
    comm = symcomm.Communicator(timeout_s=30, check=False)  # the paths' own checks, whatever SYMCOMM_CHECK says
    E, H, k, max_tokens = 2 * world, 128, 2, 4
    xs, ids, ws = random_case(world, [3] * world, H, E, k, seed=41)
    mixed = xs[rank].to(torch.float16 if rank == world - 1 else torch.bfloat16)  # the same bytes per row
    with pytest.raises(symcomm.PeerMismatchError, match="different sizes.*dtype"):
        comm.moe_dispatch(mixed, ids[rank], ws[rank], E, max_tokens=max_tokens)
    got = comm.moe_dispatch(xs[rank], ids[rank], ws[rank], E, max_tokens=max_tokens)
    gen = torch.Generator().manual_seed(42)
    outs = [torch.randn(got.x.shape, generator=gen).to(torch.bfloat16) for _ in range(world)]
    names = ", ".join(f"rank {r}: {'fp8' if r == world - 1 else 'none'}" for r in range(world))
    with pytest.raises(symcomm.PeerMismatchError, match=re.escape(f"different quant ({names})")):
        comm.moe_combine(outs[rank], got.handle, quant="fp8" if rank == world - 1 else None)
    _, send_rows = world_dispatch(ids, E, max_tokens)
    want = world_combine(ids, ws, send_rows, outs, E)[rank]
    assert torch.equal(comm.moe_combine(outs[rank], got.handle), want)
    comm.close()


@pytest.mark.parametrize("world", WORLDS)
def test_ranks_that_disagree_stop_alike_without_check_mode(world):
    run_world(_disagreeing_ranks, world, timeout_s=180)


def _compiled(rank, world):
    comm = symcomm.Communicator(timeout_s=60)
    E, H = 2 * world, 32
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(4, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(4)])
    w = torch.rand(4, 2, generator=gen)

    def step(x, ids, w):
        d = comm.moe_dispatch(x, ids, w, E, max_tokens=4)
        return comm.moe_combine(d.x * 2, d.handle) + 1

    compiled = torch.compile(step, fullgraph=True)
    assert torch.equal(compiled(x, ids, w), step(x, ids, w))
    comm.close()


def test_torch_compile_fullgraph_traces_dispatch_and_combine():
    run_world(_compiled, 2, timeout_s=300)


def _single_rank(rank, world):
    """A world of one: every row's place is known on the device, so dispatch and combine read no
    count on the host (what lets a one-rank step be captured); the same layout and bits."""
    comm = symcomm.Communicator()
    for quant in (None, "nvfp4", "fp8"):
        # no tokens at all (how the example allocates its buffers), then a few
        empty = comm.moe_dispatch(torch.empty(0, 128, dtype=torch.bfloat16), torch.empty(0, 3, dtype=torch.int64),
                                  torch.empty(0, 3), 5, max_tokens=7, quant=quant,
                                  global_scale=2.0 if quant == "nvfp4" else None)
        assert empty.expert_offsets.tolist() == [0] * 6
        h = empty.handle
        held = [empty.x, empty.scales, empty.expert_counts, empty.expert_offsets, h.send_rows, h.recv_src, h.table,
                h.returned, h.recv_group]
        assert symcomm.moe_dispatch_nbytes(1, 7, 3, 5, 128, torch.bfloat16, quant) == sum(
            segment_bytes(t.nbytes) for t in held if t is not None), quant
        y = torch.zeros(empty.x.shape[0], 128, dtype=torch.bfloat16)
        assert comm.moe_combine(y, empty.handle).shape == (0, 128)
        for align in (1, 4):
            xs, ids, ws = random_case(1, [6], 128, 5, 3, seed=align, skip=0.3)
            got = comm.moe_dispatch(xs[0], ids[0], ws[0], 5, max_tokens=7, quant=quant,
                                    global_scale=2.0 if quant == "nvfp4" else None, align=align)
            received, send_rows = world_dispatch(ids, 5, 7, align)
            rec = received[0]
            assert got.expert_offsets.tolist() == rec.offsets
            assert got.handle.recv_src[:rec.offsets[-1]].tolist() == rec.recv_src
            assert torch.equal(got.handle.send_rows[:6], send_rows[0])
            filled = sorted(rec.rows)
            want = torch.cat([_bytes(encode(xs[0][t:t + 1], quant, 2.0)[0]).reshape(1, -1)
                              for _, t in (rec.rows[r] for r in filled)])
            assert torch.equal(_bytes(got.x).reshape(got.x.shape[0], -1)[filled], want)
            y = torch.randn(got.x.shape[0], 128).to(torch.bfloat16)
            for combine_quant in (None, "fp8"):
                out = comm.moe_combine(y, got.handle, quant=combine_quant)
                assert torch.equal(out, world_combine(ids, ws, send_rows, [y], 5, combine_quant)[0])
    comm.close()


def test_a_world_of_one_places_rows_on_the_device():
    run_world(_single_rank, 1, timeout_s=120)


@pytest.mark.parametrize("change, error, match", [
    ({"world": 3}, symcomm.ArgumentError, r"num_experts \(256\) must be a multiple of the world size \(3\)"),
    ({"max_tokens": 0}, symcomm.ArgumentError, "max_tokens must be an int from 1"),
    ({"topk": 257}, symcomm.ArgumentError, r"top-k is 257 experts per token, but there are only 256"),
    ({"max_tokens": 1 << 27}, symcomm.ArgumentError, r"must stay below 2\*\*31"),
    ({"quant": "int8"}, symcomm.ArgumentError, "quant must be None, 'nvfp4' or 'fp8'"),
    ({"quant": "fp8", "hidden": 7200}, symcomm.ArgumentError, r"hidden size of rows \(7200\) must be a multiple of 128"),
    ({"quant": "nvfp4", "dtype": torch.float32}, symcomm.DtypeError, "takes bfloat16 or float16"),
    ({"dtype": torch.int8}, symcomm.DtypeError, "dtype must be bfloat16, float16 or float32"),
    ({"swizzle": True}, symcomm.ArgumentError, "swizzle=True lays out NVFP4 block scales"),
    ({"align": 0}, symcomm.ArgumentError, "align must be an int from 1"),
])
def test_dispatch_pool_size_names_the_bad_argument(change, error, match):
    args = {"world": 2, "max_tokens": 16, "topk": 8, "num_experts": 256, "hidden": 7168, **change}
    with pytest.raises(error, match=match):
        symcomm.moe_dispatch_nbytes(**args)


def test_dispatch_pool_size_is_each_buffers_allocator_segment():
    """Hand-counted, each buffer's segment (2 MiB up to 1 MiB, 20 MiB below 10 MiB, whole 2 MiB
    above). 2 ranks, 1,024 tokens, top-8 of 256, hidden 7168: 16,384 received rows (224 MiB in
    bf16; 56 MiB NVFP4 + 7 MiB scales -> a 20 MiB segment; 112 MiB FP8 + 3.5 MiB scales -> 20), 28
    MiB of returned partials in bf16, and six small buffers at 2 MiB each (the counts table,
    recv_src, recv_group, send_rows, the local counts and offsets)."""
    size = lambda **kw: symcomm.moe_dispatch_nbytes(2, 1024, 8, 256, 7168, **kw) >> 20  # noqa: E731
    assert (size(), size(quant="nvfp4"), size(quant="fp8")) == (224 + 28 + 12, 56 + 20 + 28 + 12, 112 + 20 + 28 + 12)
    # 8 ranks, 128 tokens, NVFP4 with swizzled scales and align=128: 8 * 128 * 8 + 32 * 127 = 12,256
    # rows (41.9 MiB -> 42), the scales padded to 12,288 x 448 (5.25 MiB -> 20), 1,024 returned
    # rows (14 MiB), six small buffers (12).
    assert symcomm.moe_dispatch_nbytes(8, 128, 8, 256, 7168, torch.bfloat16, "nvfp4", True, 128) >> 20 == 42 + 20 + 14 + 12
