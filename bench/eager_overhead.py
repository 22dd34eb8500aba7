"""Eager-mode cost per call of a 1 KiB bf16 all_reduce: raw ctypes NCCL, symcomm, torch.distributed.

    torchrun --nproc-per-node=4 bench/eager_overhead.py --json out.json

Two numbers per variant, both medians over ranks' samples:
- ``loop_us``: wall time of a batch of 64 back-to-back calls and one synchronize, per call.
  This is what a serving loop sees when it is host-bound.
- ``issue_us``: host time to return from one call (the Python + ctypes + NCCL enqueue cost),
  timed per call with perf_counter_ns.
Variants run interleaved, batch by batch, and the medians are taken over rounds and ranks.
symcomm's overhead is its number minus the raw ctypes call on the same NCCL communicator.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import symcomm
from symcomm import _nccl


def measure(variants: dict, rounds: int, batch: int) -> dict[str, tuple[float, float]]:
    """Interleaved: every round runs a batch of each variant in turn, so drift in clocks or
    peers' progress lands on all variants alike. Returns name -> (loop_us, issue_us) medians."""
    for fn in variants.values():
        for _ in range(200):
            fn()
    torch.cuda.synchronize()
    issue: dict[str, list[int]] = {name: [] for name in variants}
    loop: dict[str, list[float]] = {name: [] for name in variants}
    clock = time.perf_counter_ns
    for _ in range(rounds):
        for name, fn in variants.items():
            torch.cuda.synchronize()
            dist.barrier()
            start = clock()
            for _ in range(batch):
                t0 = clock()
                fn()
                issue[name].append(clock() - t0)
            torch.cuda.synchronize()
            loop[name].append((clock() - start) / batch)
    return {name: (statistics.median(loop[name]) / 1e3, statistics.median(issue[name]) / 1e3)
            for name in variants}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--nbytes", type=int, default=1024)
    parser.add_argument("--json")
    args = parser.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local))
    comm = symcomm.Communicator(symmetric_capacity=64 << 20)
    numel = args.nbytes // 2
    with symcomm.use_symmetric_memory(comm):
        x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(x)
    lib = comm.path("nccl").nccl.lib
    raw_stream = torch._C._cuda_getCurrentRawStream
    dev = torch.cuda.current_device()
    plain, symm = comm.path("nccl").comm, comm.path("nccl-symm").comm
    xp, yp = x.data_ptr(), y.data_ptr()

    def raw(handle):
        # What a user writing ctypes by hand would do: pointers, count, current stream.
        return lambda: lib.ncclAllReduce(xp, yp, numel, _nccl.BFLOAT16, 0, handle, raw_stream(dev))

    t = y.clone()
    variants = {
        "raw ctypes ncclAllReduce (plain comm)": raw(plain),
        "raw ctypes ncclAllReduce (symmetric comm)": raw(symm),
        "symcomm all_reduce algo=nccl": lambda: comm.all_reduce(x, out=y, algo="nccl"),
        "symcomm all_reduce algo=nccl-symm": lambda: comm.all_reduce(x, out=y, algo="nccl-symm"),
        "symcomm all_reduce auto": lambda: comm.all_reduce(x, out=y),
        "torch.distributed.all_reduce": lambda: dist.all_reduce(t),
    }
    mine = measure(variants, rounds=args.rounds, batch=64)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    rows = {name: {"loop_us": statistics.median(r[name][0] for r in everyone),
                   "issue_us": statistics.median(r[name][1] for r in everyone)} for name in variants}
    if dist.get_rank() == 0:
        print(f"# eager 1 KiB bf16 all_reduce, world {dist.get_world_size()}, "
              f"{torch.cuda.get_device_name()}, NCCL {comm.path('nccl').nccl.version_string}, torch {torch.__version__}")
        print(f"{'variant':45s} {'loop us/call':>13s} {'issue us':>9s}")
        for name, r in rows.items():
            print(f"{name:45s} {r['loop_us']:13.2f} {r['issue_us']:9.2f}")
        over_plain = rows["symcomm all_reduce algo=nccl"]["issue_us"] - rows["raw ctypes ncclAllReduce (plain comm)"]["issue_us"]
        over_symm = rows["symcomm all_reduce auto"]["issue_us"] - rows["raw ctypes ncclAllReduce (symmetric comm)"]["issue_us"]
        print(f"symcomm host overhead over raw ctypes: algo=nccl {over_plain:+.2f} us, auto {over_symm:+.2f} us")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": dist.get_world_size(), "nbytes": args.nbytes,
                           "device": torch.cuda.get_device_name(), "nccl": comm.path("nccl").nccl.version_string,
                           "torch": torch.__version__, "rows": rows,
                           "overhead_us": {"nccl": over_plain, "auto": over_symm}}, f, indent=1)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
