import os, torch, torch.distributed as dist, symcomm

# GPUs when every local rank gets one, else the CPU: the same file runs on both.
gpu = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
dist.init_process_group("cpu:gloo,cuda:nccl" if gpu else "gloo")
if gpu:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
comm = symcomm.Communicator()                        # collective: every rank, same order
w = comm.world_size                                  # shapes follow the world size: any --nproc-per-node
with symcomm.use_symmetric_memory(comm):             # registered NCCL windows (a no-op on the CPU)
    x = torch.randn(64 * w, 1024, dtype=torch.bfloat16, device=comm.device)
    out = torch.empty_like(x)
comm.all_reduce(x, out=out)                          # zero-copy symmetric kernel where it wins
if comm.rank == 0:
    print(comm.select("all_reduce", x, out=out))     # which path, and why not the others
rows = comm.all_gatherv(x[: 3 + comm.rank], sizes=[3 + r for r in range(w)])
shard = comm.reduce_scatter(x)                       # x.shape[0] // w rows each
gs = symcomm.fp4.global_scale_for(x[:16], comm)      # one NVFP4 scale for every rank
fp4 = comm.all_gatherv_fp4(x[:16], [16] * w, gs, dequantize=True)
if gpu:                                              # CUDA-graph capturable
    g = torch.cuda.CUDAGraph()
    with comm.graph_capture(), torch.cuda.graph(g):
        comm.all_reduce(x, out=out)
    g.replay()
print(f"rank {comm.rank}: sum {out.float().sum():.4f}, rows {tuple(rows.shape)}, shard {tuple(shard.shape)}")
comm.close()
dist.destroy_process_group()                         # without it, gloo can abort at exit
