"""Which NCCL schedule gathers uneven rows fastest? An experiment, not a path.

    torchrun --nproc-per-node=4 bench/gatherv_variants.py [--json out.json]

symcomm's uneven all_gatherv was one ncclBroadcast per root in a group; it is now a group of
sends and receives, chosen by this experiment. Times, on the same rows, every variant in the
same run, CUDA-graph replay:
- broadcast: one ncclBroadcast per root, in one group (raw ctypes; the former path);
- send/recv: each rank ncclSends its rows to every peer and ncclRecvs theirs, in one group
  (raw ctypes), and symcomm's all_gatherv, which does the same;
- padded all_gather: every rank contributes max(sizes) rows (plain and symmetric windows),
  then local copies compact the padded result into the output. Also timed without the
  compaction, as the floor of that schedule.
Each variant's output is compared bit for bit with the broadcast path's.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import symcomm
from symcomm import _nccl
from symcomm.bench.runner import Timer

SHARES = [1.0, 0.55, 1.45, 0.8, 1.2, 0.65, 1.35, 1.0]  # as bench/fp4_gather.py's uneven split
ROW_BYTES = 3584  # one NVFP4 payload row of H = 7168


def rows_for(total_bytes: int, world: int) -> list[int]:
    shares = [SHARES[r % len(SHARES)] for r in range(world)]
    rows = total_bytes // ROW_BYTES
    return [max(1, round(rows * s / sum(shares))) for s in shares]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1M,4M,16M,64M")
    parser.add_argument("--json")
    parser.add_argument("--no-padded", action="store_true", help="skip the padded variants (memory)")
    args = parser.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = symcomm.Communicator(symmetric_capacity=1 << 30)
    lib, u8 = comm.path("nccl").nccl.lib, _nccl.UINT8
    plain, symm = comm.path("nccl").comm, comm.path("nccl-symm").comm
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    timer = Timer(torch.device("cuda", local), iters=20, warmup=3, graph_replays=10)
    table = []
    for text in args.sizes.split(","):
        total = int(float(text[:-1]) * (1 << 20)) if text.endswith("M") else int(text)
        sizes = rows_for(total, world)
        biggest, offsets = max(sizes), [sum(sizes[:r]) for r in range(world)]
        gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
        x = torch.randint(0, 256, (sizes[rank], ROW_BYTES), dtype=torch.uint8, device="cuda", generator=gen)
        ref = comm.all_gatherv(x, sizes, algo="nccl")
        out = torch.empty_like(ref)
        with symcomm.use_symmetric_memory(comm, disabled=args.no_padded):
            pad_in = torch.zeros(0 if args.no_padded else biggest, ROW_BYTES, dtype=torch.uint8, device="cuda")
            pad_out = torch.empty(0 if args.no_padded else world * biggest, ROW_BYTES, dtype=torch.uint8,
                                  device="cuda")
        if not args.no_padded:
            pad_in[:sizes[rank]].copy_(x)

        def broadcast():
            s = stream()
            comm.path("nccl").nccl.group_start()
            for root in range(world):
                dst = out[offsets[root]].data_ptr()
                lib.ncclBroadcast(x.data_ptr() if root == rank else dst, dst, sizes[root] * ROW_BYTES, u8,
                                  root, plain, s)
            comm.path("nccl").nccl.group_end()

        def symcomm_gatherv():
            comm.all_gatherv(x, sizes, out=out, algo="nccl")

        def send_recv():
            s = stream()
            out[offsets[rank]:offsets[rank] + sizes[rank]].copy_(x)
            comm.path("nccl").nccl.group_start()
            for peer in range(world):
                if peer != rank:
                    lib.ncclSend(x.data_ptr(), x.nbytes, u8, peer, plain, s)
                    lib.ncclRecv(out[offsets[peer]].data_ptr(), sizes[peer] * ROW_BYTES, u8, peer, plain, s)
            comm.path("nccl").nccl.group_end()

        def padded(handle, compact=True):
            def run():
                lib.ncclAllGather(pad_in.data_ptr(), pad_out.data_ptr(), pad_in.nbytes, u8, handle, stream())
                if compact:
                    for r in range(world):
                        out[offsets[r]:offsets[r] + sizes[r]].copy_(pad_out[r * biggest:r * biggest + sizes[r]])
            return run

        variants = {"broadcast group": broadcast, "send/recv group": send_recv,
                    "symcomm all_gatherv (send/recv)": symcomm_gatherv}
        if not args.no_padded:
            variants.update({"padded all_gather, plain": padded(plain), "padded all_gather, symmetric": padded(symm),
                             "padded all_gather, symmetric, no compaction": padded(symm, compact=False)})
        for name, fn in variants.items():
            out.fill_(0)
            us = timer.measure(fn)
            fn()
            torch.cuda.synchronize()
            same = True if "no compaction" in name else bool(torch.equal(out, ref))
            times = [None] * world
            dist.all_gather_object(times, (us, same))
            table.append({"bytes": ref.nbytes, "sizes": sizes, "variant": name,
                          "time_us": sum(t for t, _ in times) / world, "bitwise_equal": all(s for _, s in times)})
    if rank == 0:
        print(f"# uneven gather of {ROW_BYTES}-byte rows, world {world}, {torch.cuda.get_device_name()}, "
              f"NCCL {comm.path('nccl').nccl.version_string}, torch {torch.__version__}; 20 ops per graph, 10 replays")
        print(f"{'gathered bytes':>14s}  {'variant':45s} {'us':>9s} {'vs broadcast':>12s}  equal")
        base = {}
        for row in table:
            base.setdefault(row["bytes"], row["time_us"])
            print(f"{row['bytes']:14d}  {row['variant']:45s} {row['time_us']:9.2f} "
                  f"{base[row['bytes']] / row['time_us']:11.2f}x  {row['bitwise_equal']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": world, "row_bytes": ROW_BYTES, "rows": table}, f, indent=1)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
