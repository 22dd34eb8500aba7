"""moe_dispatch / moe_combine on real ranks, every path and quantization.

Every rank regenerates every rank's tokens and routing, so it can say what each received row
must hold: the source row itself (bf16), or that row quantized by symcomm.ep.fp8 / symcomm.fp4
(FP8, NVFP4), bit for bit. The combine is checked against symcomm.ep.layout.combine_by_rank of
the same values, bit for bit, with an "expert" that scales each row by a factor of its expert, so a
row returned to the wrong slot shows. Tokens are normal-distributed (small values reach FP8's
subnormals), and one case gives a rank no tokens at all.
"""
from __future__ import annotations

import gc

import pytest
import torch

import symcomm
from symcomm import fp4
from symcomm.ep import fp8, layout

K, E = 8, 256  # DeepSeek-V3's top-8 of 256 experts
# (tokens per rank, hidden): 4096 tokens at a smaller hidden so the receive buffers fit the pool.
SIZES = ((1, 7168), (8, 7168), (64, 7168), (512, 7168), (2048, 7168), (4096, 1024))
PATHS = ("peer-push", "a2a")
QUANTS = ((None, None), ("fp8", "fp8"), ("nvfp4", None), (None, "fp8"))


@pytest.fixture(scope="module")
def comm(dist_env):
    """A communicator of this module's own, its pool sized for 2,048 tokens of hidden 7168 (receive
    rows, expert outputs, returned rows: about 1.2 GiB), so the session's pool and its offsets are
    left as the other modules expect them."""
    c = symcomm.Communicator(symmetric_capacity=3 << 30, check=True)
    yield c
    c.close()


@pytest.fixture(autouse=True)
def _free_buffers():
    """Every rank frees a test's pool buffers at the same point (not whenever its garbage collector
    runs), so the next test's buffers take equal offsets everywhere, as the peer path needs."""
    yield
    gc.collect()
    torch.cuda.synchronize()


def _tokens(world: int, rank: int, tokens: int, zero_rank: bool) -> int:
    return 0 if zero_rank and rank == world - 1 else tokens


def _routing(rank: int, tokens: int, hidden: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    x = torch.randn(tokens, hidden, generator=gen, device=device, dtype=torch.float32)
    if tokens > 2:
        x[1] = 0.0  # an all-zero row: FP8 scale 1, NVFP4 scale 0
        x[2, :64] *= 1e4  # one block far above the rest of its row
    ids = torch.rand(tokens, E, generator=gen, device=device).topk(K, dim=1).indices.to(torch.int32)
    weights = torch.rand(tokens, K, generator=gen, device=device)
    return x.to(torch.bfloat16), ids, weights


def _factor(ids: torch.Tensor) -> torch.Tensor:
    """The test's expert: row times 1 + (e % 7) / 8, so each expert's output differs."""
    return 1.0 + (ids.long() % 7).float() / 8.0


def _first_diffs(got: torch.Tensor, want: torch.Tensor, extra: str = "", n: int = 5) -> str:
    bad = (got != want).nonzero()
    rows = [f"{tuple(i.tolist())}: got {got[tuple(i)].item()} want {want[tuple(i)].item()}" for i in bad[:n]]
    return f"{bad.shape[0]} of {got.numel()} differ{extra}; first: " + "; ".join(rows)


def _decode(quant, rows: torch.Tensor, scales, gs, dtype) -> torch.Tensor:
    if quant == "fp8":
        return fp8.dequantize(rows, scales, dtype)
    if quant == "nvfp4":
        return fp4.dequantize(rows, scales, gs, dtype)
    return rows


def _run(comm, tokens: int, hidden: int, quant, combine_quant, algo: str, zero_rank: bool = False, seed: int = 3):
    world, rank, dev = comm.world_size, comm.rank, comm.device
    counts = [_tokens(world, r, tokens, zero_rank) for r in range(world)]
    every = [_routing(r, counts[r], hidden, seed, dev) for r in range(world)]
    x, ids, weights = every[rank]
    gs = fp4.global_scale_for(torch.cat([e[0] for e in every])) if quant == "nvfp4" else None
    max_tokens, local = max(counts), E // world
    # Only the peer path needs its buffers in the pool. The a2a path allocates temporaries whose
    # sizes are each rank's own counts: inside the pool they would leave rank-dependent holes that
    # shift every later pool tensor (check mode then refuses the next peer-path dispatch).
    with symcomm.use_symmetric_memory(comm, disabled=algo != "peer-push"):
        d = comm.moe_dispatch(x, ids, weights, E, max_tokens=max_tokens, quant=quant, global_scale=gs, algo=algo)
    used = int(d.expert_offsets[-1])
    src = d.handle.recv_src[:used].long()
    slots = max_tokens * K
    owner, token, slot = src // slots, (src % slots) // K, src % K
    what = f"{algo} quant={quant} tokens={counts} hidden={hidden}"

    # Which entries must arrive here, each once.
    want_entries = sorted(((r * max_tokens + t) * K + j) for r in range(world)
                          for t, j in (every[r][1].long() // local == rank).nonzero().tolist())
    assert sorted(src.tolist()) == want_entries, f"{what}: the received entries differ from the routing"
    x_all = torch.zeros(world, max_tokens, hidden, dtype=torch.bfloat16, device=dev)
    ids_all = torch.zeros(world, max_tokens, K, dtype=torch.int32, device=dev)
    for r, (rx, rids, _) in enumerate(every):
        x_all[r, :counts[r]], ids_all[r, :counts[r]] = rx, rids
    expert = ids_all[owner, token, slot]
    local_expert = expert.long() - rank * local
    assert torch.equal(d.expert_counts.long().cpu(), torch.bincount(local_expert.cpu(), minlength=local)), what
    row_expert = torch.repeat_interleave(torch.arange(local), d.expert_counts.long().cpu()).to(dev)
    assert torch.equal(row_expert, local_expert), f"{what}: rows are not grouped by local expert"

    # Every received row bit for bit.
    sent = x_all[owner, token]
    if quant == "fp8":
        codes, scales = fp8.quantize(sent)
        got_scales = d.scales[:used]
        assert torch.equal(got_scales.view(torch.int32), scales.view(torch.int32)), \
            f"{what}: FP8 scales " + _first_diffs(got_scales.view(torch.int32), scales.view(torch.int32))
        got = d.x[:used].view(torch.uint8)
        want = codes.view(torch.uint8)
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[:5]
            detail = "; ".join(f"row {r} col {c}: code {got[r, c].item():#04x} want {want[r, c].item():#04x} "
                               f"x {sent[r, c].item()!r} scale {scales[r, c // 128].item()!r}" for r, c in bad.tolist())
            pytest.fail(f"{what}: FP8 codes {(got != want).sum().item()} of {got.numel()} differ: {detail}")
    elif quant == "nvfp4":
        packed, scales = fp4.quantize(sent, gs)
        assert torch.equal(d.x[:used], packed), f"{what}: NVFP4 payload " + _first_diffs(d.x[:used], packed)
        got_s, want_s = d.scales[:used].view(torch.uint8), scales.view(torch.uint8)
        assert torch.equal(got_s, want_s), f"{what}: NVFP4 scales " + _first_diffs(got_s, want_s)
    else:
        assert torch.equal(d.x[:used].view(torch.int16), sent.view(torch.int16)), \
            f"{what}: rows " + _first_diffs(d.x[:used].view(torch.int16), sent.view(torch.int16))

    # Combine: the expert scales row r by its expert's factor, in fp32, rounded once to bf16.
    decoded = _decode(quant, d.x[:used], None if d.scales is None else d.scales[:used], gs, torch.bfloat16)
    capacity = d.x.shape[0]
    expert_out = torch.empty(capacity, hidden, dtype=torch.bfloat16, device=dev)  # read locally: any memory
    expert_out.fill_(float("nan"))  # rows past `used` must never be read
    expert_out[:used] = (decoded.float() * _factor(expert).to(dev).unsqueeze(1)).to(torch.bfloat16)
    out = comm.moe_combine(expert_out, d.handle, quant=combine_quant, algo=algo)
    mine = _decode(quant, *(fp8.quantize(x) if quant == "fp8" else fp4.quantize(x, gs) if quant == "nvfp4"
                            else (x, None)), gs, torch.bfloat16) if x.shape[0] else x
    values = (mine.float().unsqueeze(1) * _factor(ids).unsqueeze(2)).to(torch.bfloat16)
    ranks = ids.long() // (E // comm.world_size)
    want_out = layout.combine_by_rank(values.float(), weights, torch.ones_like(ids, dtype=torch.bool), ranks,
                                      comm.world_size, torch.bfloat16, combine_quant)
    assert out.shape == x.shape
    assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)), \
        f"{what} combine={combine_quant}: " + _first_diffs(out.float(), want_out.float())


@pytest.mark.parametrize("algo", PATHS)
@pytest.mark.parametrize("quant,combine_quant", QUANTS)
@pytest.mark.parametrize("tokens,hidden", SIZES)
def test_dispatch_and_combine_match_the_reference(comm, algo, quant, combine_quant, tokens, hidden):
    if algo not in comm.algorithms("moe_dispatch"):
        pytest.fail(f"{algo} is off: {comm.capabilities()}")
    _run(comm, tokens, hidden, quant, combine_quant, algo)


@pytest.mark.parametrize("algo", PATHS)
@pytest.mark.parametrize("quant,combine_quant", QUANTS[:3])
def test_a_rank_with_no_tokens(comm, algo, quant, combine_quant):
    _run(comm, 64, 7168, quant, combine_quant, algo, zero_rank=True)


@pytest.mark.parametrize("quant,combine_quant", QUANTS[:3])
def test_graph_replay_equals_eager(comm, quant, combine_quant):
    """Dispatch + combine captured once, replayed on new tokens: the bits of an eager call."""
    dev, rank, world = comm.device, comm.rank, comm.world_size
    tokens, hidden = 64, 7168
    x, ids, weights = _routing(rank, tokens, hidden, 5, dev)
    gs = torch.ones(1, device=dev) if quant == "nvfp4" else None
    with symcomm.use_symmetric_memory(comm):
        d = comm.moe_dispatch(x, ids, weights, E, max_tokens=tokens, quant=quant, global_scale=gs)
        expert_out = torch.zeros(d.x.shape[0], hidden, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(x)

    def step():
        got = comm.moe_dispatch(x, ids, weights, E, max_tokens=tokens, quant=quant, global_scale=gs, out=d)
        expert_out.copy_(_decode(quant, got.x, got.scales, gs, torch.bfloat16))
        comm.moe_combine(expert_out, got.handle, quant=combine_quant, out=out)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with comm.graph_capture(), torch.cuda.graph(graph):
        step()
    for seed in (6, 7):
        nx, nids, nw = _routing(rank, tokens, hidden, seed, dev)
        x.copy_(nx), ids.copy_(nids), weights.copy_(nw)
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        step()
        torch.cuda.synchronize()
        assert torch.equal(replayed.view(torch.int16), out.view(torch.int16)), \
            f"quant={quant} seed {seed} world {world}: " + _first_diffs(replayed.float(), out.float())
    del graph


def test_references_round_the_same_on_the_gpu_as_on_the_cpu(comm):
    """symcomm.ep.fp8 and symcomm.fp4's references define the formats for every device: on CUDA
    tensors they must give the bits they give on the CPU (torch divides a CUDA tensor by a
    Python number as a multiply by the reciprocal, one unit in the last place off)."""
    x = torch.randn(4096, 7168, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    on_gpu, on_cpu = fp8.quantize(x.to(comm.device)), fp8.quantize(x)
    for got, want, name in zip(on_gpu, on_cpu, ("codes", "scales")):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), f"fp8 {name} differ"
    gs = 448 * 6 / 7.0
    on_gpu, on_cpu = fp4.quantize_reference(x.to(comm.device), gs), fp4.quantize_reference(x, gs)
    for got, want, name in zip(on_gpu, on_cpu, ("packed", "scales")):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), f"nvfp4 {name} differ"
