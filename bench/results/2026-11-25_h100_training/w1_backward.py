import sys, torch, torch.distributed as dist
sys.path.insert(0, "scripts")
import symcomm, world1_check as w
torch.cuda.set_device(0)
dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", 0))
comm = symcomm.Communicator(symmetric_capacity=64 << 20)
print("paths:", comm.algorithms(), flush=True)
w.backward(comm)
comm.close()
dist.destroy_process_group()
print(f"w1_backward: {len(w.CHECKS)} checks passed", flush=True)
