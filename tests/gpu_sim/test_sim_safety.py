"""Kernel safety on simulated ranks (tests/gpu_sim/_sim.py): what happens when ranks are late,
streams are mixed, graphs outlive their registration or their communicator.

These drive the production launch path (AllReduceKernelPath.run and .launch over the simulated
contexts), so stream ordering, capture slots and the alarm are the shipped code.
Timings here are bounds on waits, never performance.
"""
from __future__ import annotations

import time
import warnings

import pytest
import torch

from _sim import ALGOS, SimWorld, check_outputs, make_inputs
from symcomm.backends.custom_ar import ALGO_CODES, AllReduceKernelPath
from symcomm.base import FLAGFREE, ONESHOT, TWOSHOT, Call
from symcomm.errors import ArgumentError
from symcomm.peer.capture import CaptureSession
from symcomm.peer.context import ABORT_TIMEOUT, ABORT_UNREGISTERED
from symcomm.peer.setup import SharedContext

# At H100 clocks (about 1.7-2 GHz) this spin lasts about 1.5-1.8 s: longer than SHORT_TIMEOUT_S.
BEYOND_BOUND_CYCLES = 3_000_000_000
SHORT_TIMEOUT_S = 0.5


def kind_peer(code: int) -> tuple[int, int]:
    return code >> 32, code & 0xFFFF


def call_of(x: torch.Tensor, y: torch.Tensor) -> Call:
    return Call("all_reduce", (x,), (y,), (x.data_ptr(),), (y.data_ptr(),), None, "sum", x.nbytes)


def path_of(sim: SimWorld, rank: int, algo: str) -> AllReduceKernelPath:
    return AllReduceKernelPath(algo, SharedContext(sim.state(rank)))


@pytest.mark.parametrize("algo", ALGOS)
def test_stalled_rank_gives_up_and_the_context_lives(algo):
    """Rank W-1 never launches. The others give up at the bound (no trap), record that rank
    W-1 never came, and every later call returns at once with its output untouched. The CUDA
    context stays usable: a new world on the same device sums correctly."""
    world, timeout_s = 4, 1.0
    gen = torch.Generator().manual_seed(11)
    with SimWorld(world, timeout_s=timeout_s) as sim:
        x = make_inputs(world, 4096, torch.float32, gen)
        y = [torch.full_like(t, 7.0) for t in x]
        sim.launch(algo, torch.float32, x, y)
        torch.cuda.synchronize()
        check_outputs(y, x, "the call before the stall")
        start = time.monotonic()
        sim.launch(algo, torch.float32, x, y, ranks=range(world - 1))
        torch.cuda.synchronize()  # returns: the waiting ranks gave up instead of trapping
        waited = time.monotonic() - start
        assert timeout_s * 0.9 <= waited <= timeout_s + 10, waited
        for r in range(world - 1):
            assert kind_peer(sim.alarm(r)) == (ABORT_TIMEOUT, world - 1), (r, hex(sim.alarm(r)))
        assert sim.alarm(world - 1) == 0
        message = sim.state(0).describe_abort(sim.alarm(0))
        assert "rank 3" in message and "broken" in message, message
        # Later calls: no wait, no write.
        marker = [torch.full_like(t, 7.0) for t in x]
        start = time.monotonic()
        sim.launch(algo, torch.float32, x, marker, ranks=range(world - 1))
        torch.cuda.synchronize()
        assert time.monotonic() - start < timeout_s * 0.5
        for r in range(world - 1):
            assert torch.equal(marker[r], torch.full_like(x[r], 7.0)), f"rank {r} wrote after giving up"
    with SimWorld(world) as fresh:
        x = make_inputs(world, 4096, torch.bfloat16, gen)
        y = [torch.empty_like(t) for t in x]
        fresh.launch(algo, torch.bfloat16, x, y)
        torch.cuda.synchronize()
        check_outputs(y, x, "a new world after the stall")


@pytest.mark.parametrize("algo", ALGOS)
def test_rank_later_than_the_bound_ends_without_a_hang(algo):
    """Rank W-1 arrives after its peers gave up. Nobody hangs: the early ranks report rank W-1,
    and the late one either finishes its call (flag-free: the data was already there) or gives
    up in turn. The next call returns on every rank within the bound and leaves all broken."""
    world = 4
    gen = torch.Generator().manual_seed(12)
    with SimWorld(world, timeout_s=SHORT_TIMEOUT_S) as sim:
        x = make_inputs(world, 16 << 10, torch.float16, gen)
        y = [torch.empty_like(t) for t in x]
        start = time.monotonic()
        sim.launch(algo, torch.float16, x, y, late=world - 1, late_cycles=BEYOND_BOUND_CYCLES)
        torch.cuda.synchronize()
        assert time.monotonic() - start < 30
        for r in range(world - 1):
            assert kind_peer(sim.alarm(r)) == (ABORT_TIMEOUT, world - 1), (r, hex(sim.alarm(r)))
        late = sim.alarm(world - 1)
        assert late == 0 or kind_peer(late)[0] == ABORT_TIMEOUT, hex(late)
        start = time.monotonic()
        sim.launch(algo, torch.float16, x, y)
        torch.cuda.synchronize()
        assert time.monotonic() - start < SHORT_TIMEOUT_S + 5  # the bound, and launch overhead
        assert all(sim.alarm(r) for r in range(world)), [hex(sim.alarm(r)) for r in range(world)]


@pytest.mark.parametrize("algo", ALGOS)
def test_two_streams_keep_call_order(algo):
    """Rank 0 issues AR1 on stream s1 behind a long kernel and AR2 on s2; rank 1 issues both on
    one stream. Through the production launch path every sum is right. The control launches the
    same calls straight into the library, bypassing the ordering, and must pair them wrongly:
    proof that the test can see the failure it guards against."""
    world = 2
    gen = torch.Generator().manual_seed(13)

    def run(ordered: bool) -> tuple[list, list]:
        with SimWorld(world) as sim:
            paths = [path_of(sim, r, algo) for r in range(world)]
            x1 = make_inputs(world, 4096, torch.float32, gen)
            x2 = make_inputs(world, 4096, torch.float32, gen)
            y1 = [torch.full_like(t, 7.0) for t in x1]
            y2 = [torch.full_like(t, 7.0) for t in x2]
            here = torch.cuda.current_stream()
            s1, s2, t = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
            for s in (s1, s2, t):
                s.wait_stream(here)

            def launch(rank: int, x: torch.Tensor, y: torch.Tensor, stream: torch.cuda.Stream) -> None:
                with torch.cuda.stream(stream):
                    if ordered:
                        paths[rank].launch(call_of(x, y), 1, 0)
                    else:
                        code = sim.lib.symcomm_ar_run(sim.ctxs[rank], ALGO_CODES[algo], 0, x.data_ptr(), 0, 0,
                                                      y.data_ptr(), x.nbytes, 1, stream.cuda_stream)
                        assert code == 0

            with torch.cuda.stream(s1):
                torch.cuda._sleep(50_000_000)
            launch(0, x1[0], y1[0], s1)
            launch(0, x2[0], y2[0], s2)
            launch(1, x1[1], y1[1], t)
            launch(1, x2[1], y2[1], t)
            for s in (s1, s2, t):
                here.wait_stream(s)
            torch.cuda.synchronize()
            assert all(sim.alarm(r) == 0 for r in range(world))
            return [(y1, x1), (y2, x2)], paths

    for (y, x), what in zip(run(ordered=True)[0], ("AR1", "AR2")):
        check_outputs(y, x, f"{algo} {what}, rank 0 on two streams")
    wrong = run(ordered=False)[0]
    with pytest.raises(AssertionError, match="differ"):
        for (y, x), what in zip(wrong, ("AR1", "AR2")):
            check_outputs(y, x, f"{algo} {what}, unordered control")


def test_a_second_stream_inside_one_capture_is_refused():
    with SimWorld(2, graph_slots=4) as sim:
        path = path_of(sim, 0, ONESHOT)
        session = CaptureSession()
        x = torch.randn(1024, device="cuda")
        y = torch.empty_like(x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            path.launch(call_of(x, y), 1, 0, 0, session)
            # torch hands out pooled streams round-robin (32 a priority), so a new one can be the
            # capture stream itself when enough were made before (seen on an H100 after the EP tests)
            side = torch.cuda.Stream()
            while side.cuda_stream == torch.cuda.current_stream().cuda_stream:
                side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                with pytest.raises(ArgumentError, match="second stream"):
                    path.launch(call_of(x, y), 1, 0, 0, session)
            torch.cuda.current_stream().wait_stream(side)
        del g


def test_capture_destroy_recapture_does_not_exhaust_slots():
    """10,000 graphs captured and destroyed in turn, each taking a slot: CUDA reports each
    destroyed graph, its slot comes back, and no capture ever falls back to staging."""
    with SimWorld(2, graph_slots=64) as sim:
        path = path_of(sim, 0, ONESHOT)
        state = path.context
        x = torch.randn(4096, device="cuda")
        y = torch.empty_like(x)
        side = torch.cuda.Stream()
        most = 0
        for i in range(10_000):
            path.begin_capture()
            session = state.capture
            g = torch.cuda.CUDAGraph()
            # capture_begin/end rather than torch.cuda.graph(), whose entry synchronises and
            # collects garbage: 10,000 of those would take minutes.
            with torch.cuda.stream(side):
                g.capture_begin()
                path.run(call_of(x, y))
                g.capture_end()
            assert session.slots and not session.out_of_slots, f"capture {i} got no slot"
            path.discard_capture()
            del g
            most = max(most, len(state.graph_slots_of))
        torch.cuda.synchronize()
        deadline = time.monotonic() + 5
        while state.graphs_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state.graphs_alive() == 0, "destroyed graphs never reported"
        assert most < 32, f"up to {most} destroyed graphs held slots at once"
        assert state.next_slot - 1 - len(state.free_slots) == 0


def _capture(path: AllReduceKernelPath, x: torch.Tensor, y: torch.Tensor, stream: torch.cuda.Stream) -> tuple:
    """One rank's graph of one all-reduce, captured on the production path; returns it with the
    slot its input took (0: staged)."""
    path.begin_capture()
    session = path.context.capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(g, stream=stream):
        path.run(call_of(x, y))
    path.discard_capture()
    return g, session.slots.get(x.data_ptr(), 0)


def _replay(graphs: list, streams: list) -> None:
    here = torch.cuda.current_stream()
    for g, s in zip(graphs, streams):
        s.wait_stream(here)
        with torch.cuda.stream(s):
            g.replay()
    for s in streams:
        here.wait_stream(s)
    torch.cuda.synchronize()


@pytest.mark.parametrize("algo", (ONESHOT, TWOSHOT))
def test_replaying_an_unregistered_graph_is_refused(algo):
    """Registration never filled the slots (it failed): a replay finds null addresses, refuses
    them instead of dereferencing, and says so; the context stays usable."""
    world = 2
    with SimWorld(world, timeout_s=2.0, graph_slots=4) as sim:
        paths = [path_of(sim, r, algo) for r in range(world)]
        streams = [torch.cuda.Stream() for _ in range(world)]
        x = [torch.randn(4096, device="cuda") for _ in range(world)]
        y = [torch.full_like(t, 7.0) for t in x]
        graphs = [_capture(paths[r], x[r], y[r], streams[r]) for r in range(world)]
        assert all(slot for _, slot in graphs)
        _replay([g for g, _ in graphs], streams)
        for r in range(world):
            assert kind_peer(sim.alarm(r))[0] == ABORT_UNREGISTERED, hex(sim.alarm(r))
            assert torch.equal(y[r], torch.full_like(x[r], 7.0))
        assert torch.arange(10, device="cuda").sum().item() == 45


def test_eager_calls_interleaved_with_three_graphs():
    """Per rank, three graphs (flag-free, one-shot, two-shot; three sizes) and eager calls of
    each kernel, issued in one mixed order on every rank: each output bitwise equal to the
    rank-order sum, as eager calls alone would give."""
    world = 4
    gen = torch.Generator().manual_seed(14)
    kinds = ((FLAGFREE, 4096), (ONESHOT, 64 << 10), (TWOSHOT, 1 << 20))
    with SimWorld(world, graph_slots=8) as sim:
        streams = [torch.cuda.Stream() for _ in range(world)]
        graph_io, graphs = [], []
        for algo, nbytes in kinds:
            paths = [path_of(sim, r, algo) for r in range(world)]
            x = make_inputs(world, nbytes, torch.bfloat16, gen)
            y = [torch.empty_like(t) for t in x]
            per_rank = [_capture(paths[r], x[r], y[r], streams[r]) for r in range(world)]
            for r, (_, slot) in enumerate(per_rank):
                if slot:
                    sim.link_slot(slot, x, ranks=[r])
            graphs.append([g for g, _ in per_rank])
            graph_io.append((x, y))
        order = [("graph", 2), ("eager", TWOSHOT), ("graph", 0), ("eager", FLAGFREE), ("graph", 1),
                 ("graph", 0), ("eager", ONESHOT), ("graph", 2), ("eager", FLAGFREE), ("graph", 1)]
        for step, (how, which) in enumerate(order):
            if how == "graph":
                x, y = graph_io[which]
                for t in y:
                    t.fill_(7.0)
                _replay(graphs[which], streams)
                check_outputs(y, x, f"step {step}: replay of graph {which}")
            else:
                x = make_inputs(world, 8192, torch.bfloat16, gen)
                y = [torch.empty_like(t) for t in x]
                here = torch.cuda.current_stream()
                for r in range(world):
                    streams[r].wait_stream(here)
                    with torch.cuda.stream(streams[r]):
                        path_of(sim, r, which).launch(call_of(x[r], y[r]), 1, 0)
                for s in streams:
                    here.wait_stream(s)
                torch.cuda.synchronize()
                check_outputs(y, x, f"step {step}: eager {which}")
        assert all(sim.alarm(r) == 0 for r in range(world))


@pytest.mark.parametrize("algo", (ONESHOT, FLAGFREE))
def test_replay_after_close_returns_without_touching_memory(algo):
    """close() while graphs are alive keeps the buffers (a ResourceWarning says so) and marks
    the context closed, so a later replay returns at once instead of reading freed memory. The
    flag-free graph takes no slot: its capture session is tied to the graph all the same."""
    world = 2
    gen = torch.Generator().manual_seed(15)
    sim = SimWorld(world, graph_slots=4)
    try:
        paths = [path_of(sim, r, algo) for r in range(world)]
        streams = [torch.cuda.Stream() for _ in range(world)]
        x = make_inputs(world, 8192, torch.float32, gen)
        y = [torch.empty_like(t) for t in x]
        graphs = [_capture(paths[r], x[r], y[r], streams[r]) for r in range(world)]
        for r, (_, slot) in enumerate(graphs):
            if slot:
                sim.link_slot(slot, x, ranks=[r])
        _replay([g for g, _ in graphs], streams)
        check_outputs(y, x, "replay before close")
        for r in range(world):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                paths[r].context.destroy()
            assert any(issubclass(w.category, ResourceWarning) for w in caught), caught
            sim.ctxs[r] = None  # retired: SimWorld must not destroy it again
        for t in y:
            t.fill_(7.0)
        start = time.monotonic()
        _replay([g for g, _ in graphs], streams)
        assert time.monotonic() - start < 1.0
        for r in range(world):
            assert torch.equal(y[r], torch.full_like(x[r], 7.0)), f"rank {r}'s replay after close wrote"
    finally:
        sim.close()
