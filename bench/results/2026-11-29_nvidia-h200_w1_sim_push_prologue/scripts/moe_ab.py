"""A/B of the peer-push MoE kernels on ONE GPU with simulated ranks (W = 2): two builds of the
native library in one process, their graph replays alternated, so clocks and contention are
shared. Not NVLink timing (peers are the same HBM): what it compares is the kernels' own cost.
Run: python3 diag/moe_ab.py base=LIB new=LIB [more=LIB ...] [tokens ...]
EARLY=0 turns the early dependent signal off in every library, as symcomm does at world 2 wherever
NCCL 2.28-2.30.6 is loaded (the simulated world loads no NCCL, so it is on otherwise). MAXB sets the
simulated grid cap (32)."""
from __future__ import annotations

import ctypes
import os
import statistics
import sys
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root / "tests" / "gpu_sim"))
sys.path.insert(0, str(root / "tests"))
from _ep_reference import random_case  # noqa: E402
from _sim import SimWorld  # noqa: E402
from test_sim_ep import SimComm, _buffers  # noqa: E402
from test_sim_peer_gather import _each_rank  # noqa: E402

from symcomm import _native  # noqa: E402

WORLD, HIDDEN, K, EXPERTS, ITERS, REPS = 2, 7168, 8, 256, 50, 15


def setup(lib, tokens, quant, mode, dedup=None):
    sim = SimWorld(WORLD, graph_slots=16, max_blocks=int(os.environ.get("MAXB", "32")), lib=lib)
    for r in range(WORLD):
        if dedup is not None:
            sim.state(r).set_ep_dedup_from(dedup)
    comms = [SimComm(sim, r) for r in range(WORLD)]
    bufs = _buffers(sim, tokens, HIDDEN, K, EXPERTS, 1, quant, False, torch.bfloat16)
    xs, ids, ws = random_case(WORLD, [tokens] * WORLD, HIDDEN, EXPERTS, K, seed=tokens)
    xd, idd, wd = [x.cuda() for x in xs], [t.cuda() for t in ids], [w.cuda() for w in ws]
    expert_out = [torch.randn(bufs[r].x.shape[0], HIDDEN, device="cuda").to(torch.bfloat16) for r in range(WORLD)]
    streams = [torch.cuda.Stream() for _ in range(WORLD)]
    outs = [None] * WORLD
    gs = 1.0 if quant else None

    def body(r):
        got = comms[r].moe_dispatch(xd[r], idd[r], wd[r], EXPERTS, max_tokens=tokens, quant=quant,
                                    global_scale=gs, out=bufs[r])
        if mode == "d+c":
            outs[r] = comms[r].moe_combine(expert_out[r], got.handle)

    for _ in range(3):
        _each_rank(sim, streams, body)
    eager = [o.clone() if o is not None else None for o in outs]
    graphs = []
    for r in range(WORLD):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(streams[r]), torch.cuda.graph(g, stream=streams[r]):
            for _ in range(ITERS):
                body(r)
        graphs.append(g)
    _each_rank(sim, streams, lambda r: graphs[r].replay())
    if mode == "d+c":  # replay gives the eager bits
        for r in range(WORLD):
            assert torch.equal(outs[r].view(torch.int16), eager[r].view(torch.int16)), f"rank {r} replay != eager"
    # Everything the graphs read or write must outlive them: freed, its memory goes to the next setup.
    keep = (comms, bufs, xd, idd, wd, expert_out, outs, body)
    return sim, streams, graphs, keep


def time_once(sim, streams, graphs, keep) -> float:
    here = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(here)
    _each_rank(sim, streams, lambda r: graphs[r].replay())
    end.record(here)
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / ITERS


def main() -> None:
    """argv: name=lib ... [tokens ...]; the first name is the baseline of the ratios."""
    libs, dedups = {}, {}
    args = sys.argv[1:]
    while args and "=" in args[0]:
        name, path = args.pop(0).split("=", 1)
        path, _, dd = path.partition("@")
        dedups[name] = None if not dd else int(dd)
        lib = ctypes.CDLL(path)
        _native.bind(lib, path)
        if os.environ.get("EARLY") == "0":
            lib.symcomm_set_early_dependents(0)
        libs[name] = lib
    first = next(iter(libs))
    tokens_list = [int(a) for a in args] or [1, 8, 64]
    for tokens in tokens_list:
        for quant in (None, "nvfp4") if tokens in (1, 512) else (None,):
            for mode in ("d+c", "dispatch"):
                worlds = {name: setup(lib, tokens, quant, mode, dedups[name]) for name, lib in libs.items()}
                samples = {name: [] for name in libs}
                for _ in range(REPS):
                    for name in libs:
                        try:
                            samples[name].append(time_once(*worlds[name]))
                        except Exception:
                            print(f"FAILED: {name} tokens {tokens} {quant} {mode}", flush=True)
                            raise
                for name, (sim, _, _, _) in worlds.items():
                    assert all(sim.alarm(r) == 0 for r in range(WORLD)), name
                    sim.close()
                med = {n: statistics.median(v) for n, v in samples.items()}
                cols = "  ".join(f"{n} {m:6.2f} us ({m / med[first]:.3f})" for n, m in med.items())
                raw = "; ".join(f"{n} " + " ".join(f"{x:.2f}" for x in v) for n, v in samples.items())
                print(f"tokens {tokens:3d} {str(quant):6s} {mode:8s} {cols}   raw: {raw}", flush=True)


if __name__ == "__main__":
    main()
