"""Session 28 probe (world 2, torchrun): the flag-free NVFP4 gather's grid and lanes, against the
bf16 all_gatherv of the same rows, in one process, graphs alternated per round. Rows of 512 values,
rank r holding floor(R*(r+1)/3) as symcomm-bench's sweep does. Variants: bf16 auto, fp4 auto (the
built-in rule of this build), fp4 on FORCED grids, fused-push. Each fp4 variant's bytes are
checked against fp4.quantize of every rank's rows. Then one-GPU graphs of fp4.quantize against a
copy of the same rows (the encoding's own cost beside a kernel that only moves the bytes).
torchrun --nproc-per-node=2 diag/w28/fp4ab.py"""
import gc, os, statistics, sys
import torch, torch.distributed as dist, symcomm
from symcomm import fp4
from symcomm.peer.context import PeerContext

dist.init_process_group("cpu:gloo,cuda:nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
comm = symcomm.Communicator(symmetric_capacity=1 << 30)
ctx = [o for o in gc.get_objects() if isinstance(o, PeerContext)][0]
W, R = comm.world_size, comm.rank
if R == 0:
    print(f"# symcomm from {symcomm.__file__}", flush=True)
H, N, ROUNDS = 512, 20, int(os.environ.get("ROUNDS", "7"))
dev = comm.device
SIZES = [int(a) for a in sys.argv[1:]] or [8 << 10, 64 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20,
                                            8 << 20, 16 << 20, 32 << 20]
# blocks x threads, and "b" for block-major lanes
FORCED = [tuple(int(v) for v in b.rstrip("b").split("x")) + (int(b.endswith("b")),)
          for b in os.environ.get("FORCED", "32x512,32x512b,64x512,128x512,128x1024,64x1024").split(",") if b]


def grid(launch):
    assert ctx.lib.symcomm_fp4_debug_grid(ctx.ctx, *launch) == 0


def split(rows):
    out, done = [], 0
    for r in range(W):
        n = rows - done if r == W - 1 else rows * (r + 1) // 3 - done
        out.append(n); done += n
    return out


results = {}
for nbytes in SIZES:
    total = nbytes // 2 // H
    rows = split(total)
    g = torch.Generator().manual_seed(7)
    every = torch.randn(total, H, generator=g).to(torch.bfloat16).to(dev)
    first = sum(rows[:R])
    x = every[first:first + rows[R]].clone()
    gs = fp4.global_scale_for(every)
    ref_p, ref_s = fp4.quantize(every, gs)
    with symcomm.use_symmetric_memory(comm):
        packed = torch.empty(total, H // 2, dtype=torch.uint8, device=dev)
        scales = torch.empty(total, H // 16, dtype=torch.float8_e4m3fn, device=dev)
        gathered = torch.empty(total, H, dtype=torch.bfloat16, device=dev)
    out = symcomm.Fp4Gathered(packed, scales, (), None, gs)
    variants = {"bf16 auto": (None, lambda: comm.all_gatherv(x, rows, out=gathered))}
    variants["fp4 auto"] = ((0, 0, 0), lambda: comm.all_gatherv_fp4(x, rows, gs, out=out))
    for b in FORCED:
        variants[f"fp4 {b[0]}x{b[1]}{'b' * b[2]}"] = (b, lambda: comm.all_gatherv_fp4(x, rows, gs, out=out, algo="fused-flagfree"))
    if FORCED:
        variants["fp4 push"] = ((0, 0, 0), lambda: comm.all_gatherv_fp4(x, rows, gs, out=out, algo="fused-push"))
    graphs, wrong = {}, {}
    for name, (mode, f) in variants.items():
        if mode is not None:
            grid(mode)
        try:
            packed.fill_(0xAB); scales.view(torch.uint8).fill_(0xCD)
            f(); torch.cuda.synchronize()
        except symcomm.SymcommError as e:
            if R == 0:
                print(f"# {nbytes} {name}: not run ({str(e)[:120]})", flush=True)
            continue
        if name.startswith("fp4"):
            wrong[name] = int((packed != ref_p).sum()) + int((scales.view(torch.uint8) != ref_s.view(torch.uint8)).sum())
        gr = torch.cuda.CUDAGraph()
        with comm.graph_capture(), torch.cuda.graph(gr):
            for _ in range(N):
                f()
        graphs[name] = gr
    grid((0, 0, 0))
    times = {k: [] for k in graphs}
    for _ in range(ROUNDS):
        for name, gr in graphs.items():
            torch.cuda.synchronize(); dist.barrier()
            # The first replay absorbs the ranks' skew out of the barrier; the second, timed, starts
            # as it ends, and the flag-free calls keep the ranks in step from there.
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            gr.replay(); a.record(); gr.replay(); b.record(); b.synchronize()
            times[name].append(a.elapsed_time(b) * 1000 / N)
    med = {k: statistics.median(v) for k, v in times.items()}
    t = torch.tensor([med[k] for k in graphs], dtype=torch.float64)
    dist.all_reduce(t)
    results[nbytes] = ({k: float(v) / W for k, v in zip(graphs, t)}, wrong, rows,
                       {k: [round(s, 3) for s in v] for k, v in times.items()})
    del graphs
    torch.cuda.synchronize(); dist.barrier()

if R == 0:
    names = ["bf16 auto", "fp4 auto", *[f"fp4 {b[0]}x{b[1]}{'b' * b[2]}" for b in FORCED], *(["fp4 push"] if FORCED else [])]
    print("# us per call (median of rounds, mean of ranks); ratio = bf16 auto / fp4 auto")
    print(f"{'bytes':>9} " + " ".join(f"{n[4:] if n.startswith('fp4 ') else n:>10}" for n in names) + "    ratio  #wrong")
    for nbytes, (m, wrong, rows, raw) in results.items():
        cells = " ".join(f"{m[n]:10.2f}" if n in m else f"{'-':>10}" for n in names)
        ratio = m["bf16 auto"] / m["fp4 auto"] if "fp4 auto" in m else float("nan")
        print(f"{nbytes:9d} {cells} {ratio:8.2f}  {sum(wrong.values())}")
    print("# raw rank-0 samples")
    for nbytes, (m, wrong, rows, raw) in results.items():
        print(nbytes, rows, wrong, raw)

# The encoding's own cost: fp4.quantize against a copy of the same rows, one GPU.
if R == 0 and FORCED:
    print("# quantize vs copy (rank 0 alone), us per call")
    for nbytes in (8 << 10, 64 << 10, 512 << 10, 4 << 20):
        xs = torch.randn(nbytes // 2 // H, H, device=dev).to(torch.bfloat16)
        gs = fp4.global_scale_for(xs)
        p, s = fp4.quantize(xs, gs)
        y = torch.empty_like(xs)
        fs = {"quantize": lambda: fp4.quantize(xs, gs, out=(p, s)), "copy": lambda: y.copy_(xs)}
        res = {}
        for name, f in fs.items():
            f(); torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                for _ in range(N):
                    f()
            ts = []
            for _ in range(ROUNDS):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(); gr.replay(); b.record(); b.synchronize()
                ts.append(a.elapsed_time(b) * 1000 / N)
            res[name] = statistics.median(ts)
        print(f"{nbytes:9d} quantize {res['quantize']:.2f} copy {res['copy']:.2f}")
dist.barrier()
comm.close()
dist.destroy_process_group()
