"""Programmatic dependent launch (csrc/launch.cuh) on simulated ranks (one GPU).

Every peer kernel is launched so that it may be scheduled while the kernel before it on the
stream still runs, and must wait for that kernel before it touches its input or a peer. Here
the kernel before it (symcomm_debug_late_copy) lets its dependents be scheduled at once and
writes the all-reduce's input only 2 ms later, after the input was filled with a marker: a
kernel that read before waiting would sum the marker, and a rank that arrived at the barrier
before waiting would let its peers read it. Inputs are read in place through a graph slot (no
staging copy between the two kernels), eagerly and in CUDA-graph replay, with the overlap on
and off. ALGOS holds the flag-free kernel (entered through flagfree_begin) and one-shot and
two-shot (through next_epoch), so both entries are covered. Timings here are never performance.
"""
from __future__ import annotations

import pytest
import torch

from _sim import ALGOS, LATE_CYCLES, SimWorld, check_outputs, make_inputs
from symcomm import _native, rmsnorm
from symcomm.backends.custom_ar import ALGO_CODES

DELAY_NS = 2_000_000  # far longer than a launch, far inside the harness's 5 s bound
NBYTES = (64 << 10) + 48  # a multiple of 16 bytes that is not one of 32
SLOT = 1
TOKENS, HIDDEN = 7, 2048


def _late_copy(lib, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    _native.check(lib, "symcomm_debug_late_copy",
                  lib.symcomm_debug_late_copy(dst.data_ptr(), src.data_ptr(), src.nbytes, DELAY_NS, stream.cuda_stream))


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
        sim.link_slot(SLOT, xs)
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


def test_a_dependent_that_does_not_wait_reads_before_the_late_predecessor_writes():
    """The positive control of the tests above: launched the way the kernels are (launch.cuh),
    a dependent that skips griddepcontrol.wait runs while symcomm_debug_late_copy still holds
    its output back, and reads the marker. So the predecessor does let its dependents start at
    once, and a kernel above that read its input before waiting would have summed the marker."""
    lib = _native.load().lib
    src = torch.randn(NBYTES // 2, device="cuda").to(torch.bfloat16)
    x, seen = torch.empty_like(src), torch.empty_like(src)
    # Loaded first: under lazy module loading its first launch would wait for an idle device,
    # that is, for the late copy to end.
    _unwaiting_copy(lib, seen, src)
    torch.cuda.synchronize()
    x.fill_(1000.0)
    seen.fill_(-5.0)
    stream = torch.cuda.current_stream()
    _late_copy(lib, x, src, stream)
    _unwaiting_copy(lib, seen, x)
    torch.cuda.synchronize()
    assert torch.equal(x, src)
    assert torch.equal(seen, torch.full_like(seen, 1000.0)), "the dependent did not overtake the late copy"


def test_standalone_norm_waits_for_a_late_predecessor():
    """all_reduce_rmsnorm's norm kernel is always a programmatic dependent launch."""
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


def _unwaiting_copy(lib, dst: torch.Tensor, src: torch.Tensor) -> None:
    _native.check(lib, "symcomm_debug_unwaiting_copy",
                  lib.symcomm_debug_unwaiting_copy(dst.data_ptr(), src.data_ptr(), src.nbytes,
                                                   torch.cuda.current_stream().cuda_stream))


def _stale_behind_all_reduce(algo: str, early: bool, trials: int) -> int:
    """Trials in which a dependent that never waits, launched behind rank 0's all-reduce,
    copied rank 0's output before the all-reduce wrote it. Rank 1 starts a few milliseconds
    late, so rank 0's kernel sits in its barrier (or waits for rank 1's data) all that time."""
    world = 2
    gen = torch.Generator().manual_seed(17 + ALGOS.index(algo))
    previous = _native.load().lib.symcomm_set_early_dependents(int(early))
    try:
        with SimWorld(world) as sim:
            src = make_inputs(world, NBYTES, torch.bfloat16, gen)
            outs = [torch.empty_like(s) for s in src]
            seen = torch.empty_like(src[0])
            stale = 0
            here = torch.cuda.current_stream()
            # Load the copy kernel now: with lazy module loading its first launch blocks the
            # host until the device is idle, and rank 0's all-reduce, waiting for rank 1 whose
            # launch the host has not enqueued yet, is not idle until its timeout (_sim.py says
            # the same of torch's spin kernel).
            _unwaiting_copy(sim.lib, seen, outs[0])
            torch.cuda.synchronize()
            for trial in range(trials):
                for out in outs:
                    out.fill_(-3.0)
                seen.fill_(-5.0)
                for r in range(world):
                    stream = sim.streams[r]
                    stream.wait_stream(here)
                    with torch.cuda.stream(stream):
                        if r == 1:
                            torch.cuda._sleep(LATE_CYCLES // 10)
                        _native.check(sim.lib, "symcomm_ar_run", sim.lib.symcomm_ar_run(
                            sim.ctxs[r], ALGO_CODES[algo], _native.DTYPE_CODES[torch.bfloat16], src[r].data_ptr(), 0,
                            0, outs[r].data_ptr(), NBYTES, 1, stream.cuda_stream))
                        if r == 0:  # directly behind the all-reduce, as NCCL's next launch would be
                            _unwaiting_copy(sim.lib, seen, outs[0])
                for s in sim.streams:
                    here.wait_stream(s)
                torch.cuda.synchronize()
                # A rank that gave up wrote no output: say so rather than how the outputs differ.
                assert [sim.alarm(r) for r in range(world)] == [0] * world, f"trial {trial}: a rank gave up"
                check_outputs(outs, src, f"{algo} early={early}")
                stale += not torch.equal(seen.view(torch.int16), outs[0].view(torch.int16))
            return stale
    finally:
        _native.load().lib.symcomm_set_early_dependents(previous)


@pytest.mark.parametrize("algo", ALGOS)
def test_early_signals_off_protect_a_dependent_of_the_all_reduce(algo, capsys):
    """The hazard is real: with early signals on, a dependent that never waits reads rank 0's
    output while the all-reduce still waits for rank 1. With them off (what NcclPath sets beside
    NCCL 2.28 through 2.30.6) it never does."""
    trials = 5
    on = _stale_behind_all_reduce(algo, early=True, trials=trials)
    off = _stale_behind_all_reduce(algo, early=False, trials=trials)
    with capsys.disabled():
        print(f"\n{algo}: unwaiting dependent behind the all-reduce stale in {on}/{trials} trials with early "
              f"signals on, {off}/{trials} with them off")
    assert on == trials, "the dependent should have overtaken a kernel that signalled on entry"
    assert off == 0
