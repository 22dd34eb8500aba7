"""A/B of the push gathers (custom-push all_gatherv, fused-push all_gatherv_fp4) on ONE GPU with
simulated ranks (W = 2): builds of the native library in one process, graph replays alternated.
Not NVLink timing. Run: python3 diag/push_ab.py base=LIB new=LIB [rows ...]  (rows per rank, hidden 7168)."""
from __future__ import annotations

import ctypes
import os
import statistics
import sys
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root / "tests" / "gpu_sim"))
from _sim import SimWorld  # noqa: E402
from test_sim_fp4_dispatch import SimComm as Fp4Comm, _case as fp4_case, _map_outputs  # noqa: E402
from test_sim_peer_gather import _each_rank, _gather_call, _gatherv_case, _map_region  # noqa: E402

from symcomm import _native  # noqa: E402
from symcomm.backends.peer_gather import PushPath  # noqa: E402
from symcomm.peer.setup import SharedContext  # noqa: E402

WORLD, HIDDEN, ITERS, REPS = 2, 7168, 50, 15


def setup(lib, op, rows):
    sim = SimWorld(WORLD, graph_slots=16, max_blocks=int(os.environ.get("MAXB", "32")), lib=lib)
    gen = torch.Generator().manual_seed(rows)
    sizes = (rows, rows)
    if op == "push":
        xs, outs = _gatherv_case(WORLD, sizes, HIDDEN, torch.bfloat16, gen)
        for k in range(3):
            _map_region(sim, [outs[r][k] for r in range(WORLD)], k)
        paths = [PushPath(SharedContext(sim.state(r))) for r in range(WORLD)]
        calls = [_gather_call(xs[r], outs[r], sizes) for r in range(WORLD)]
        assert all(p.why_not(c) is None for p, c in zip(paths, calls))
        call = lambda r: paths[r].run(calls[r])  # noqa: E731
        result = lambda: [o[0] for o in outs]  # noqa: E731
    else:
        xs, extras, outs = fp4_case(WORLD, sizes, HIDDEN, torch.bfloat16, gen)
        _map_outputs(sim, outs)
        comms = [Fp4Comm(sim, r) for r in range(WORLD)]
        gs = torch.tensor([1.0], device="cuda")
        call = lambda r: comms[r].all_gatherv_fp4(xs[r], sizes, gs, extras[r], dequantize=False, out=outs[r])  # noqa: E731
        result = lambda: [o.packed for o in outs]  # noqa: E731
    streams = [torch.cuda.Stream() for _ in range(WORLD)]
    for _ in range(3):
        _each_rank(sim, streams, call)
    eager = [t.clone() for t in result()]
    graphs = []
    for r in range(WORLD):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(streams[r]), torch.cuda.graph(g, stream=streams[r]):
            for _ in range(ITERS):
                call(r)
        graphs.append(g)
    _each_rank(sim, streams, lambda r: graphs[r].replay())
    for r in range(WORLD):
        assert torch.equal(result()[r].view(torch.uint8), eager[r].view(torch.uint8)), f"{op} rank {r}"
    return sim, streams, graphs, (xs, outs, call, result)


def time_once(sim, streams, graphs, keep) -> float:
    here = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(here)
    _each_rank(sim, streams, lambda r: graphs[r].replay())
    end.record(here)
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / ITERS


def main() -> None:
    libs = {}
    args = sys.argv[1:]
    while args and "=" in args[0]:
        name, path = args.pop(0).split("=", 1)
        lib = ctypes.CDLL(path)
        _native.bind(lib, path)
        if os.environ.get("EARLY") == "0":
            lib.symcomm_set_early_dependents(0)
        libs[name] = lib
    first = next(iter(libs))
    for rows in [int(a) for a in args] or [2, 16, 128]:
        for op in ("push", "fp4"):
            worlds = {name: setup(lib, op, rows) for name, lib in libs.items()}
            got = {name: w[3][3]() for name, w in worlds.items()}
            for r in range(WORLD):  # every build gives the same bits
                assert all(torch.equal(got[n][r].view(torch.uint8), got[first][r].view(torch.uint8)) for n in got)
            samples = {name: [] for name in libs}
            for _ in range(REPS):
                for name in libs:
                    samples[name].append(time_once(*worlds[name]))
            for name, (sim, _, _, _) in worlds.items():
                assert all(sim.alarm(r) == 0 for r in range(WORLD)), name
                sim.close()
            med = {n: statistics.median(v) for n, v in samples.items()}
            cols = "  ".join(f"{n} {m:6.2f} us ({m / med[first]:.3f})" for n, m in med.items())
            raw = "; ".join(f"{n} " + " ".join(f"{x:.2f}" for x in v) for n, v in samples.items())
            print(f"rows {rows:4d} {op:5s} {cols}   raw: {raw}", flush=True)


if __name__ == "__main__":
    main()
