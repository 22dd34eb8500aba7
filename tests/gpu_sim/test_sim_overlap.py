"""Programmatic dependent launch (csrc/launch.cuh) on simulated ranks (one GPU).

Every peer kernel is launched so that it may be scheduled while the kernel before it on the
stream still runs, and must wait for that kernel before it touches its input or a peer. Here
the kernel before it (symcomm_debug_late_copy) lets its dependents be scheduled at once and
writes the all-reduce's input only 2 ms later, after the input was filled with a marker: a
kernel that read before waiting would sum the marker, and a rank that arrived at the barrier
before waiting would let its peers read it. Inputs are read in place through a graph slot (no
staging copy between the two kernels), eagerly and in CUDA-graph replay, with the overlap on
and off. ALGOS holds the flag-free kernel (entered through flagfree_turn) and one-shot and
two-shot (through next_epoch), so both entries are covered. Timings here are never performance.
"""
from __future__ import annotations

import ctypes

import pytest
import torch

from _sim import ALGOS, SimWorld, check_outputs, make_inputs, reference
from symcomm import _native, rmsnorm
from symcomm.backends.custom_ar import ALGO_CODES

DELAY_NS = 2_000_000  # far longer than a launch, far inside the harness's 5 s bound
NBYTES = (64 << 10) + 48  # a multiple of 16 bytes that is not one of 32
SLOT = 1
TOKENS, HIDDEN = 7, 2048


def _late_copy(lib, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    _native.check(lib, "symcomm_debug_late_copy",
                  lib.symcomm_debug_late_copy(dst.data_ptr(), src.data_ptr(), src.nbytes, DELAY_NS, stream.cuda_stream))


def _link_slot(sim: SimWorld, xs: list[torch.Tensor]) -> None:
    """Slot SLOT of every rank reads every rank's x in place, as a captured input's slot does."""
    ptrs = (ctypes.c_uint64 * sim.world)(*[x.data_ptr() for x in xs])
    for r in range(sim.world):
        _native.check(sim.lib, "symcomm_ar_set_slot_ptrs", sim.lib.symcomm_ar_set_slot_ptrs(sim.ctxs[r], SLOT, ptrs))


def _run(sim: SimWorld, graph: bool, launch, reset) -> None:
    """launch(r) on every rank's stream, eagerly or captured per rank and replayed; reset()
    fills inputs and outputs with markers before the launches (or the replay) run."""
    here = torch.cuda.current_stream()
    graphs = []
    if graph:
        for r in range(sim.world):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(sim.streams[r]), torch.cuda.graph(g, stream=sim.streams[r]):
                launch(r)
            graphs.append(g)
    reset()
    for r in range(sim.world):
        sim.streams[r].wait_stream(here)
        with torch.cuda.stream(sim.streams[r]):
            graphs[r].replay() if graph else launch(r)
    for s in sim.streams:
        here.wait_stream(s)
    torch.cuda.synchronize()


@pytest.mark.parametrize("overlap", (True, False), ids=("overlap", "plain"))
@pytest.mark.parametrize("graph", (False, True), ids=("eager", "graph"))
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("world", (2, 4, 8))
def test_all_reduce_waits_for_a_late_predecessor(world, algo, graph, overlap):
    gen = torch.Generator().manual_seed(world * 7 + ALGOS.index(algo))
    with SimWorld(world, graph_slots=2) as sim:
        src = make_inputs(world, NBYTES, torch.bfloat16, gen)
        xs = [torch.empty_like(s) for s in src]
        outs = [torch.empty_like(s) for s in src]
        _link_slot(sim, xs)
        for r in range(world):
            sim.state(r).set_overlap(overlap)

        def launch(r: int) -> None:
            stream = torch.cuda.current_stream()
            _late_copy(sim.lib, xs[r], src[r], stream)
            code = sim.lib.symcomm_ar_run(sim.ctxs[r], ALGO_CODES[algo], _native.DTYPE_CODES[torch.bfloat16],
                                          xs[r].data_ptr(), SLOT, 0, outs[r].data_ptr(), NBYTES, 0,
                                          stream.cuda_stream)
            _native.check(sim.lib, "symcomm_ar_run", code)

        def reset() -> None:
            for r in range(world):
                xs[r].fill_(1000.0 + r)  # what a kernel that did not wait would sum
                outs[r].fill_(-3.0)

        _run(sim, graph, launch, reset)
        check_outputs(outs, src, f"{algo} W={world} graph={graph} overlap={overlap}")
        assert all(sim.alarm(r) == 0 for r in range(world))


@pytest.mark.parametrize("graph", (False, True), ids=("eager", "graph"))
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("world", (2, 4))
def test_fused_norm_waits_for_a_late_predecessor(world, algo, graph):
    gen = torch.Generator(device="cuda").manual_seed(world * 11 + ALGOS.index(algo))
    dtype = torch.bfloat16
    with SimWorld(world, graph_slots=2) as sim:
        src = [torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(dtype) for _ in range(world)]
        residual = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(dtype)
        weight = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=gen)).to(dtype)
        xs = [torch.empty_like(s) for s in src]
        ys = [torch.empty_like(s) for s in src]
        hs = [torch.empty_like(s) for s in src]
        _link_slot(sim, xs)
        lib = sim.lib

        def launch(r: int) -> None:
            stream = torch.cuda.current_stream()
            _late_copy(lib, xs[r], src[r], stream)
            args = _native.RmsnormArgs(residual=residual.data_ptr(), weight=weight.data_ptr(),
                                       dtype=_native.DTYPE_CODES[dtype], rows=TOKENS, cols=HIDDEN, eps=1e-6,
                                       residual_out=hs[r].data_ptr(), quant=_native.NORM_QUANT_CODES[None],
                                       out=ys[r].data_ptr())
            code = lib.symcomm_ar_rmsnorm(sim.ctxs[r], ALGO_CODES[algo], xs[r].data_ptr(), SLOT, 0, 0,
                                          ctypes.byref(args), stream.cuda_stream)
            _native.check(lib, "symcomm_ar_rmsnorm", code)

        def reset() -> None:
            for r in range(world):
                xs[r].fill_(500.0 + r)
                ys[r].fill_(-3.0)
                hs[r].fill_(-3.0)

        _run(sim, graph, launch, reset)
        want = rmsnorm.add_rmsnorm(reference(src), weight, residual=residual, eps=1e-6, impl="kernel")
        torch.cuda.synchronize()
        for r in range(world):
            for name, got, ref in (("y", ys[r], want.out), ("h", hs[r], want.residual)):
                differ = (got.view(torch.int16) != ref.view(torch.int16)).nonzero()
                assert differ.numel() == 0, f"{algo} W={world} graph={graph} rank {r}: {name} differs at {differ[:4]}"
        assert all(sim.alarm(r) == 0 for r in range(world))


def test_standalone_norm_waits_for_a_late_predecessor():
    """The unfused path's norm kernel is always a programmatic dependent launch."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    lib = _native.load().lib
    src = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=gen)).to(torch.bfloat16)
    want = rmsnorm.add_rmsnorm(src, weight, impl="kernel")
    a = torch.full_like(src, 7.0)
    torch.cuda.synchronize()
    _late_copy(lib, a, src, torch.cuda.current_stream())
    got = rmsnorm.add_rmsnorm(a, weight, impl="kernel")
    torch.cuda.synchronize()
    assert torch.equal(got.out.view(torch.int16), want.out.view(torch.int16))

