"""NVFP4 on GPUs: csrc/fp4.cu's kernels bit for bit against the torch reference (run on the CPU),
and all_gatherv_fp4 across ranks against the reference gather of the reference quantization.

(Named test_fp4_gpu.py: pytest cannot collect two test modules with one basename.)
"""
from __future__ import annotations

import pytest
import torch

import symcomm
from _data import DTYPES, assert_symmetric_served, rank_input
from symcomm import fp4
from symcomm.peer import context as peer_context

SHAPES = [(0, 16), (1, 16), (7, 32), (33, 7168), (1000, 4096), (4097, 16), (3, 65536)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def _assert_same(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert tuple(got.shape) == tuple(ref.shape), f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    diff = (_bytes(got) != _bytes(ref)).sum().item()
    assert diff == 0, f"{what}: {diff} of {ref.numel()} elements differ"


def _assert_same_values(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Bitwise, except that any NaN matches any NaN (CUDA's and torch's NaN bits differ)."""
    got, ref = got.cpu(), ref.cpu()
    assert torch.equal(got.isnan(), ref.isnan()), what
    _assert_same(torch.where(got.isnan(), 0, got), torch.where(ref.isnan(), 0, ref), what)


def _cpu_input(shape, dtype, seed) -> torch.Tensor:
    """Gaussian rows whose magnitudes spread over 10^-3..10^3, with an all-zero block, -0 and
    a NaN-free, non-trivial mix of signs; generated on the CPU so the reference sees the same."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if shape[0]:
        x *= torch.logspace(-3, 3, shape[0]).unsqueeze(1)[torch.randperm(shape[0], generator=gen)]
        x[0, :16] = 0.0
        x[-1, -16:] = -0.0
    return x.to(dtype)


def _edge_rows(dtype) -> torch.Tensor:
    """Every e2m1 tie at scale 1 and every e4m3 scale tie: where device rounding could differ."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    rows = [[6.0] + ties + [-t for t in ties] + [-6.0]]
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    for a, b in zip(e4m3, e4m3[1:]):
        m = (a + b) / 2
        rows.append([6.0 * m, -2.5 * m, 0.3 * m, -0.0] + [m * (i - 6) / 2 for i in range(12)])
    rows.append([float("inf"), -float("inf")] + [3.0] * 14)
    rows.append([float("nan")] + [1.0] * 15)
    return torch.tensor(rows).to(dtype)


def test_native_kernels_are_loaded():
    ok, why = fp4.native_available()
    assert ok, f"csrc/fp4.cu is not loaded ({why}): the GPU tests below would only test the reference"


@pytest.mark.parametrize("swizzle", (False, True))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_matches_reference(comm, dtype, shape, swizzle):
    assert fp4.native_available()[0]
    x = _cpu_input(shape, dtype, hash(shape) % 1000)
    gs = fp4.global_scale_for(x).item()
    ref = fp4.quantize_reference(x, gs, swizzle)
    xd = x.to(comm.device)
    for arg in (gs, torch.tensor([gs], device=comm.device)):  # a float, and a device pointer
        packed, scales = fp4.quantize(xd, arg, swizzle)
        what = f"{dtype} {shape} swizzle={swizzle} gs as {type(arg).__name__}"
        _assert_same(packed, ref[0], "packed " + what)
        _assert_same(scales, ref[1], "scales " + what)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rounding_edges_match_reference(comm, dtype):
    x = _edge_rows(dtype)
    for gs in (1.0, 0.7, 1e37):
        ref = fp4.quantize_reference(x, gs)
        got = fp4.quantize(x.to(comm.device), gs)
        _assert_same(got[0], ref[0], f"packed gs={gs}")
        _assert_same(got[1], ref[1], f"scales gs={gs}")


@pytest.mark.parametrize("swizzled", (False, True))
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_matches_reference(comm, dtype, swizzled):
    gen = torch.Generator().manual_seed(5)
    for rows, h in ((0, 16), (1, 16), (129, 4096), (1000, 7168)):
        packed = torch.randint(0, 256, (rows, h // 2), generator=gen, dtype=torch.uint8)
        linear = torch.randint(0, 256, (rows, h // 16), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
        scales = fp4.swizzle_scales(linear) if swizzled else linear
        for gs in (0.37, torch.tensor([2688.0])):
            ref = fp4.dequantize_reference(packed, scales, gs, dtype, swizzled=swizzled)
            gs_dev = gs.to(comm.device) if isinstance(gs, torch.Tensor) else gs
            got = fp4.dequantize(packed.to(comm.device), scales.to(comm.device), gs_dev, dtype, swizzled=swizzled)
            _assert_same_values(got, ref, f"{dtype} {rows}x{h} swizzled={swizzled}")


def test_round_trip_through_the_kernels(comm):
    x = _cpu_input((512, 7168), torch.bfloat16, 3).to(comm.device)
    gs = fp4.global_scale_for(x)
    y = fp4.dequantize(*fp4.quantize(x, gs), gs, torch.float32)
    rel = ((y - x.float()).norm() / x.float().norm()).item()
    assert 0.02 < rel < 0.15, rel


@pytest.mark.parametrize("dtype", DTYPES)
def test_misaligned_views_take_the_scalar_path(comm, dtype):
    n, h = 37, 96
    x = _cpu_input((n, h), dtype, 8)
    ref = fp4.quantize_reference(x, 5.0)
    flat = torch.empty(n * h + 1, dtype=dtype, device=comm.device)
    xd = flat[1:].view(n, h).copy_(x)  # 2 or 4 bytes past a 16-byte boundary
    pbuf = torch.empty(n * h // 2 + 3, dtype=torch.uint8, device=comm.device)
    packed = pbuf[3:].view(n, h // 2)
    scales = torch.empty(n, h // 16, dtype=torch.float8_e4m3fn, device=comm.device)
    assert xd.data_ptr() % 16 and packed.data_ptr() % 8
    fp4.quantize(xd, 5.0, out=(packed, scales))
    _assert_same(packed, ref[0], "packed")
    _assert_same(scales, ref[1], "scales")
    obuf = torch.empty(n * h + 1, dtype=dtype, device=comm.device)
    out = obuf[1:].view(n, h)
    fp4.dequantize(packed, scales, 5.0, dtype, out=out)
    _assert_same(out, fp4.dequantize_reference(*ref, 5.0, dtype), "dequantized")


def test_graph_replay_reads_the_global_scale_on_the_device(comm):
    x = _cpu_input((300, 2048), torch.bfloat16, 4)
    xd = x.to(comm.device)
    gs = torch.tensor([10.0], device=comm.device)
    packed = torch.empty(300, 1024, dtype=torch.uint8, device=comm.device)
    scales = torch.empty(fp4.swizzled_shape(300, 128), dtype=torch.float8_e4m3fn, device=comm.device)
    fp4.quantize(xd, gs, swizzle=True, out=(packed, scales))  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp4.quantize(xd, gs, swizzle=True, out=(packed, scales))
    for value in (0.5, 300.0):
        gs.fill_(value)  # no re-capture: the kernel reads the scale when it runs
        packed.fill_(0xEE)
        graph.replay()
        ref = fp4.quantize_reference(x, value, swizzle=True)
        _assert_same(packed, ref[0], f"packed gs={value}")
        _assert_same(scales, ref[1], f"scales gs={value}")


# ------------------------------------------------------------------------ all_gatherv_fp4
SIZE_PATTERNS = {
    "uneven_with_zero": lambda w: [3, 0, 5, 1, 9, 0, 2, 4][:w],
    "all_zero_but_last": lambda w: [0] * (w - 1) + [17],
    "all_zero": lambda w: [0] * w,
    "equal": lambda w: [6] * w,
    "one_row_each": lambda w: [1] * w,
}
H = 256
TOPK = 8


def _rank_rows(rank, rows, dtype, seed, h=H):
    return rank_input((rows, h), dtype, rank, seed)


def _rank_extra(rank, rows, seed):
    ids = rank_input((rows, TOPK), torch.int32, rank, seed + 1)
    weights = rank_input((rows, TOPK), torch.float32, rank, seed + 2)
    return [ids, weights]


def _gathered_call(result, sizes, rank, extra_in, scales_linear):
    """The all_gatherv that all_gatherv_fp4 ran (in place: inputs are this rank's slices)."""
    first = sum(sizes[:rank])
    mine = slice(first, first + sizes[rank])
    return [result.packed[mine], scales_linear[mine], *extra_in], [result.packed, scales_linear, *result.extra]


# Uneven sizes use ordinary memory (the pool's same-offset rule, see test_collectives.py);
# equal sizes run both ways.
GATHER_CASES = [(p, False) for p in SIZE_PATTERNS] + [("equal", True), ("one_row_each", True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("pattern", "symmetric"), GATHER_CASES)
def test_all_gatherv_fp4_matches_reference(comm, pattern, symmetric, dtype):
    w, rank = comm.world_size, comm.rank
    sizes = SIZE_PATTERNS[pattern](w)
    seed = 40 + len(pattern)
    with symcomm.use_symmetric_memory(comm, disabled=not symmetric):
        x = _rank_rows(rank, sizes[rank], dtype, seed)
        extra = _rank_extra(rank, sizes[rank], seed)
        gs = fp4.global_scale_for(x, comm)
        got = comm.all_gatherv_fp4(x, sizes, gs, extra=extra, dequantize=True)
    ins, outs = _gathered_call(got, sizes, rank, extra, got.scales)
    choice = comm.select("all_gatherv", ins, out=outs, sizes=sizes)
    fp4_choice = comm.select("all_gatherv_fp4", x, sizes=sizes, global_scale=gs, extra=extra,
                             out=symcomm.Fp4Gathered(got.packed, got.scales, got.extra, None, None))
    fusable = symmetric and "custom-push" in comm.algorithms()  # the outputs were allocated in the pool
    if fusable and dtype in (torch.bfloat16, torch.float16):
        assert fp4_choice.algo == "fused-push", fp4_choice
    else:
        assert fp4_choice.algo == "unfused" and fp4_choice.gather.algo == choice.algo, fp4_choice
        if fusable:  # fp32 rows: the fused kernel quantizes 16-bit floats only, and says so
            assert "bfloat16 and float16" in fp4_choice.rejected["fused-push"], fp4_choice
    xs = [_rank_rows(r, sizes[r], dtype, seed).cpu() for r in range(w)]
    gs_cpu = gs.cpu()
    ref_packed, ref_scales = fp4.quantize_reference(torch.cat(xs), gs_cpu)
    _assert_same(got.packed, ref_packed, "packed")
    _assert_same(got.scales, ref_scales, "scales")
    for i in range(2):
        _assert_same(got.extra[i], torch.cat([_rank_extra(r, sizes[r], seed)[i] for r in range(w)]), f"extra[{i}]")
    assert got.values.dtype == dtype
    _assert_same(got.values, fp4.dequantize_reference(ref_packed, ref_scales, gs_cpu, dtype), "values")
    if sum(sizes):
        assert _bytes(got.packed).any(), "non-trivial payload"
    even = len(set(sizes)) == 1
    if symmetric and even and sum(sizes):
        # Small enough that every measured table prefers the symmetric kernels.
        assert got.packed.nbytes * 2 < 128 << 10
        assert comm.is_symmetric(got.packed) and comm.is_symmetric(got.scales)
        assert_symmetric_served(choice)
    elif not even:
        assert choice.algo == "nccl" and "uneven" in choice.rejected["nccl-symm"], choice


def test_all_gatherv_fp4_forced_symmetric_and_swizzled(comm):
    w, rank = comm.world_size, comm.rank
    sizes = [130] * w
    with symcomm.use_symmetric_memory(comm):
        x = _rank_rows(rank, 130, torch.bfloat16, 61)
        got = comm.all_gatherv_fp4(x, sizes, 300.0, algo="nccl-symm", swizzle=True)
    xs = [_rank_rows(r, 130, torch.bfloat16, 61).cpu() for r in range(w)]
    ref_packed, ref_scales = fp4.quantize_reference(torch.cat(xs), 300.0, swizzle=True)
    _assert_same(got.packed, ref_packed, "packed")
    _assert_same(got.scales, ref_scales, "swizzled scales")
    assert got.values is None and got.extra == ()


def test_all_gatherv_fp4_large_uneven(comm):
    """Model-sized rows (H = 7168) and thousands of tokens per rank, uneven. The reference here
    is the kernel on the concatenated input, which the tests above hold to the reference."""
    w, rank = comm.world_size, comm.rank
    h = 7168
    sizes = [1000 * (r + 1) + 7 * r for r in range(w)]
    x = _rank_rows(rank, sizes[rank], torch.bfloat16, 71, h)
    gs = fp4.global_scale_for(x, comm)
    got = comm.all_gatherv_fp4(x, sizes, gs, dequantize=True)
    whole = torch.cat([_rank_rows(r, sizes[r], torch.bfloat16, 71, h) for r in range(w)])
    ref_packed, ref_scales = fp4.quantize(whole, gs)
    _assert_same(got.packed, ref_packed, "packed")
    _assert_same(got.scales, ref_scales, "scales")
    _assert_same(got.values, fp4.dequantize(ref_packed, ref_scales, gs, torch.bfloat16), "values")


def test_all_gatherv_fp4_graph_replay_equals_eager(comm):
    w, rank = comm.world_size, comm.rank
    sizes, h = [64] * w, 1024
    with symcomm.use_symmetric_memory(comm):
        x = _rank_rows(rank, 64, torch.bfloat16, 81, h)
        ids = _rank_extra(rank, 64, 81)[0]
        out = symcomm.Fp4Gathered(torch.empty(64 * w, h // 2, dtype=torch.uint8, device=comm.device),
                                  torch.empty(64 * w, h // 16, dtype=torch.float8_e4m3fn, device=comm.device),
                                  (torch.empty(64 * w, TOPK, dtype=torch.int32, device=comm.device),),
                                  torch.empty(64 * w, h, dtype=torch.bfloat16, device=comm.device), None)
    gs = fp4.global_scale_for(x, comm)
    eager = comm.all_gatherv_fp4(x, sizes, gs, extra=[ids], dequantize=True, out=out)
    expect = [t.clone() for t in (eager.packed, eager.scales.view(torch.uint8), eager.extra[0], eager.values)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        comm.all_gatherv_fp4(x, sizes, gs, extra=[ids], dequantize=True, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        comm.all_gatherv_fp4(x, sizes, gs, extra=[ids], dequantize=True, out=out)
    for t in (out.packed, out.scales.view(torch.uint8), out.extra[0]):
        t.fill_(0x5A if t.dtype == torch.uint8 else -1)
    out.values.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    got = [out.packed, out.scales.view(torch.uint8), out.extra[0], out.values]
    for i, (g, e) in enumerate(zip(got, expect)):
        _assert_same(g, e, f"output {i}")


# ------------------------------------------------------------------------ the flag-free FP4 gather
# Rows of hidden 7168 whose wire chunk (4,032 bytes a row) just fits the default world-2 receive slot.
FLAGFREE_FULL_ROWS = peer_context.default_flagfree_bytes(2) // 4032
FLAGFREE_CASES = [("uneven_with_zero", 256), ("all_zero_but_last", 48), ("all_zero", 256), ("one_row_each", 272),
                  ("full_slot", 7168)]


def _flagfree_sizes(pattern: str, w: int) -> list[int]:
    return [FLAGFREE_FULL_ROWS - r for r in range(w)] if pattern == "full_slot" else SIZE_PATTERNS[pattern](w)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize(("pattern", "h"), FLAGFREE_CASES)
@pytest.mark.parametrize("symmetric", (False, True), ids=("plain", "pool"))
def test_all_gatherv_fp4_flagfree_matches_reference(comm, pattern, h, symmetric, dtype):
    """Without extras the flag-free kernel serves first at world 2, on plain and pool outputs
    alike (no peer touches them); elsewhere it declines and says why."""
    w, rank = comm.world_size, comm.rank
    sizes = _flagfree_sizes(pattern, w)
    seed = 90 + len(pattern) + h
    # x (this rank's rows) outside the pool, so the outputs take equal offsets on every rank.
    x = _rank_rows(rank, sizes[rank], dtype, seed, h)
    gs = fp4.global_scale_for(x, comm)
    with symcomm.use_symmetric_memory(comm, disabled=not symmetric):
        got = comm.all_gatherv_fp4(x, sizes, gs, dequantize=True)
    if symmetric and sum(sizes):
        assert comm.is_symmetric(got.packed) and comm.is_symmetric(got.scales)
    choice = comm.select("all_gatherv_fp4", x, sizes=sizes, global_scale=gs,
                         out=symcomm.Fp4Gathered(got.packed, got.scales, (), None, None))
    paths = comm.algorithms("all_gatherv_fp4")
    assert "fused-flagfree" in paths, paths
    if w == 2:
        assert choice.algo == "fused-flagfree", choice
    else:
        assert choice.algo != "fused-flagfree" and "world 2 only" in choice.rejected["fused-flagfree"], choice
    xs = [_rank_rows(r, sizes[r], dtype, seed, h).cpu() for r in range(w)]
    ref_packed, ref_scales = fp4.quantize_reference(torch.cat(xs), gs.cpu())
    _assert_same(got.packed, ref_packed, "packed")
    _assert_same(got.scales, ref_scales, "scales")
    _assert_same(got.values, fp4.dequantize_reference(ref_packed, ref_scales, gs.cpu(), dtype), "values")
    if sum(sizes):
        assert _bytes(got.packed).any() and _bytes(got.scales).any(), "non-trivial data"


def test_all_gatherv_fp4_flagfree_writes_misaligned_outputs(comm):
    """out= views at odd byte offsets: the kernel's receivers store bytes where the address
    allows no wider store."""
    w, rank = comm.world_size, comm.rank
    sizes, h = [3 + 2 * r for r in range(w)], 48  # 3 blocks a row: odd block counts
    total = sum(sizes)
    x = _rank_rows(rank, sizes[rank], torch.bfloat16, 7, h)
    raw = torch.full((total * (h // 2 + h // 16) + 16,), 0xA5, dtype=torch.uint8, device=comm.device)
    out = symcomm.Fp4Gathered(raw[1:1 + total * (h // 2)].view(total, h // 2),
                              raw[-total * (h // 16) - 3:-3].view(total, h // 16).view(torch.float8_e4m3fn), (),
                              None, None)
    got = comm.all_gatherv_fp4(x, sizes, 5.0, out=out)
    ref_packed, ref_scales = fp4.quantize_reference(
        torch.cat([_rank_rows(r, sizes[r], torch.bfloat16, 7, h).cpu() for r in range(w)]), 5.0)
    _assert_same(got.packed, ref_packed, "packed")
    _assert_same(got.scales, ref_scales, "scales")


def test_all_gatherv_fp4_flagfree_between_other_flagfree_calls(comm):
    """FP4 gathers between flag-free all-reduces and all-gathers of other sizes, no host wait
    between them: they share receive buffers, and each call clears what another left. Named
    paths where the flag-free kernels serve, so the claim does not rest on a dispatch table."""
    from symcomm.backends.custom_ar import FLAGFREE_COLLECTIVE_WORLDS
    w, rank = comm.world_size, comm.rank
    named = w in FLAGFREE_COLLECTIVE_WORLDS
    fp4_algo, flagfree = ("fused-flagfree", "custom-flagfree") if named else ("auto", "auto")
    results = []
    for i in range(24):
        h = (48, 7168, 256)[i % 3]
        sizes = [(i * 5 + 3 * r) % 9 for r in range(w)]
        x = _rank_rows(rank, sizes[rank], torch.bfloat16, 200 + i, h)
        got = comm.all_gatherv_fp4(x, sizes, 2.0, algo=fp4_algo)
        y = rank_input((1024 * (i % 4 + 1),), torch.bfloat16, rank, 300 + i)
        summed = comm.all_reduce(y.clone(), algo=flagfree)
        gathered = comm.all_gather(y, algo=flagfree)
        results.append((sizes, h, got, y, summed, gathered))
    for i, (sizes, h, got, y, summed, gathered) in enumerate(results):
        xs = [_rank_rows(r, sizes[r], torch.bfloat16, 200 + i, h).cpu() for r in range(w)]
        ref_packed, ref_scales = fp4.quantize_reference(torch.cat(xs), 2.0)
        _assert_same(got.packed, ref_packed, f"call {i} packed")
        _assert_same(got.scales, ref_scales, f"call {i} scales")
        ys = [rank_input(tuple(y.shape), torch.bfloat16, r, 300 + i).cpu() for r in range(w)]
        _assert_same(gathered, torch.cat(ys), f"call {i} all_gather")
        want = torch.stack([t.double() for t in ys]).sum(0)
        assert torch.allclose(summed.cpu().double(), want, rtol=1e-2, atol=1e-2), f"call {i} all_reduce"


def test_all_gatherv_fp4_flagfree_graph_replay_equals_eager(comm):
    w, rank = comm.world_size, comm.rank
    sizes, h = [40 + r for r in range(w)], 1024
    x = _rank_rows(rank, sizes[rank], torch.bfloat16, 83, h)
    gs = fp4.global_scale_for(x, comm)
    eager = comm.all_gatherv_fp4(x, sizes, gs)
    expect = [eager.packed.clone(), eager.scales.view(torch.uint8).clone()]
    out = symcomm.Fp4Gathered(torch.empty_like(eager.packed), torch.empty_like(eager.scales), (), None, None)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        comm.all_gatherv_fp4(x, sizes, gs, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with comm.graph_capture(), torch.cuda.graph(graph):
        comm.all_gatherv_fp4(x, sizes, gs, out=out)
    out.packed.fill_(0x5A)
    out.scales.view(torch.uint8).fill_(0x5A)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(out.packed, expect[0], "packed")
    _assert_same(out.scales.view(torch.uint8), expect[1], "scales")
