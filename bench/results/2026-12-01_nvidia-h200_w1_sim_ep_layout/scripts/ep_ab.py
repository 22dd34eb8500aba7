"""Session 30: the MoE dispatch alone on ONE GPU with two simulated ranks, several builds of the
native library in one process, their graph replays alternated. Not NVLink timing (the peers are
the same HBM): it compares the kernels' own cost, to find what binds the row phase.
Run: python3 diag/w30/ep_ab.py name=LIB [name=LIB ...] [tokens ...]   (QUANTS="none nvfp4", MAXB=32)"""
from __future__ import annotations

import ctypes
import os
import statistics
import sys
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(root / "tests" / "gpu_sim"))
sys.path.insert(0, str(root / "tests"))
from _ep_reference import random_case  # noqa: E402
from _sim import SimWorld  # noqa: E402
from test_sim_ep import SimComm, _buffers  # noqa: E402
from test_sim_peer_gather import _each_rank  # noqa: E402

from symcomm import _native  # noqa: E402

WORLD, HIDDEN, K, EXPERTS = 2, 7168, 8, 256
ITERS, REPS = int(os.environ.get("ITERS", "20")), int(os.environ.get("REPS", "9"))


def setup(lib, tokens, quant):
    sim = SimWorld(WORLD, graph_slots=16, max_blocks=int(os.environ.get("MAXB", "32")), lib=lib)
    comms = [SimComm(sim, r) for r in range(WORLD)]
    bufs = _buffers(sim, tokens, HIDDEN, K, EXPERTS, 1, quant, False, torch.bfloat16)
    xs, ids, ws = random_case(WORLD, [tokens] * WORLD, HIDDEN, EXPERTS, K, seed=tokens)
    xd, idd, wd = [x.cuda() for x in xs], [t.cuda() for t in ids], [w.cuda() for w in ws]
    streams = [torch.cuda.Stream() for _ in range(WORLD)]
    gs = 1.0 if quant else None

    def body(r):
        comms[r].moe_dispatch(xd[r], idd[r], wd[r], EXPERTS, max_tokens=tokens, quant=quant, global_scale=gs,
                              out=bufs[r])

    for _ in range(3):
        _each_rank(sim, streams, body)
    graphs = []
    for r in range(WORLD):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(streams[r]), torch.cuda.graph(g, stream=streams[r]):
            for _ in range(ITERS):
                body(r)
        graphs.append(g)
    _each_rank(sim, streams, lambda r: graphs[r].replay())
    return sim, streams, graphs, (comms, bufs, xd, idd, wd, body)


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
        lib.symcomm_set_early_dependents(0)  # as at world 2 beside NCCL 2.28
        libs[name] = lib
    first = next(iter(libs))
    quants = [None if q == "none" else q for q in os.environ.get("QUANTS", "none nvfp4").split()]
    for tokens in [int(a) for a in args] or [64, 512, 2048]:
        for quant in quants:
            worlds = {}
            for name, lib in libs.items():
                try:
                    worlds[name] = setup(lib, tokens, quant)
                except Exception as exc:  # a variant that cannot run this case says so and is left out
                    print(f"setup FAILED: {name} tokens {tokens} {quant}: {exc}", flush=True)
            samples = {name: [] for name in worlds}
            for _ in range(REPS):
                for name in worlds:
                    samples[name].append(time_once(*worlds[name]))
            for name, (sim, _, _, _) in worlds.items():
                alarms = [sim.alarm(r) for r in range(WORLD)]
                if any(alarms):
                    print(f"ALARM {name}: {alarms}", flush=True)
                sim.close()
            med = {n: statistics.median(v) for n, v in samples.items()}
            base = med.get(first) or next(iter(med.values()))
            cols = "  ".join(f"{n} {m:7.2f} ({m / base:.3f})" for n, m in med.items())
            raw = "; ".join(f"{n} " + " ".join(f"{x:.2f}" for x in v) for n, v in samples.items())
            print(f"tokens {tokens:4d} {str(quant):6s} dispatch  {cols}   raw: {raw}", flush=True)


if __name__ == "__main__":
    main()
