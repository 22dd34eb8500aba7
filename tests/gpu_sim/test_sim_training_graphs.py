"""Many graphs, bounded memory (simulated ranks, tests/gpu_sim/_sim.py): a pipeline's 4 stages x
4 micro-batches captured as 16 graphs per rank, each a stage's forward all-reduce and its
backward all-reduce on the production launch path (AllReduceKernelPath over PeerContext), all
of a rank's graphs in one torch graph pool.

What must hold: each graph takes one device slot per captured input buffer and no more; the 16
graphs' memory is about one graph's, not 16 (the separate-pool blow-up seen in pipeline
training); replays in pipeline order sum bitwise in rank order; and once the graphs are
destroyed their slots come back (CUDA reports each graph gone) and a second round of 16
captures reuses them instead of growing.
"""
from __future__ import annotations

import time

import torch

from _sim import SimWorld, check_outputs
from symcomm.backends.custom_ar import AllReduceKernelPath
from symcomm.base import ONESHOT, Call
from symcomm.peer.setup import SharedContext

WORLD, STAGES, MICRO = 2, 4, 4
ROWS, COLS = 256, 256  # 256 KiB of fp32 per activation: small enough for one-shot, large enough to count


def _call(x: torch.Tensor, y: torch.Tensor) -> Call:
    return Call("all_reduce", (x,), (y,), (x.data_ptr(),), (y.data_ptr(),), None, "sum", x.nbytes)


def _stage(path: AllReduceKernelPath, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> None:
    """One stage on one micro-batch: the row-parallel partial, its all-reduce into y (forward),
    a gradient made from y, its all-reduce into g (backward). The partial and the gradient are
    made inside the capture, from the graph pool, and freed before it ends: each is a captured
    input with a slot, and the next graph in the pool reuses its memory."""
    partial = x * w
    path.run(_call(partial, y))
    grad = y * 0.5 + w
    path.run(_call(grad, g))


def _capture_round(sim: SimWorld, paths, streams, inputs, weights, static, pool_for):
    """Every rank captures its 16 graphs (stage-major, as a pipeline schedule issues them), then
    the slots are filled as register_captured would fill them after exchanging IPC handles:
    the i-th recorded buffer of every rank belongs together."""
    graphs = {r: [] for r in range(WORLD)}
    sessions = {r: [] for r in range(WORLD)}
    for s in range(STAGES):
        for m in range(MICRO):
            for r in range(WORLD):
                paths[r].begin_capture()
                session = paths[r].context.capture
                g = torch.cuda.CUDAGraph()
                with torch.cuda.stream(streams[r]), torch.cuda.graph(g, stream=streams[r], pool=pool_for(r)):
                    _stage(paths[r], inputs[r][m], weights[r][s], *static[r][m])
                paths[r].discard_capture()
                graphs[r].append(g)
                sessions[r].append(session)
    for i in range(STAGES * MICRO):
        by_order = [{idx: ptr for ptr, idx in sessions[r][i].order.items()} for r in range(WORLD)]
        for r in range(WORLD):
            for ptr, slot in sessions[r][i].slots.items():
                idx = sessions[r][i].order[ptr]
                sim.link_slot(slot, [by_order[q][idx] for q in range(WORLD)], ranks=[r])
    return graphs, sessions


def _replay(graphs, streams, i):
    here = torch.cuda.current_stream()
    for r in range(WORLD):
        streams[r].wait_stream(here)
        with torch.cuda.stream(streams[r]):
            graphs[r][i].replay()
    for r in range(WORLD):
        here.wait_stream(streams[r])


def _slots_used(path: AllReduceKernelPath) -> int:
    context = path.context
    return context.next_slot - 1 - len(context.free_slots)


def _released(paths) -> bool:
    """Wait (bounded) until CUDA reported every destroyed graph and their slots are free."""
    torch.cuda.synchronize()
    deadline = time.monotonic() + 5
    while any(p.context.graphs_alive() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not any(p.context.graphs_alive() or _slots_used(p) for p in paths)


def _reserved() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def test_sixteen_pipeline_graphs_share_one_pool_and_give_back_their_slots():
    n = STAGES * MICRO
    gen = torch.Generator(device="cuda").manual_seed(28)
    with SimWorld(WORLD, graph_slots=2 * n + 8) as sim:
        paths = [AllReduceKernelPath(ONESHOT, SharedContext(sim.state(r))) for r in range(WORLD)]
        streams = [torch.cuda.Stream() for _ in range(WORLD)]
        inputs = [[torch.randn(ROWS, COLS, device="cuda", generator=gen) for _ in range(MICRO)] for _ in range(WORLD)]
        weights = [[torch.randn(ROWS, COLS, device="cuda", generator=gen) for _ in range(STAGES)]
                   for _ in range(WORLD)]
        # static outputs per micro-batch (y, g), as a pipeline keeps its stage buffers
        static = [[(torch.empty(ROWS, COLS, device="cuda"), torch.empty(ROWS, COLS, device="cuda"))
                   for _ in range(MICRO)] for _ in range(WORLD)]
        for r in range(WORLD):  # warm the kernels up off any capture (lazy module loads)
            _ = inputs[r][0] * weights[r][0] * 0.5 + weights[r][0]
        growth = {}
        for round_, how in enumerate(("one pool", "one pool", "a pool per graph")):
            if how == "one pool":
                pools = [torch.cuda.graph_pool_handle() for _ in range(WORLD)]
                pool_for = pools.__getitem__
            else:
                def pool_for(r):
                    return torch.cuda.graph_pool_handle()
            before = _reserved()
            graphs, sessions = _capture_round(sim, paths, streams, inputs, weights, static, pool_for)
            growth[how] = _reserved() - before
            for r in range(WORLD):
                # one slot per captured input (the partial and the gradient), per graph, and no more
                assert [len(s.slots) for s in sessions[r]] == [2] * n, [len(s.slots) for s in sessions[r]]
                assert _slots_used(paths[r]) == 2 * n and not any(s.out_of_slots for s in sessions[r])
                assert paths[r].context.graphs_alive() == n
            # forward stage-major, backward in reverse: the order a pipeline schedule interleaves
            order = list(range(n))
            for i in order + order[::-1]:
                s, m = divmod(i, MICRO)
                for r in range(WORLD):
                    for t in static[r][m]:
                        t.fill_(7.0)
                _replay(graphs, streams, i)
                torch.cuda.synchronize()
                ys = [static[r][m][0] for r in range(WORLD)]
                check_outputs(ys, [inputs[r][m] * weights[r][s] for r in range(WORLD)], f"{how}: graph {i} forward")
                check_outputs([static[r][m][1] for r in range(WORLD)],
                              [ys[r] * 0.5 + weights[r][s] for r in range(WORLD)], f"{how}: graph {i} backward")
            assert all(sim.alarm(r) == 0 for r in range(WORLD))
            del graphs, sessions
            assert _released(paths), f"{how}: slots of destroyed graphs not given back"
            # every round takes the first round's slots again instead of new ones
            assert max(p.context.next_slot for p in paths) == 2 * n + 1, [p.context.next_slot for p in paths]
        print(f"reserved-memory growth for 16 graphs per rank x {WORLD} ranks: "
              + ", ".join(f"{k} {v >> 10} KiB" for k, v in growth.items()), flush=True)
        # one pool: about one graph's temporaries (a 2 MiB segment per rank); a pool each: 16 of them
        assert growth["one pool"] <= WORLD * (4 << 20), growth
        assert growth["a pool per graph"] >= 4 * growth["one pool"], growth
