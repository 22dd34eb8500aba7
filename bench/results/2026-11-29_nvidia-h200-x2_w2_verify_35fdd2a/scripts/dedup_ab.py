"""World 2 (torchrun): MoE dispatch alone and dispatch+combine, dedup never vs always vs built-in,
in one process, graph replays alternated per round. hidden 7168, top-8 of 256, bf16 (+NVFP4 from 64
tokens). Checks that the three modes give the same received bytes and combined bits, and prints
whether the built-in threshold deduplicated (the context's meeting count).
Each size's buffers are freed before the next, in a 2 GiB pool."""
import ctypes
import gc, os, statistics, sys
import torch, torch.distributed as dist, symcomm
from symcomm.peer.context import PeerContext

dist.init_process_group("cpu:gloo,cuda:nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
comm = symcomm.Communicator(symmetric_capacity=2 << 30)
ctxs = [o for o in gc.get_objects() if isinstance(o, PeerContext)]
assert len(ctxs) == 1, len(ctxs)
ctx = ctxs[0]
W, H, K, E, ITERS, REPS = comm.world_size, 7168, 8, 256, 20, int(os.environ.get("REPS", "9"))
MODES = {"never": 1 << 40, "always": 0, "builtin": None}
dev = comm.device
tokens_list = [int(a) for a in sys.argv[1:]] or [1, 8, 32, 64, 128, 256, 512, 2048]


def meetings() -> int:
    torch.cuda.synchronize()
    n = ctypes.c_uint64()
    assert ctx.lib.symcomm_ar_debug_meetings(ctx.ctx, ctypes.byref(n)) == 0
    return n.value


for tokens in tokens_list:
    for quant in ((None, "nvfp4") if tokens >= 64 else (None,)):
        g = torch.Generator(device="cpu").manual_seed(1000 * tokens + comm.rank)
        x = torch.randn(tokens, H, generator=g).to(torch.bfloat16).to(dev)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).to(dev)
        w = torch.rand(tokens, K, generator=g).to(dev)
        gs = symcomm.fp4.global_scale_for(x, comm) if quant else None
        with symcomm.use_symmetric_memory(comm):
            bufs = comm.moe_dispatch(x[:0], ids[:0], w[:0], E, max_tokens=tokens, quant=quant, global_scale=gs)
        expert_out = torch.randn(bufs.x.shape[0], H, device=dev).to(torch.bfloat16)
        graphs, outs, recv, dedups = {}, {}, {}, {}
        for mode in ("d+c", "dispatch"):
            for name, v in MODES.items():
                ctx.set_ep_dedup_from(v)
                dist.barrier()
                res = {}

                def body():
                    d = comm.moe_dispatch(x, ids, w, E, max_tokens=tokens, quant=quant, global_scale=gs, out=bufs)
                    if mode == "d+c":
                        res["y"] = comm.moe_combine(expert_out, d.handle)
                    return d
                before = meetings()
                d = body(); torch.cuda.synchronize()
                if mode == "dispatch":
                    dedups[name] = meetings() - before
                used = int(d.expert_offsets[-1])
                recv[name] = (d.x[:used].clone(), d.handle.recv_src[:used].clone())
                if mode == "d+c":
                    outs[name] = res["y"].clone()
                gr = torch.cuda.CUDAGraph()
                with comm.graph_capture(), torch.cuda.graph(gr):
                    for _ in range(ITERS):
                        body()
                graphs[(mode, name)] = (gr, v)
            for name in MODES:
                assert torch.equal(recv[name][0].view(torch.uint8), recv["never"][0].view(torch.uint8)), name
                assert torch.equal(recv[name][1], recv["never"][1]), name
                if mode == "d+c":
                    assert torch.equal(outs[name].view(torch.int16), outs["never"].view(torch.int16)), name
        samples = {k: [] for k in graphs}
        for _ in range(REPS):
            for key, (gr, v) in graphs.items():
                ctx.set_ep_dedup_from(v)  # graphs keep what they captured; set anyway for clarity
                dist.barrier(); torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); gr.replay(); e.record(); torch.cuda.synchronize()
                samples[key].append(s.elapsed_time(e) * 1000 / ITERS)
        if comm.rank == 0:
            for mode in ("d+c", "dispatch"):
                med = {n: statistics.median(samples[(mode, n)]) for n in MODES}
                cols = "  ".join(f"{n} {m:8.2f} ({m / med['never']:.3f})" for n, m in med.items())
                raw = "; ".join(f"{n} " + " ".join(f"{v:.1f}" for v in samples[(mode, n)]) for n in MODES)
                print(f"tokens {tokens:5d} {str(quant):6s} {mode:8s} {cols}   builtin dedups: {dedups['builtin']}"
                      f"   raw: {raw}", flush=True)
        del graphs, bufs, d, recv, outs, expert_out, res
        gc.collect()
        torch.cuda.synchronize()
ctx.set_ep_dedup_from(None)
comm.close()
dist.destroy_process_group()
