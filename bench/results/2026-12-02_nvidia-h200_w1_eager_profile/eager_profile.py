"""Where an eager 1 KiB all_reduce's host time goes, world 1 (torchrun --nproc-per-node=1).

Per-piece cost by interleaved batches (median per call over rounds), then cProfile of the
full call. Diagnostic only."""
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

import symcomm
from symcomm import _nccl, validate
from symcomm.operations import ALL_REDUCE

local = int(os.environ.get("LOCAL_RANK", 0))
torch.cuda.set_device(local)
dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local))
comm = symcomm.Communicator(symmetric_capacity=64 << 20)
print("symcomm from", symcomm.__file__)
numel = 512
with symcomm.use_symmetric_memory(comm):
    x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
dev = comm.device
path = comm.path("nccl")
lib = path.nccl.lib
plain = path.comm
raw_stream = torch._C._cuda_getCurrentRawStream
di = torch.cuda.current_device()
xp, yp = x.data_ptr(), y.data_ptr()
call = ALL_REDUCE.build(comm, x, y, "sum")
router = comm.router
print("auto picks:", comm.select("all_reduce", x, y).algo)

pieces = {
    "empty lambda": lambda: None,
    "raw ctypes": lambda: lib.ncclAllReduce(xp, yp, numel, _nccl.BFLOAT16, 0, plain, raw_stream(di)),
    "full algo=nccl": lambda: comm.all_reduce(x, out=y, algo="nccl"),
    "full auto": lambda: comm.all_reduce(x, out=y),
    "full algo=nccl, no out": lambda: comm.all_reduce(x, algo="nccl"),
    "comm._run nccl": lambda: comm._run(ALL_REDUCE, (x, y, "sum"), "nccl"),
    "build": lambda: ALL_REDUCE.build(comm, x, y, "sum"),
    "validate.tensor": lambda: validate.tensor("x", x, dev),
    "router.choose nccl": lambda: router.choose(ALL_REDUCE, call, "nccl"),
    "router.choose auto": lambda: router.choose(ALL_REDUCE, call, "auto"),
    "path.run": lambda: path.run(call),
    "raw_stream": lambda: raw_stream(di),
    "x.data_ptr": lambda: x.data_ptr(),
    "x.is_contiguous": lambda: x.is_contiguous(),
    "x.get_device": lambda: x.get_device(),
    "x.is_neg": lambda: x.is_neg(),
    "x.layout": lambda: x.layout,
    "x.dtype": lambda: x.dtype,
    "x.is_nested": lambda: x.is_nested,
    "x.requires_grad": lambda: x.requires_grad,
    "x.nbytes": lambda: x.nbytes,
    "x.numel": lambda: x.numel(),
    "x.shape": lambda: x.shape,
    "is_compiling": lambda: torch.compiler.is_compiling(),
    "grad_enabled": lambda: torch.is_grad_enabled(),
    "stream_capturing": lambda: torch.cuda.is_current_stream_capturing(),
    "inference_mode_enabled": lambda: torch.is_inference_mode_enabled(),
    "x.is_inference": lambda: x.is_inference(),
    "empty_like": lambda: torch.empty_like(x),
}
for fn in pieces.values():
    for _ in range(300):
        fn()
torch.cuda.synchronize()
batch, rounds = 200, 60
samples = {k: [] for k in pieces}
clock = time.perf_counter_ns
for _ in range(rounds):
    for name, fn in pieces.items():
        torch.cuda.synchronize()
        t0 = clock()
        for _ in range(batch):
            fn()
        samples[name].append((clock() - t0) / batch / 1e3)
    torch.cuda.synchronize()
base = statistics.median(samples["empty lambda"])
print(f"{'piece':32s} {'us/call':>8s} {'minus empty':>11s} {'p10':>6s} {'p90':>6s}")
for name, s in samples.items():
    s = sorted(s)
    m = statistics.median(s)
    print(f"{name:32s} {m:8.3f} {m - base:11.3f} {s[len(s)//10]:6.2f} {s[9*len(s)//10]:6.2f}")

for label, fn in (("algo=nccl", lambda: comm.all_reduce(x, out=y, algo="nccl")), ("auto", lambda: comm.all_reduce(x, out=y))):
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for i in range(20000):
        fn()
        if i % 1000 == 999:
            torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    print(f"==== cProfile {label}, 20000 calls ====")
    print(s.getvalue())
comm.close()
dist.destroy_process_group()
