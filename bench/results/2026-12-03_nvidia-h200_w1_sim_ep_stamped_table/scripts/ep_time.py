"""Session 38: MoE dispatch alone on ONE GPU with two simulated ranks (tests/gpu_sim's harness),
graph replay, for whichever tree is the working directory (its symcomm, its kernels). Not NVLink
timing: the peers share one HBM and one set of SMs. It ranks two or three trees' kernels run one
after the other in the same device call. QUANTS: comma-separated "none", "fp8", "nvfp4" or
"nvfp4s" (swizzled scales). Run from a tree's root: python3 PATH/ep_time38.py LABEL [tokens ...]
(ITERS=20 REPS=7 MAXB=32)"""
from __future__ import annotations

import itertools
import os
import statistics
import sys
from pathlib import Path

import torch

root = Path.cwd()
sys.path.insert(0, str(root / "tests" / "gpu_sim"))
sys.path.insert(0, str(root / "tests"))
sys.path.insert(0, str(root))
import symcomm  # noqa: E402
from _ep_reference import random_case  # noqa: E402
from _sim import SimWorld  # noqa: E402
from test_sim_ep import SimComm, _buffers  # noqa: E402
from test_sim_peer_gather import _each_rank  # noqa: E402

assert Path(symcomm.__file__).resolve().is_relative_to(root.resolve()), symcomm.__file__
WORLD, HIDDEN, K, EXPERTS = int(os.environ.get("WORLD", "2")), 7168, 8, 256
ITERS, REPS = int(os.environ.get("ITERS", "20")), int(os.environ.get("REPS", "7"))


def graphs_of(sim, streams, body):
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
    return graphs


def time_once(sim, streams, graphs) -> float:
    here = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(here)
    _each_rank(sim, streams, lambda r: graphs[r].replay())
    end.record(here)
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / ITERS


def main() -> None:
    label, args = sys.argv[1], sys.argv[2:]
    quants = os.environ.get("QUANTS", "none,nvfp4,nvfp4s,fp8").split(",")
    for tokens, name in itertools.product([int(a) for a in args] or [1, 64, 256, 512, 2048], quants):
        quant = None if name == "none" else name.rstrip("s")
        swizzle = name == "nvfp4s"
        sim = SimWorld(WORLD, graph_slots=16, max_blocks=int(os.environ.get("MAXB", "32")))
        comms = [SimComm(sim, r) for r in range(WORLD)]
        bufs = _buffers(sim, tokens, HIDDEN, K, EXPERTS, 1, quant, swizzle, torch.bfloat16)
        xs, ids, ws = random_case(WORLD, [tokens] * WORLD, HIDDEN, EXPERTS, K, seed=tokens)
        xd, idd, wd = [x.cuda() for x in xs], [t.cuda() for t in ids], [w.cuda() for w in ws]
        streams = [torch.cuda.Stream() for _ in range(WORLD)]
        gs = 1.0 if quant == "nvfp4" else None

        def dispatch(r):
            comms[r].moe_dispatch(xd[r], idd[r], wd[r], EXPERTS, max_tokens=tokens, quant=quant,
                                  global_scale=gs, swizzle=swizzle, out=bufs[r])

        g_dispatch = graphs_of(sim, streams, dispatch)
        d = [time_once(sim, streams, g_dispatch) for _ in range(REPS)]
        alarms = [sim.alarm(r) for r in range(WORLD)]
        meetings = [sim.meetings(r) for r in range(WORLD)]
        sim.close()
        print(f"{label} w{WORLD} tokens {tokens:4d} dispatch {name:6s}: {statistics.median(d):8.2f}  alarms {alarms} "
              f"meetings {meetings}  raw {' '.join(f'{x:.2f}' for x in d)}", flush=True)


if __name__ == "__main__":
    main()
