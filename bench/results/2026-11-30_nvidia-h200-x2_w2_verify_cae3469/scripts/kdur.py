"""Session 27 probe: where does a 1 KiB flag-free all_gather spend the ~0.25 us it takes beyond the
all_reduce? Kernel durations (CUPTI, torch.profiler) and graph-replay time per call, AR / AG / RS,
flag-free forced, out of place. torchrun --nproc-per-node=2 diag/w27/kdur.py"""
import os, statistics, torch, torch.distributed as dist, symcomm
from torch.profiler import profile, ProfilerActivity

dist.init_process_group("cpu:gloo,cuda:nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
comm = symcomm.Communicator()
w, r = comm.world_size, comm.rank
N = 20
res = {}
for nbytes in (1024, 16384, 65536):
    elems = nbytes // 2
    with symcomm.use_symmetric_memory(comm):
        x_ar = torch.randn(elems, dtype=torch.bfloat16, device=comm.device); o_ar = torch.empty_like(x_ar)
        x_ag = torch.randn(elems // w, dtype=torch.bfloat16, device=comm.device); o_ag = torch.empty(elems, dtype=torch.bfloat16, device=comm.device)
        x_rs = torch.randn(elems, dtype=torch.bfloat16, device=comm.device); o_rs = torch.empty(elems // w, dtype=torch.bfloat16, device=comm.device)
    calls = {
        "all_reduce": lambda: comm.all_reduce(x_ar, out=o_ar, algo="custom-flagfree"),
        "all_gather": lambda: comm.all_gather(x_ag, out=o_ag, algo="custom-flagfree"),
        "reduce_scatter": lambda: comm.reduce_scatter(x_rs, out=o_rs, algo="custom-flagfree"),
    }
    graphs = {}
    for name, f in calls.items():
        f(); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with comm.graph_capture(), torch.cuda.graph(g):
            for _ in range(N):
                f()
        graphs[name] = g
    for name, g in graphs.items():
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize(); dist.barrier()
        times = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); g.replay(); b.record(); b.synchronize()
            times.append(a.elapsed_time(b) * 1000 / N)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
        durs, starts = [], []
        for e in prof.events():
            if e.device_type.name == "CUDA" and "flag_free" in e.name:
                durs.append(e.time_range.elapsed_us()); starts.append(e.time_range.start)
        starts.sort()
        gaps = [b - a for a, b in zip(starts, starts[1:]) if b - a < 50]
        res[(name, nbytes)] = (statistics.median(times), statistics.median(durs) if durs else -1,
                               statistics.median(gaps) if gaps else -1, len(durs))
        dist.barrier()
if r == 0:
    print(f"{'op':16} {'bytes':>6} {'replay us/call':>15} {'kernel dur us':>14} {'start-to-start us':>18} kernels")
    for (name, nbytes), (t, d, gap, n) in res.items():
        print(f"{name:16} {nbytes:6d} {t:15.2f} {d:14.2f} {gap:18.2f} {n}")
comm.close()
dist.destroy_process_group()
