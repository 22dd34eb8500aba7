"""Session 35 (from session 34's): MoE dispatch alone and dispatch + combine on ONE GPU with two simulated ranks
(tests/gpu_sim's harness), graph replay, for whichever tree is the working directory (its
symcomm, its tests' buffers). Not NVLink timing: the peers share one HBM. It compares two
trees' kernels run one after the other in the same device call.
QUANTS: comma-separated dispatch:combine quantizations, "none", "fp8" or "nvfp4" (default
none:none,none:fp8,fp8:none,nvfp4:none).
Run from a tree's root: python3 PATH/ep_time.py LABEL [tokens ...]   (ITERS=20 REPS=7)"""
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
WORLD, HIDDEN, K, EXPERTS = 2, 7168, 8, 256
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
    modes = ["builtin"]
    spec = os.environ.get("QUANTS", "none:none,none:fp8,fp8:none,nvfp4:none")
    quants = [tuple(None if q == "none" else q for q in pair.split(":")) for pair in spec.split(",")]
    for tokens, (quant, cq), mode in itertools.product([int(a) for a in args] or [1, 8, 64, 512, 2048], quants, modes):
        if True:
            sim = SimWorld(WORLD, graph_slots=16, max_blocks=int(os.environ.get("MAXB", "32")))
            comms = [SimComm(sim, r) for r in range(WORLD)]
            bufs = _buffers(sim, tokens, HIDDEN, K, EXPERTS, 1, quant, False, torch.bfloat16)
            xs, ids, ws = random_case(WORLD, [tokens] * WORLD, HIDDEN, EXPERTS, K, seed=tokens)
            xd, idd, wd = [x.cuda() for x in xs], [t.cuda() for t in ids], [w.cuda() for w in ws]
            cap = bufs[0].x.shape[0]
            outs = [torch.randn(cap, HIDDEN, device="cuda").to(torch.bfloat16) for _ in range(WORLD)]
            streams = [torch.cuda.Stream() for _ in range(WORLD)]
            gs = 1.0 if quant == "nvfp4" else None
            got = [None] * WORLD

            def dispatch(r):
                got[r] = comms[r].moe_dispatch(xd[r], idd[r], wd[r], EXPERTS, max_tokens=tokens, quant=quant,
                                               global_scale=gs, out=bufs[r])

            def pair(r):
                dispatch(r)
                comms[r].moe_combine(outs[r], got[r].handle, quant=cq)

            g_dispatch = graphs_of(sim, streams, dispatch)
            g_pair = graphs_of(sim, streams, pair)
            d, p = [], []
            for _ in range(REPS):
                d.append(time_once(sim, streams, g_dispatch))
                p.append(time_once(sim, streams, g_pair))
            alarms = [sim.alarm(r) for r in range(WORLD)]
            sim.close()
            md, mp = statistics.median(d), statistics.median(p)
            print(f"{label}/{mode} tokens {tokens:4d} dispatch {str(quant):5s} combine {str(cq):4s}: dispatch {md:8.2f} "
                  f"pair {mp:8.2f} combine {mp - md:8.2f}  alarms {alarms}  raw d {' '.join(f'{x:.2f}' for x in d)}"
                  f" | p {' '.join(f'{x:.2f}' for x in p)}", flush=True)


if __name__ == "__main__":
    main()
