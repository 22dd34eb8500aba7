"""Run by test_custom_ar.test_missing_peer_raises_within_the_timeout as two plain processes.

Both ranks complete one custom all-reduce; then rank 1 stalls (sleeps past the timeout) or
dies, and rank 0 starts another. Rank 0 prints `RESULT raised|completed <seconds>`.
"""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import symcomm

mode = sys.argv[1]
rank = int(os.environ["RANK"])
try:
    torch.cuda.set_device(rank)
    torch.ones(1, device="cuda")  # create the CUDA context before the bounded NCCL init
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    comm = symcomm.Communicator(device="cuda", symmetric=False)  # a gloo group: CUDA must be asked for
    assert "custom-oneshot" in comm.algorithms(), comm.capabilities()
    x = torch.ones(4096, device="cuda")
    y = comm.all_reduce(x, algo="custom-oneshot")
    torch.cuda.synchronize()
    assert y[0].item() == 2.0, y[0].item()
    dist.barrier()
except BaseException as exc:  # noqa: BLE001 - report and leave without teardown (it could block)
    print(f"RESULT setup-failed 0 ({type(exc).__name__}: {exc})", flush=True)
    os._exit(3)
if rank == 1:
    if mode == "stall":
        time.sleep(30)
    os._exit(0)
start = time.monotonic()
try:
    comm.all_reduce(x, algo="custom-oneshot")
    torch.cuda.synchronize()
    print(f"RESULT completed {time.monotonic() - start:.2f}", flush=True)
except Exception as exc:  # noqa: BLE001 - any exception is the point; print what it was
    print(f"error: {type(exc).__name__}: {exc}", flush=True)
    print(f"RESULT raised {time.monotonic() - start:.2f}", flush=True)
os._exit(0)  # the CUDA context is gone after the trap: skip teardown
