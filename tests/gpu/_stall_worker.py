"""Run by test_custom_ar.test_missing_peer_raises_within_the_timeout as two plain processes.

Both ranks complete one custom all-reduce; then rank 1 stalls (sleeps past the timeout) or
dies, and rank 0 starts another. The kernel gives up at the bound without trapping, so the
next call raises CommTimeoutError naming rank 1, and the CUDA context still works: rank 0 then
allocates and computes on the GPU. Rank 0 prints `RESULT raised|completed <seconds>`, then
`CONTEXT ok|broken`.
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
    torch.cuda.synchronize()  # returns once the kernel gave up
    comm.all_reduce(x, algo="custom-oneshot")  # the call after the failure raises
    print(f"RESULT completed {time.monotonic() - start:.2f}", flush=True)
except symcomm.CommTimeoutError as exc:
    named = "rank 1" in str(exc)
    print(f"error: {type(exc).__name__}: {exc}", flush=True)
    print(f"RESULT {'raised' if named else 'unnamed'} {time.monotonic() - start:.2f}", flush=True)
except Exception as exc:  # noqa: BLE001 - the wrong kind of failure; print what it was
    print(f"error: {type(exc).__name__}: {exc}", flush=True)
    print(f"RESULT wrong-error {time.monotonic() - start:.2f}", flush=True)
try:
    z = torch.arange(1000, device="cuda", dtype=torch.float32)
    print(f"CONTEXT {'ok' if z.sum().item() == 499500.0 else 'broken'}", flush=True)
except Exception as exc:  # noqa: BLE001
    print(f"CONTEXT broken ({type(exc).__name__}: {exc})", flush=True)
os._exit(0)  # skip teardown: the peer is gone, a collective close would wait for it
