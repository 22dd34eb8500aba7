"""The fused FP4 dispatch (all_gatherv_fp4's fused-push, csrc/peer_gather.cu's gather_fp4_push) on
simulated ranks (tests/gpu_sim/_sim.py), through the production dispatch of all_gatherv_fp4
(its descriptor's build and result, and a Router holding its paths, as a Communicator runs it).

Each rank's gathered outputs stand in for symmetric-pool regions, mapped the way map_regions
would (test_sim_peer_gather's helpers: each tensor alone in its granules). Checked bitwise:
every rank's payload, scales and extras against quantizing each rank's rows with
symcomm.fp4.quantize and concatenating (what the unfused path's gather produces), the decoded
rows against fp4.dequantize of that, graph replay against eager. Timings here are never
performance.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from _sim import SimWorld
from symcomm import fp4
from symcomm.backends.composite import UnfusedFp4Path
from symcomm.backends.fp4_push import FusedPushFp4Path
from symcomm.dispatch import Router, builtin_table
from symcomm.operations import ALL_GATHERV, ALL_GATHERV_FP4
from symcomm.operations.all_gatherv_fp4 import FUSED, Fp4Gathered
from symcomm.peer.context import ABORT_TIMEOUT
from symcomm.peer.setup import SharedContext
from test_sim_peer_gather import _each_rank, _map_region, _region_tensor

# Zero-row ranks, one row, 4096 rows on one rank, odd counts.
SPLITS = {2: [(0, 5), (1, 4096), (3, 0)], 4: [(0, 3, 1, 0), (7, 0, 2, 9), (1000, 17, 0, 3)],
          8: [(0, 1, 0, 2, 5, 0, 0, 1), (3, 3, 3, 3, 0, 3, 3, 1)]}
HIDDEN = (7168, 48)  # the hidden, and 3 blocks of 16 per row: 24-byte payload, 3-byte scale rows
# Extras of a dispatch: top-k ids, top-k weights, and a 16-byte-per-row tag (int64 x 2).
EXTRAS = ((8, torch.int32), (8, torch.float32), (2, torch.int64))


@pytest.fixture(autouse=True)
def _kernels_loaded(_gpu):
    """Load every kernel a rank launches after its gather before any gather runs. With lazy
    module loading a first launch blocks the host until the device is idle, and a simulated
    rank spinning for its peers keeps it busy: rank 0's dequantize would wait out rank 0's own
    bound before rank 1 could even launch (seen on H100 at the first split of each test)."""
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(2, 32, device="cuda").to(dtype)
        packed, scales = fp4.quantize(x, 1.0)
        fp4.dequantize(packed, scales, 1.0, dtype)
        fp4.swizzle_scales(scales)
        x[:, 1:].clone()
    torch.cuda.synchronize()


class SimComm:
    """One simulated rank's all_gatherv_fp4 as a Communicator runs it (validate once -> choose ->
    run -> result), without check mode: its fused-push path holds the rank's linked context."""

    def __init__(self, sim: SimWorld, rank: int):
        self.rank, self.world_size = rank, sim.world
        self.device = torch.device("cuda", sim.device)
        self.router = Router(builtin_table(sim.world), {op.name: op for op in (ALL_GATHERV_FP4, ALL_GATHERV)}, rank)
        self.router.add(FusedPushFp4Path(SharedContext(sim.state(rank))), None)
        unfused = UnfusedFp4Path()
        unfused.open(SimpleNamespace(dispatcher=self.router))
        self.router.add(unfused, None)

    def select(self, *args, **kwargs):
        call = ALL_GATHERV_FP4.build(self, *args, **kwargs)
        return self.router.choose(ALL_GATHERV_FP4, call, "auto", explain=True)[1]

    def all_gatherv_fp4(self, *args, **kwargs) -> Fp4Gathered:
        call = ALL_GATHERV_FP4.build(self, *args, **kwargs)
        self.router.choose(ALL_GATHERV_FP4, call)[0].run(call)
        return ALL_GATHERV_FP4.result(call)


def _case(world: int, sizes, hidden: int, dtype: torch.dtype, gen: torch.Generator):
    total = sum(sizes)
    xs = [(torch.randn(n, hidden, generator=gen) * torch.logspace(-2, 2, max(n, 1))[:n, None]).to(dtype).cuda()
          for n in sizes]
    extras = [[(torch.randint(-1000, 1000, (n, cols), generator=gen) if dt != torch.float32
                else torch.rand(n, cols, generator=gen)).to(dt).cuda() for cols, dt in EXTRAS] for n in sizes]
    outs = []
    for _ in range(world):
        packed = _region_tensor((total, hidden // 2), torch.uint8, 0xA5)
        scales = _region_tensor((total, hidden // 16), torch.uint8, 0xA5).view(torch.float8_e4m3fn)
        extra = tuple(_region_tensor((total, cols), dt, -7) for cols, dt in EXTRAS)
        values = torch.full((total, hidden), 9.0, dtype=dtype, device="cuda")
        outs.append(Fp4Gathered(packed, scales, extra, values, None))
    return xs, extras, outs


def _map_outputs(sim: SimWorld, outs) -> None:
    tensors = lambda o: [o.packed, o.scales, *o.extra]  # noqa: E731
    for k in range(2 + len(EXTRAS)):
        _map_region(sim, [tensors(outs[r])[k] for r in range(sim.world)], k)


def _expected(xs, extras, gs):
    """The unfused path's result: each rank's rows quantized by fp4.quantize, concatenated."""
    quantized = [fp4.quantize(x, gs) for x in xs]
    packed = torch.cat([p for p, _ in quantized])
    scales = torch.cat([s.view(torch.uint8) for _, s in quantized])
    return packed, scales, [torch.cat([e[k] for e in extras]) for k in range(len(EXTRAS))]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("world", sorted(SPLITS))
def test_fused_dispatch_equals_quantize_then_gather(world, dtype):
    gen = torch.Generator().manual_seed(world)
    for hidden in HIDDEN:
        for i, sizes in enumerate(SPLITS[world]):
            with SimWorld(world, graph_slots=8) as sim:
                xs, extras, outs = _case(world, sizes, hidden, dtype, gen)
                _map_outputs(sim, outs)
                comms = [SimComm(sim, r) for r in range(world)]
                amax = max((x.abs().amax().float().item() for x in xs if x.numel()), default=0.0)
                gs_value = 448.0 * 6.0 / amax if amax else 1.0
                # A float on even cases, a device tensor (read by the kernel) on odd ones.
                gs = gs_value if i % 2 == 0 else torch.tensor([gs_value], device="cuda")
                what = f"world {world} {dtype} hidden {hidden} sizes {sizes}"
                for r in range(world):
                    choice = comms[r].select(xs[r], sizes, gs, extras[r], out=outs[r])
                    assert choice.algo == FUSED, (what, choice)
                results = [None] * world

                def launch(r, dequantize=True):
                    results[r] = comms[r].all_gatherv_fp4(xs[r], sizes, gs, extras[r], dequantize=dequantize,
                                                          out=outs[r])

                streams = [torch.cuda.Stream() for _ in range(world)]
                _each_rank(sim, streams, launch)
                packed, scales, extra = _expected(xs, extras, gs)
                values = fp4.dequantize(packed, scales.view(torch.float8_e4m3fn), gs, dtype)
                for r in range(world):
                    got = results[r]
                    assert got.packed is outs[r].packed, what
                    assert _same(got.packed, packed), f"{what}: payload on rank {r}"
                    assert _same(got.scales, scales), f"{what}: scales on rank {r}"
                    for k in range(len(EXTRAS)):
                        assert _same(got.extra[k], extra[k]), f"{what}: extra[{k}] on rank {r}"
                    assert _same(got.values, values), f"{what}: decoded rows on rank {r}"
                if sum(sizes):
                    assert packed.any() and scales.any(), "non-trivial data"
                # Graph replay writes the same bytes as eager.
                eager = [[t.clone() for t in (o.packed, o.scales, *o.extra)] for o in outs]
                for o in outs:
                    for t in (o.packed, o.scales.view(torch.uint8), *o.extra):
                        t.fill_(3)
                graphs = []
                for r in range(world):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.stream(streams[r]), torch.cuda.graph(g, stream=streams[r]):
                        launch(r, dequantize=False)
                    graphs.append(g)
                _each_rank(sim, streams, lambda r: graphs[r].replay())
                for r in range(world):
                    for k, t in enumerate((outs[r].packed, outs[r].scales, *outs[r].extra)):
                        assert _same(t, eager[r][k]), f"{what}: replay differs on rank {r}, tensor {k}"
                assert all(sim.alarm(r) == 0 for r in range(world))


def test_swizzled_scales_equal_the_swizzled_gather():
    world, sizes, hidden = 4, (130, 0, 5, 1), 48  # 136 rows: two 128-row tiles, shared by ranks
    gen = torch.Generator().manual_seed(3)
    with SimWorld(world, graph_slots=8) as sim:
        xs, extras, outs = _case(world, sizes, hidden, torch.bfloat16, gen)
        _map_outputs(sim, outs)
        comms = [SimComm(sim, r) for r in range(world)]
        results = [None] * world
        streams = [torch.cuda.Stream() for _ in range(world)]

        def launch(r):
            results[r] = comms[r].all_gatherv_fp4(xs[r], sizes, 40.0, extras[r], swizzle=True, out=outs[r])

        _each_rank(sim, streams, launch)
        _, scales, _ = _expected(xs, extras, 40.0)
        want = fp4.swizzle_scales(scales.view(torch.float8_e4m3fn))
        for r in range(world):
            assert _same(results[r].scales, want), f"rank {r}"


def test_a_stalled_rank_fails_the_fused_dispatch_within_the_bound():
    world, timeout_s, sizes = 4, 1.0, (2, 0, 5, 1)
    gen = torch.Generator().manual_seed(7)
    with SimWorld(world, timeout_s=timeout_s, graph_slots=8) as sim:
        xs, extras, outs = _case(world, sizes, 64, torch.bfloat16, gen)
        _map_outputs(sim, outs)
        comms = [SimComm(sim, r) for r in range(world)]
        streams = [torch.cuda.Stream() for _ in range(world)]
        start = time.monotonic()
        _each_rank(sim, streams, lambda r: comms[r].all_gatherv_fp4(xs[r], sizes, 1.0, extras[r],
                                                                    out=outs[r]) if r != 2 else None)
        assert timeout_s * 0.9 <= time.monotonic() - start < timeout_s + 10
        for r in (0, 1, 3):
            assert sim.alarm(r) >> 32 == ABORT_TIMEOUT and sim.alarm(r) & 0xFFFF == 2, hex(sim.alarm(r))
