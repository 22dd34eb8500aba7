"""Session 28 probe (world 2): which kernels a graph of 20 all_gatherv_fp4 calls and one of 20 bf16
all_gatherv calls replay, their durations and start-to-start gaps (torch.profiler), at 8 KiB and
64 KiB of bf16 rows (512 values a row, rank r holding floor(R*(r+1)/3)).
torchrun --nproc-per-node=2 diag/w28/kprof.py"""
import collections, os, shutil, statistics
import torch, torch.distributed as dist, symcomm
from symcomm import fp4
from torch.profiler import profile, ProfilerActivity

dist.init_process_group("cpu:gloo,cuda:nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
comm = symcomm.Communicator()
W, R, H, N = comm.world_size, comm.rank, 512, 20
dev = comm.device
if R == 0:
    print("# tools:", {t: shutil.which(t) for t in ("ncu", "nsys", "cuobjdump", "nvdisasm")}, flush=True)
for nbytes in (8 << 10, 64 << 10):
    total = nbytes // 2 // H
    rows = [total // 3, total - total // 3]
    every = torch.randn(total, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(dev)
    x = every[sum(rows[:R]):sum(rows[:R + 1])].clone()
    gs = fp4.global_scale_for(every)
    with symcomm.use_symmetric_memory(comm):
        packed = torch.empty(total, H // 2, dtype=torch.uint8, device=dev)
        scales = torch.empty(total, H // 16, dtype=torch.float8_e4m3fn, device=dev)
        gathered = torch.empty(total, H, dtype=torch.bfloat16, device=dev)
    out = symcomm.Fp4Gathered(packed, scales, (), None, gs)
    calls = {"bf16": lambda: comm.all_gatherv(x, rows, out=gathered),
             "fp4": lambda: comm.all_gatherv_fp4(x, rows, gs, out=out),
             "fp4 float gs": lambda: comm.all_gatherv_fp4(x, rows, float(gs.item()), out=out)}
    for name, f in calls.items():
        f(); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with comm.graph_capture(), torch.cuda.graph(g):
            for _ in range(N):
                f()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize(); dist.barrier()
        ts = []
        for _ in range(15):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            g.replay(); a.record(); g.replay(); b.record(); b.synchronize()
            ts.append(a.elapsed_time(b) * 1000 / N)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
        kinds = collections.defaultdict(list)
        starts = []
        for e in prof.events():
            if e.device_type.name == "CUDA":
                kinds[e.name[:90]].append(e.time_range.elapsed_us())
                starts.append(e.time_range.start)
        starts.sort()
        gaps = [b - a for a, b in zip(starts, starts[1:]) if b - a < 50]
        dist.barrier()
        if R == 0:
            print(f"{nbytes:6d} {name:13s} replay {statistics.median(ts):.2f} us/call; start-to-start "
                  f"{statistics.median(gaps) if gaps else -1:.2f}", flush=True)
            for k, v in kinds.items():
                print(f"        {len(v):3d} x {statistics.median(v):6.2f} us  {k}", flush=True)
comm.close()
dist.destroy_process_group()
