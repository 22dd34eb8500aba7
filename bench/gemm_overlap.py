"""What programmatic dependent launch (csrc/launch.cuh) gains, on and off in the same run.

    torchrun --nproc-per-node=N bench/gemm_overlap.py [--sizes 1K,16K,...] [--json out.json]

Two views, CUDA-graph replay under comm.graph_capture(), each with symcomm's kernels launched
with the overlap and without it (PeerContext.set_overlap), alternating per size:

- model view: a GEMM writes x, a [rows, cols] bf16 tensor in the symmetric pool, then
  comm.all_reduce(x) on the path auto picks (and, for the norm rows, all_reduce_rmsnorm with
  a residual). The GEMM alone is timed too: "+AR" is the pair minus the GEMM, the all-reduce's
  cost as a decode step sees it.
- nccl-tests view: the same all-reduce, back to back (Timer's 20 calls per graph).

set_overlap switches the peer kernels but not the RMSNorm kernel, which is always launched
overlapped: "+norm off" turns off the all-reduce's overlap only.

Checks, every size: the all-reduce's overlapped and plain outputs are equal bit for bit (the
same kernel, only scheduled differently), and within bf16 rounding of NCCL's; the norm rows
are timed, not checked (the norm op's own tests and bench check it). Where auto picks NCCL
(large sizes), on and off are the same launch and the rows say so. Timings from
simulated ranks or a single GPU mean nothing: run it on N >= 2 GPUs.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import symcomm
from symcomm.bench.timing import Timer

K = 4096      # the GEMM's inner dimension: a model's hidden size
MAX_COLS = 7168


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def shape_for(nbytes: int) -> tuple[int, int]:
    """[rows, cols] of bf16 with nbytes: one row up to MAX_COLS columns, then more rows."""
    elems = nbytes // 2
    cols = min(elems, MAX_COLS)
    return elems // cols, cols


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1K,4K,16K,64K,256K,1M,4M")
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = symcomm.Communicator(symmetric_capacity=256 << 20)
    custom = next((comm.path(n) for n in comm.algorithms() if n.startswith("custom-")), None)
    if custom is None:
        raise SystemExit(f"symcomm's kernels are off here: {comm.capabilities()['paths']}")
    state = custom.context
    timer = Timer(torch.device("cuda", local), iters=20, warmup=3, graph_replays=10, capture=comm.graph_capture)
    gen = torch.Generator(device="cuda").manual_seed(17 + rank)
    rows_out = []
    for text in args.sizes.split(","):
        rows, cols = shape_for(parse_size(text))
        a = torch.randn(rows, K, device="cuda", generator=gen, dtype=torch.bfloat16) / K**0.5
        w = torch.randn(K, cols, device="cuda", generator=gen, dtype=torch.bfloat16)
        weight = (1 + 0.1 * torch.randn(cols, device="cuda", generator=gen)).to(torch.bfloat16)
        residual = torch.randn(rows, cols, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3),
                               dtype=torch.bfloat16)
        with symcomm.use_symmetric_memory(comm):
            x = torch.empty(rows, cols, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        algo = comm.select("all_reduce", x, out=out).algo
        norm_algo = comm.select("all_reduce_rmsnorm", x, weight=weight, residual=residual).algo \
            if cols % 16 == 0 and cols <= 8192 else None

        def gemm():
            torch.matmul(a, w, out=x)

        def gemm_ar():
            torch.matmul(a, w, out=x)
            comm.all_reduce(x, out=out)

        def gemm_norm():
            torch.matmul(a, w, out=x)
            comm.all_reduce_rmsnorm(x, weight, residual=residual)

        def ar():
            comm.all_reduce(x, out=out)

        row = {"bytes": x.nbytes, "shape": [rows, cols], "algo": algo, "norm_algo": norm_algo}
        results = {}
        for overlap in (True, False):
            state.set_overlap(overlap)
            tag = "on" if overlap else "off"
            row[f"gemm_{tag}"] = timer.measure(gemm)
            row[f"gemm_ar_{tag}"] = timer.measure(gemm_ar)
            row[f"ar_{tag}"] = timer.measure(ar)
            if norm_algo is not None:
                row[f"gemm_norm_{tag}"] = timer.measure(gemm_norm)
            gemm_ar()
            torch.cuda.synchronize()
            results[tag] = out.clone()
        state.set_overlap(True)
        want = comm.all_reduce(x, algo="nccl")
        torch.cuda.synchronize()
        row["on_equals_off"] = bool(torch.equal(results["on"].view(torch.int16), results["off"].view(torch.int16)))
        row["max_err_vs_nccl"] = float((results["on"].float() - want.float()).abs().max())
        row["tolerance"] = float(want.float().abs().max()) * 2**-7 * 2
        per_rank = [None] * world
        dist.all_gather_object(per_rank, row)
        if rank == 0:
            merged = dict(per_rank[0])
            for key in merged:
                if key.startswith(("gemm", "ar_")):
                    merged[key] = max(r[key] for r in per_rank)  # the slowest rank
            merged["on_equals_off"] = all(r["on_equals_off"] for r in per_rank)
            merged["within_tolerance"] = all(r["max_err_vs_nccl"] <= r["tolerance"] for r in per_rank)
            rows_out.append(merged)
    if rank == 0:
        print(f"# programmatic dependent launch, world {world}, {torch.cuda.get_device_name()}, torch "
              f"{torch.__version__}; graph replay, 20 calls per graph, 10 replays, slowest rank; us")
        print(f"{'bytes':>9s} {'shape':>11s} {'path':>15s} | {'AR b2b on':>9s} {'off':>7s} | {'GEMM':>7s} "
              f"{'+AR on':>7s} {'+AR off':>7s} | {'+norm on':>8s} {'off':>7s} | same  ok")
        for r in rows_out:
            g_on, g_off = r["gemm_on"], r["gemm_off"]
            norm = (f"{r['gemm_norm_on'] - g_on:8.2f} {r['gemm_norm_off'] - g_off:7.2f}"
                    if r["norm_algo"] else f"{'-':>8s} {'-':>7s}")
            print(f"{r['bytes']:9d} {'x'.join(map(str, r['shape'])):>11s} {r['algo']:>15s} | {r['ar_on']:9.2f} "
                  f"{r['ar_off']:7.2f} | {g_on:7.2f} {r['gemm_ar_on'] - g_on:7.2f} {r['gemm_ar_off'] - g_off:7.2f} | "
                  f"{norm} | {str(r['on_equals_off']):5s} {r['within_tolerance']}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"world_size": world, "device": torch.cuda.get_device_name(), "rows": rows_out}, fh,
                          indent=1)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
