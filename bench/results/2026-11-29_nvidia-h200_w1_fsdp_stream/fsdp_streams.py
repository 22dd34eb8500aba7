"""World 1: where the FSDP step's kernels run (stream) and how much of the collectives' time
overlaps another stream's kernels. Eager step, and a captured one, at --tokens."""
import sys, os, argparse
from pathlib import Path
import torch, torch.distributed as dist
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples")); sys.path.insert(0, str(ROOT / "bench"))
import symcomm
import fsdp_train_step as fsdp
from layer_utils import init_distributed
from train_utils import train_step, warm_up

ap = argparse.ArgumentParser(); ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--hidden", type=int, default=4096); ap.add_argument("--ffn", type=int, default=14336)
a = ap.parse_args()
device = init_distributed(False)
comm = symcomm.Communicator(symmetric_capacity=1 << 30)
cfg = fsdp.TrainConfig(hidden=a.hidden, ffn=a.ffn, dtype=torch.bfloat16)
full = fsdp.FullMLP(cfg, device)
for overlap in (True, False):
    m = fsdp.FSDPMLP(comm, cfg, full, fsdp.communication_stream(comm) if overlap else None)
    x = torch.randn(a.tokens, a.hidden, device=device, dtype=torch.bfloat16)
    t = torch.randn(a.tokens, a.hidden, device=device, dtype=torch.bfloat16)
    warm_up([(m, (x, t))], cfg.lr)
    for mode in ("eager", "graph"):
        if mode == "graph":
            g = torch.cuda.CUDAGraph()
            with comm.graph_capture(), torch.cuda.graph(g):
                train_step(m, (x, t), cfg.lr, static_grads=True)
            run = g.replay
        else:
            run = lambda: train_step(m, (x, t), cfg.lr, static_grads=True)
        for _ in range(3): run()
        torch.cuda.synchronize()
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(10): run()
        en.record(); en.synchronize()
        us = st.elapsed_time(en) * 100
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(); torch.cuda.synchronize()
        import json, tempfile
        f = tempfile.mktemp(suffix=".json"); prof.export_chrome_trace(f)
        ev = [e for e in json.load(open(f))["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        streams = {}
        for e in ev:
            streams.setdefault(e["args"].get("stream"), []).append(e)
        print(f"overlap={overlap} {mode}: {us:.1f} us/step; kernels by stream:")
        iv = {}
        for s_, es in streams.items():
            busy = sum(e["dur"] for e in es)
            iv[s_] = [(e["ts"], e["ts"] + e["dur"]) for e in es]
            names = sorted({e["name"][:40] for e in es})[:6]
            print(f"  stream {s_}: {len(es)} kernels, {busy:.1f} us busy: {names}")
        ks = list(iv)
        for i in range(len(ks)):
            for j in range(i + 1, len(ks)):
                ov = sum(max(0, min(b1, b2) - max(a1, a2)) for a1, b1 in iv[ks[i]] for a2, b2 in iv[ks[j]])
                print(f"  streams {ks[i]} & {ks[j]}: {ov:.1f} us of overlapping kernel time")
    del m
comm.close(); dist.destroy_process_group()
