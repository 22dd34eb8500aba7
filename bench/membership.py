"""Host-side cost of the per-call symmetric-memory bookkeeping (CPU only, no GPU needed).

    python bench/membership.py [--json out.json]

- ``is_symmetric`` with 1,000 registered segments (target <= 0.5 us): the real
  Communicator.is_symmetric over a SegmentIndex holding 1,000 segments. A CPU communicator has
  no pool, so the index is installed by hand; the code timed is the code that runs per call.
- ``use_symmetric_memory(comm, disabled=True)`` entered and left (target <= 0.3 us).
Each figure is the best of 7 timeit repeats, minus an empty loop's cost.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import timeit

import torch
import torch.distributed as dist

import symcomm
from symcomm.pool import SegmentIndex


def per_call_us(stmt, number: int = 200_000) -> float:
    best = min(timeit.repeat(stmt, number=number, repeat=7))
    empty = min(timeit.repeat(lambda: None, number=number, repeat=7))
    return max(best - empty, 0.0) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(random.randint(20000, 40000)))
    dist.init_process_group("gloo", rank=0, world_size=1)
    comm = symcomm.Communicator(device="cpu")

    index = SegmentIndex()
    base, stride = 0x7F00_0000_0000, 4 << 20
    for i in range(1000):
        index.add(base + i * stride, 2 << 20)
    comm._find = index.find  # stand-in for a pool with 1,000 registered regions
    probe = base + 617 * stride + 4096
    lookup_us = per_call_us(lambda: index.find(probe))
    # A CPU tensor is never inside those fake segments, but the work per call is the same:
    # read data_ptr, shift, one dict lookup.
    t = torch.empty(512)
    is_symm_us = per_call_us(lambda: comm.is_symmetric(t))
    disabled_us = per_call_us(_enter_exit(comm))
    comm.close()
    dist.destroy_process_group()
    rows = {
        "segment lookup, 1000 segments (us)": lookup_us,
        "comm.is_symmetric(t), 1000 segments (us)": is_symm_us,
        "use_symmetric_memory(comm, disabled=True) enter+exit (us)": disabled_us,
    }
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}")
    for name, value in rows.items():
        print(f"{name:60s} {value:6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"python": platform.python_version(), "torch": torch.__version__, "rows": rows}, f, indent=1)


def _enter_exit(comm):
    use = symcomm.use_symmetric_memory

    def run():
        with use(comm, disabled=True):
            pass
    return run


if __name__ == "__main__":
    main()
