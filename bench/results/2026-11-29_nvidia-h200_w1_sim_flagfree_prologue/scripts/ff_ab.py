"""A/B of the flag-free collectives on ONE GPU with simulated ranks (W = 2): builds of the native
library in one process, graph replays alternated. Not NVLink timing: the kernels' own chain.
Run: python3 diag/ff_ab.py base=LIB new=LIB [bytes ...]  (bytes of one rank's input)."""
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
from test_sim_flagfree_collectives import GATHER, SCATTER, chunk_array  # noqa: E402
from test_sim_peer_gather import _each_rank  # noqa: E402

from symcomm import _native  # noqa: E402
from symcomm.backends.custom_ar import ALGO_CODES  # noqa: E402
from symcomm.base import FLAGFREE  # noqa: E402

WORLD, ITERS, REPS = 2, 50, 15
BF16 = _native.DTYPE_CODES[torch.bfloat16]


def setup(lib, op, nbytes):
    sim = SimWorld(WORLD, max_blocks=int(os.environ.get("MAXB", "32")), lib=lib)
    n = nbytes // 2
    torch.manual_seed(nbytes)
    if op == "all_gather":
        ins = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(WORLD)]
        outs = [torch.empty(n * WORLD, device="cuda", dtype=torch.bfloat16) for _ in range(WORLD)]
    elif op == "reduce_scatter":
        ins = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(WORLD)]
        outs = [torch.empty(n // WORLD, device="cuda", dtype=torch.bfloat16) for _ in range(WORLD)]
    else:
        ins = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(WORLD)]
        outs = [torch.empty_like(x) for x in ins]
    chunk = nbytes if op == "all_gather" else nbytes // WORLD
    sizes = chunk_array(WORLD, chunk)
    streams = [torch.cuda.Stream() for _ in range(WORLD)]

    def call(r):
        s = torch.cuda.current_stream().cuda_stream
        if op == "all_reduce":
            code = lib.symcomm_ar_run(sim.ctxs[r], ALGO_CODES[FLAGFREE], BF16, ins[r].data_ptr(), 0, 0,
                                      outs[r].data_ptr(), nbytes, 1, s)
        else:
            fn = GATHER if op == "all_gather" else SCATTER
            code = getattr(lib, fn)(sim.ctxs[r], BF16, ins[r].data_ptr(), outs[r].data_ptr(), sizes, s)
        _native.check(lib, op, code)

    for _ in range(3):
        _each_rank(sim, streams, call)
    torch.cuda.synchronize()
    eager = [o.clone() for o in outs]
    graphs = []
    for r in range(WORLD):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(streams[r]), torch.cuda.graph(g, stream=streams[r]):
            for _ in range(ITERS):
                call(r)
        graphs.append(g)
    _each_rank(sim, streams, lambda r: graphs[r].replay())
    torch.cuda.synchronize()
    for r in range(WORLD):
        assert torch.equal(outs[r].view(torch.int16), eager[r].view(torch.int16)), f"{op} rank {r}"
    return sim, streams, graphs, (ins, outs)


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
    for nbytes in [int(a) for a in args] or [1024, 16384, 262144]:
        for op in ("all_gather", "reduce_scatter", "all_reduce"):
            worlds = {name: setup(lib, op, nbytes) for name, lib in libs.items()}
            outs = {name: w[3][1] for name, w in worlds.items()}
            for r in range(WORLD):  # every build gives the same bits
                assert all(torch.equal(outs[n][r].view(torch.int16), outs[first][r].view(torch.int16)) for n in outs)
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
            print(f"{nbytes:8d} B {op:14s} {cols}   raw: {raw}", flush=True)


if __name__ == "__main__":
    main()
