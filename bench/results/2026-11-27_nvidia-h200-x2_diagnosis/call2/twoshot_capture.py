"""Capture all_reduce_rmsnorm per fused path inside graph_capture(); dump stacks if stuck."""
import faulthandler, os, sys, torch, torch.distributed as dist
import symcomm
faulthandler.dump_traceback_later(40, exit=True)
local = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(local)
dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local))
check = os.environ.get("CHECK") == "1"
comm = symcomm.Communicator(timeout_s=25, check=check)
rank = comm.rank
hidden = 7168
for tokens in (1, 64):
    for algo in ("unfused", "fused-flagfree", "fused-oneshot", "fused-twoshot"):
        with symcomm.use_symmetric_memory(comm):
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        try:
            eager = comm.all_reduce_rmsnorm(x, w, residual=r, algo=algo)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            print(f"rank {rank} {algo} tokens {tokens}: capturing", flush=True)
            with comm.graph_capture():
                with torch.cuda.graph(g):
                    got = comm.all_reduce_rmsnorm(x, w, residual=r, algo=algo)
                print(f"rank {rank} {algo}: capture ended, registering", flush=True)
            g.replay(); torch.cuda.synchronize()
            same = torch.equal(got.out.view(torch.int16), eager.out.view(torch.int16))
            print(f"rank {rank} {algo} tokens {tokens}: replay ok, bitwise={same}", flush=True)
            del g
        except Exception as e:
            print(f"rank {rank} {algo} tokens {tokens}: {type(e).__name__}: {e}", flush=True)
            break
comm.close()
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
