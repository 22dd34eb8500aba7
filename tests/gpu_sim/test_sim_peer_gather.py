"""Uneven all_gatherv by push (custom-push) and uneven reduce_scatterv on the one-shot kernel,
with simulated ranks on one GPU (tests/gpu_sim/_sim.py), through the production paths.

Each rank's output (gatherv) or input (reduce_scatterv) stands in for a symmetric-pool region:
the test maps it the way map_regions would (a slot holding every rank's address, the granule
index pointing at it), so PushPath.run and AllReduceKernelPath.run build the real launches. Checked
bitwise: gathered rows against a concatenation, sums against the rank-order fp32 sum (and so
across ranks), graph replay against eager. Timings here are never performance.
"""
from __future__ import annotations

import time

import pytest
import torch

from _sim import SimWorld, check_outputs
from symcomm.backends.custom_ar import AllReduceKernelPath
from symcomm.backends.peer_gather import PushPath
from symcomm.base import ONESHOT, Call
from symcomm.peer.context import ABORT_TIMEOUT
from symcomm.peer.setup import SharedContext
from symcomm.pool import GRANULE_SHIFT

SPLITS = {2: [(0, 5), (1, 4096), (3, 0)], 4: [(0, 3, 1, 0), (7, 0, 2, 9), (1000, 17, 0, 3)],
          8: [(0, 1, 0, 2, 5, 0, 0, 1), (3, 3, 3, 3, 0, 3, 3, 1)]}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _region_tensor(shape: tuple[int, ...], dtype: torch.dtype, fill: float) -> torch.Tensor:
    """A tensor alone in its own granules, as a pool region is (regions are whole granules):
    the granule index maps every address of a granule to one region."""
    granule = 1 << GRANULE_SHIFT
    nbytes = max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + 2 * granule, dtype=torch.uint8, device="cuda")
    skip = -raw.data_ptr() % granule
    t = raw[skip:skip + nbytes].view(dtype)[:torch.Size(shape).numel()].view(shape)
    t.fill_(fill)
    return t


def _map_region(sim: SimWorld, tensors: list[torch.Tensor], number: int) -> None:
    """What map_regions does for a pool region, with each rank's tensor as the region."""
    slot = sim.state(0).next_slot  # every rank's wrapper hands out slots alike
    for r in range(sim.world):
        state = sim.state(r)
        assert state.next_free_slot() == slot
        sim.link_slot(slot, tensors, ranks=[r])
        base, end = tensors[r].data_ptr(), tensors[r].data_ptr() + tensors[r].nbytes
        state.granules = state.granules or {}
        for g in range(base >> GRANULE_SHIFT, ((end - 1) >> GRANULE_SHIFT) + 1):
            state.granules[g] = base
        state.region_slots[base] = slot
        state.region_numbers[base] = number


def _each_rank(sim: SimWorld, streams, launch) -> None:
    here = torch.cuda.current_stream()
    for r in range(sim.world):
        streams[r].wait_stream(here)
        with torch.cuda.stream(streams[r]):
            launch(r)
    for s in streams:
        here.wait_stream(s)
    torch.cuda.synchronize()


def _gatherv_case(world: int, sizes, hidden: int, dtype: torch.dtype, gen: torch.Generator):
    """Per rank: its rows of a payload plus top-k ids and weights (the extras of a dispatch)."""
    total = sum(sizes)
    xs = [[torch.randn(n, hidden, generator=gen).to(dtype).cuda(),
           torch.randint(0, 256, (n, 8), generator=gen, dtype=torch.int32).cuda(),
           torch.rand(n, 8, generator=gen).cuda()] for n in sizes]
    outs = [[_region_tensor((total, hidden), dtype, 7.0), _region_tensor((total, 8), torch.int32, -1),
             _region_tensor((total, 8), torch.float32, 7.0)] for _ in range(world)]
    return xs, outs


def _gather_call(x: list[torch.Tensor], out: list[torch.Tensor], sizes) -> Call:
    return Call("all_gatherv", x, out, [t.data_ptr() for t in x], [o.data_ptr() for o in out], list(sizes), None,
                sum(o.nbytes for o in out))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world", sorted(SPLITS))
def test_uneven_gatherv_by_push(world, dtype):
    gen = torch.Generator().manual_seed(world)
    # 7168 (the hidden) and 56 bf16/fp16 (112-byte rows: an odd multiple of 16 bytes)
    for hidden in (7168, 56 if dtype != torch.float32 else 28):
        for sizes in SPLITS[world]:
            with SimWorld(world, graph_slots=8) as sim:
                xs, outs = _gatherv_case(world, sizes, hidden, dtype, gen)
                for k in range(3):
                    _map_region(sim, [outs[r][k] for r in range(world)], k)
                paths = [PushPath(SharedContext(sim.state(r))) for r in range(world)]
                calls = [_gather_call(xs[r], outs[r], sizes) for r in range(world)]
                assert all(p.why_not(c) is None for p, c in zip(paths, calls)), paths[0].why_not(calls[0])
                streams = [torch.cuda.Stream() for _ in range(world)]
                _each_rank(sim, streams, lambda r: paths[r].run(calls[r]))
                for k in range(3):
                    want = torch.cat([xs[r][k] for r in range(world)])
                    for r in range(world):
                        assert torch.equal(outs[r][k].view(torch.uint8), want.view(torch.uint8)), \
                            f"world {world} {dtype} hidden {hidden} sizes {sizes}: rank {r} tensor {k}"
                eager = [[o.clone() for o in outs[r]] for r in range(world)]
                for r in range(world):
                    for o in outs[r]:
                        o.fill_(3)
                graphs = []
                for r in range(world):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.stream(streams[r]), torch.cuda.graph(g, stream=streams[r]):
                        paths[r].run(calls[r])
                    graphs.append(g)
                _each_rank(sim, streams, lambda r: graphs[r].replay())
                for r in range(world):
                    for k in range(3):
                        assert torch.equal(outs[r][k], eager[r][k]), f"replay differs: rank {r} tensor {k}"
                assert all(sim.alarm(r) == 0 for r in range(world))


def _rsv_call(x: torch.Tensor, out: torch.Tensor, sizes) -> Call:
    return Call("reduce_scatterv", (x,), (out,), (x.data_ptr(),), (out.data_ptr(),), list(sizes), "sum", x.nbytes)


@pytest.mark.parametrize("in_pool", (True, False), ids=("in-pool", "staged"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world", sorted(SPLITS))
def test_uneven_reduce_scatterv_on_one_shot(world, dtype, in_pool):
    gen = torch.Generator().manual_seed(100 + world)
    hidden = 7168 if in_pool else 56  # staged inputs must fit the 2 MiB staging buffer
    for sizes in SPLITS[world]:
        total = sum(sizes)
        with SimWorld(world, graph_slots=8) as sim:
            xs = [_region_tensor((total, hidden), dtype, 0.0).copy_((torch.randn(total, hidden, generator=gen) * 4)
                                                                     .to(dtype)) for _ in range(world)]
            outs = [torch.full((n, hidden), 7.0, dtype=dtype, device="cuda") for n in sizes]
            if in_pool:
                _map_region(sim, xs, 0)
            paths = [AllReduceKernelPath(ONESHOT, SharedContext(sim.state(r))) for r in range(world)]
            calls = [_rsv_call(xs[r], outs[r], sizes) for r in range(world)]
            reasons = [p.why_not(c) for p, c in zip(paths, calls)]
            assert reasons == [None] * world, reasons
            streams = [torch.cuda.Stream() for _ in range(world)]
            _each_rank(sim, streams, lambda r: paths[r].run(calls[r]))
            start = 0
            for r, n in enumerate(sizes):
                rows = [x[start:start + n].flatten() for x in xs]
                check_outputs([outs[r].flatten()], rows, f"world {world} {dtype} sizes {sizes} rank {r}")
                exact = torch.stack([t.double() for t in rows]).sum(0)
                assert torch.allclose(outs[r].flatten().double(), exact, rtol=2e-2, atol=1e-1)
                start += n
            eager = [o.clone() for o in outs]
            graphs = []
            for r in range(world):
                outs[r].fill_(3)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.stream(streams[r]), torch.cuda.graph(g, stream=streams[r]):
                    paths[r].run(calls[r])
                graphs.append(g)
            _each_rank(sim, streams, lambda r: graphs[r].replay())
            for r in range(world):
                assert torch.equal(outs[r], eager[r]), f"replay differs on rank {r}"
            assert all(sim.alarm(r) == 0 for r in range(world))


def test_a_stalled_rank_fails_the_gather_within_the_bound():
    world, timeout_s = 4, 1.0
    gen = torch.Generator().manual_seed(7)
    with SimWorld(world, timeout_s=timeout_s, graph_slots=8) as sim:
        sizes = (2, 0, 5, 1)
        xs, outs = _gatherv_case(world, sizes, 64, torch.bfloat16, gen)
        for k in range(3):
            _map_region(sim, [outs[r][k] for r in range(world)], k)
        paths = [PushPath(SharedContext(sim.state(r))) for r in range(world)]
        streams = [torch.cuda.Stream() for _ in range(world)]
        start = time.monotonic()
        _each_rank(sim, streams, lambda r: paths[r].run(_gather_call(xs[r], outs[r], sizes)) if r != 2 else None)
        assert timeout_s * 0.9 <= time.monotonic() - start < timeout_s + 10
        for r in (0, 1, 3):
            assert sim.alarm(r) >> 32 == ABORT_TIMEOUT and sim.alarm(r) & 0xFFFF == 2, hex(sim.alarm(r))
