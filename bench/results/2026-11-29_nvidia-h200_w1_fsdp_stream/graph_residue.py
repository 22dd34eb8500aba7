"""World 1: what stays reserved after many_graphs' graphs are destroyed, with and without the
FSDP communication stream. Prints each segment still reserved, its stream and pool, and the
allocation stacks of its live blocks."""
import sys, gc
from pathlib import Path
import torch, torch.distributed as dist
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import symcomm
import fsdp_train_step as fsdp
import train_utils
from layer_utils import init_distributed

init_distributed(False)
comm = symcomm.Communicator()
import os
N = int(os.environ.get("N", "4"))
for overlap in (True, False):
    cfg = fsdp.TrainConfig(hidden=1024, ffn=4096)
    stages = [fsdp.FSDPMLP(comm, cfg, fsdp.FullMLP(fsdp.TrainConfig(hidden=1024, ffn=4096, seed=s), comm.device),
                           overlap=bool(overlap)) for s in range(N)]
    micro = [tuple(torch.randn(64, cfg.hidden, device=comm.device) for _ in range(2)) for _ in range(N)]
    train_utils.warm_up([(m, micro[0]) for m in stages], cfg.lr)
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    seg0 = {seg["address"] for seg in torch.cuda.memory._snapshot()["segments"]}
    torch.cuda.memory._record_memory_history(max_entries=100000)
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    for m in stages:
        for b in micro:
            g = torch.cuda.CUDAGraph()
            if overlap == "nograph-capture-ctx":
                with torch.cuda.graph(g, pool=pool):
                    train_utils.train_step(m, b, cfg.lr, static_grads=True)
            else:
                with comm.graph_capture(), torch.cuda.graph(g, pool=pool):
                    train_utils.train_step(m, b, cfg.lr, static_grads=True)
            graphs.append(g)
    for g in graphs: g.replay()
    torch.cuda.synchronize()
    del graphs, g
    for m in stages:
        for p in m.params: p.grad = None
    gc.collect(); torch.cuda.synchronize(); torch.cuda.empty_cache()
    left = torch.cuda.memory_reserved() - before
    print(f"overlap={overlap}: {left >> 20} MiB left", flush=True)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    for seg in snap["segments"]:
        live = [b for b in seg["blocks"] if b["state"] != "inactive"]
        if seg["address"] not in seg0:
            if seg["segment_pool_id"] == (0, 0) and all(b.get("frames") is None for b in live):
                pass
            print(f"  seg {seg['total_size'] >> 10} KiB pool {seg['segment_pool_id']} stream {seg['stream']} "
                  f"live {[(b['size'] >> 10, b['state']) for b in live][:6]}")
            for b in live[:3]:
                fr = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in (b.get("frames") or [])
                      if "python" not in f['filename'] or True][:14]
                print("     ", " <- ".join(x for x in fr if ".py" in x)[:900])
    del stages
    gc.collect(); torch.cuda.empty_cache()
comm.close(); dist.destroy_process_group()
