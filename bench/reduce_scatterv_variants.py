"""Which NCCL schedule reduces and scatters uneven rows fastest? An experiment, not a path.

    torchrun --nproc-per-node=2 bench/reduce_scatterv_variants.py [--json out.json]

symcomm's uneven reduce_scatterv on the ``nccl`` path has three schedules
(symcomm/backends/nccl.py, RSV_SCHEDULES); RSV_SCHEDULE_RULES picks one per call, and this
experiment supplies its limits. Each schedule is forced in turn (NcclPath.force_rsv_schedule)
and timed through ``comm.reduce_scatterv(..., algo="nccl")`` on the same rows, in the same run,
by CUDA-graph replay (symcomm.bench.runner.Timer, as bench/gatherv_variants.py):
- reduce-per-root: one ncclReduce per non-empty root, in one group (the only schedule before this experiment);
- padded: every root's rows copied into a buffer padded to max(sizes) rows per root, one
  ncclReduceScatter, and this rank's rows copied out of the padded result;
- send-recv: every root receives its rows from every peer in one group, then sums them in
  fp32 in rank order and rounds once to bf16;
- and, as the floor of the padded schedule, NCCL's even ncclReduceScatter on rows already
  padded (raw ctypes, no copies).
bf16 rows of 7168 values (14336 bytes), split unevenly by SHARES as in gatherv_variants. Each
schedule's output, of one eager call and of the last graph replay, is checked against a float64
reference of the same seeded random rows and against the reduce-per-root output, within the
bound of bf16 rounding: the schedules round differently, so they are not compared bit for bit.

Every wait is bounded by --timeout-s: the process group's (barriers, object exchange), the
Communicator's (NCCL setup and teardown), and each size's whole measurement, which runs under
symcomm's bounded(); a rank that gives up exits at once, and torchrun stops the others.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import symcomm
from symcomm import _nccl
from symcomm.backends.nccl import RSV_PADDED, RSV_REDUCE_PER_ROOT, RSV_SCHEDULES, RSV_SEND_RECV
from symcomm.bench.runner import Timer
from symcomm.bounded import bounded
from symcomm.errors import CommTimeoutError

SHARES = [1.0, 0.55, 1.45, 0.8, 1.2, 0.65, 1.35, 1.0]  # as bench/gatherv_variants.py's uneven split
HIDDEN = 7168  # bf16 values per row
ROW_BYTES = 2 * HIDDEN
FLOOR = "even reduce_scatter (padded, no copies)"
BF16_UNIT = 2.0 ** -8  # bf16's unit roundoff: half the spacing of values in [1, 2)


def rows_for(total_bytes: int, world: int) -> list[int]:
    shares = [SHARES[r % len(SHARES)] for r in range(world)]
    rows = total_bytes // ROW_BYTES
    return [max(1, round(rows * s / sum(shares))) for s in shares]


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def inputs_of(rank: int, total: int, seed: int, device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s input rows, regenerated identically on every rank for the reference."""
    gen = torch.Generator(device=device).manual_seed(seed + rank)
    return torch.randn(total, HIDDEN, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)


class Bench:
    def __init__(self, comm: symcomm.Communicator, iters: int, replays: int) -> None:
        self.comm, self.rank, self.world, self.device = comm, comm.rank, comm.world_size, comm.device
        self.path = comm.path("nccl")
        self.timer = Timer(self.device, iters=iters, warmup=3, graph_replays=replays)

    def run_size(self, total_bytes: int, seed: int) -> dict:
        rank, world, dev = self.rank, self.world, self.device
        sizes = rows_for(total_bytes, world)
        total, biggest, first = sum(sizes), max(sizes), sum(sizes[:rank])
        mine = slice(first, first + sizes[rank])
        x = inputs_of(rank, total, seed, dev)
        # float64 reference of this rank's rows, and the sum of magnitudes that bounds rounding
        ref = torch.zeros(sizes[rank], HIDDEN, dtype=torch.float64, device=dev)
        magnitude = torch.zeros_like(ref)
        for r in range(world):
            part = (x if r == rank else inputs_of(r, total, seed, dev))[mine].double()
            ref += part
            magnitude += part.abs()
        bound = world * BF16_UNIT * magnitude  # a chain of world - 1 bf16 roundings, or one
        out = torch.empty(sizes[rank], HIDDEN, dtype=torch.bfloat16, device=dev)
        baseline = torch.empty_like(out)

        def check(result: torch.Tensor) -> tuple[float, bool, bool]:
            err = (result.double() - ref).abs()
            vs_baseline = (result.double() - baseline.double()).abs()
            return (float(err.max()) if err.numel() else 0.0, bool((err <= bound).all()),
                    bool((vs_baseline <= 2 * bound).all()))

        results: dict[str, tuple[float, float, bool, bool]] = {}
        for schedule in RSV_SCHEDULES:  # reduce-per-root first: the others are checked against it
            self.path.force_rsv_schedule(schedule)
            try:
                call = lambda: self.comm.reduce_scatterv(x, sizes, out=out, algo="nccl")  # noqa: E731
                out.fill_(float("nan"))
                call()
                torch.cuda.synchronize(dev)
                if schedule == RSV_REDUCE_PER_ROOT:
                    baseline.copy_(out)
                eager = check(out)
                us = self.timer.measure(call)
                torch.cuda.synchronize(dev)
                replayed = check(out)  # the last graph replay's output
                results[schedule] = (us, max(eager[0], replayed[0]), eager[1] and replayed[1],
                                     eager[2] and replayed[2])
            finally:
                self.path.force_rsv_schedule(None)
        results[FLOOR] = self.floor(x, sizes, biggest, check)
        return self.combine(total_bytes, sizes, results)

    def floor(self, x: torch.Tensor, sizes: list[int], biggest: int, check) -> tuple[float, float, bool, bool]:
        """NCCL's even reduce_scatter of max(sizes) rows per rank, on rows padded beforehand."""
        world, rank = self.world, self.rank
        pad_in = torch.zeros(world * biggest, HIDDEN, dtype=torch.bfloat16, device=self.device)
        pad_out = torch.empty(biggest, HIDDEN, dtype=torch.bfloat16, device=self.device)
        start = 0
        for r, rows in enumerate(sizes):
            pad_in[r * biggest:r * biggest + rows].copy_(x[start:start + rows])
            start += rows
        lib, comm = self.path.nccl.lib, self.path.comm

        def run() -> None:
            self.path.nccl.check("ncclReduceScatter", lib.ncclReduceScatter(
                pad_in.data_ptr(), pad_out.data_ptr(), pad_out.numel(), _nccl.BFLOAT16, _nccl.REDUCE_OPS["sum"],
                comm, torch.cuda.current_stream().cuda_stream))

        pad_out.fill_(float("nan"))
        run()
        torch.cuda.synchronize(self.device)
        err, ok, agrees = check(pad_out[:sizes[rank]])
        return self.timer.measure(run), err, ok, agrees  # rows already padded: only the eager call is checked

    def combine(self, total_bytes: int, sizes: list[int], results: dict) -> dict:
        """Times averaged over ranks; errors the worst rank's; checks passed on every rank."""
        every: list = [None] * self.world
        dist.all_gather_object(every, results)
        row = {"bytes": sum(sizes) * ROW_BYTES, "requested_bytes": total_bytes, "sizes": sizes,
               "even": len(set(sizes)) == 1, "schedules": {}}
        for name in results:
            per_rank = [r[name] for r in every]
            row["schedules"][name] = {
                "time_us": sum(p[0] for p in per_rank) / self.world,
                "max_abs_error_vs_f64": max(p[1] for p in per_rank),
                "within_bf16_bound_vs_f64": all(p[2] for p in per_rank),
                "within_bf16_bound_vs_reduce_per_root": all(p[3] for p in per_rank),
            }
        base = row["schedules"][RSV_REDUCE_PER_ROOT]["time_us"]
        for entry in row["schedules"].values():
            entry["speedup_vs_reduce_per_root"] = base / entry["time_us"]
        return row


def print_table(rows: list[dict]) -> None:
    columns = [RSV_REDUCE_PER_ROOT, RSV_PADDED, RSV_SEND_RECV, FLOOR]
    short = {RSV_REDUCE_PER_ROOT: "reduce/root", RSV_PADDED: "padded", RSV_SEND_RECV: "send/recv", FLOOR: "floor"}
    head = f"{'input bytes':>12s} {'rows per rank':24s}" + "".join(f" {short[c]:>17s}" for c in columns)
    print(head + f" {'max err vs f64':>15s}  checks")
    for row in rows:
        cells = "".join(f" {row['schedules'][c]['time_us']:9.2f} ({row['schedules'][c]['speedup_vs_reduce_per_root']:4.2f}x)"
                        for c in columns)
        err = max(s["max_abs_error_vs_f64"] for s in row["schedules"].values())
        ok = all(s["within_bf16_bound_vs_f64"] and s["within_bf16_bound_vs_reduce_per_root"]
                 for s in row["schedules"].values())
        sizes = ",".join(map(str, row["sizes"])) + (" (even)" if row["even"] else "")
        print(f"{row['bytes']:12d} {sizes:24s}{cells} {err:15.3g}  {'ok' if ok else 'FAILED'}")
    failed = [(row["bytes"], name) for row in rows for name, s in row["schedules"].items()
              if not (s["within_bf16_bound_vs_f64"] and s["within_bf16_bound_vs_reduce_per_root"])]
    if failed:
        print(f"# outside the bf16 bound (input bytes, schedule): {failed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default="16K,64K,256K,1M,4M,16M,64M,256M",
                        help="total input bytes per call (x, every rank), comma-separated; K/M/G suffixes")
    parser.add_argument("--json", help="also write the rows here (rank 0)")
    parser.add_argument("--iters", type=int, default=20, help="calls captured per CUDA graph")
    parser.add_argument("--replays", type=int, default=10, help="graph replays timed")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="bound on every wait on peers: setup, each size's measurement, teardown")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the NVLink multicast (NVLS) off, as every run in bench/
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device, timeout=timedelta(seconds=args.timeout_s))
    # Nothing here uses symmetric windows: no pool, no second NCCL communicator.
    comm = symcomm.Communicator(symmetric=False, timeout_s=args.timeout_s)
    bench = Bench(comm, args.iters, args.replays)
    rows = []
    for i, text in enumerate(args.sizes.split(",")):
        nbytes = parse_size(text)
        try:
            rows.append(bounded(f"reduce_scatterv_variants at {nbytes} bytes",
                                lambda n=nbytes, seed=1000 * (i + 1): bench.run_size(n, seed), comm.timeout_s, device))
        except CommTimeoutError as exc:
            # The measuring thread is stuck in CUDA or NCCL; nothing can be torn down cleanly.
            print(f"rank {comm.rank}: {exc}", file=sys.stderr, flush=True)
            os._exit(3)
    if comm.rank == 0:
        print(f"# uneven reduce_scatterv of bf16 rows of {HIDDEN} ({ROW_BYTES} bytes), world {comm.world_size}, "
              f"{torch.cuda.get_device_name()}, NCCL {comm.path('nccl').nccl.version_string}, "
              f"torch {torch.__version__}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}; {args.iters} ops "
              f"per graph, {args.replays} replays; us per call (speedup vs reduce/root), averaged over ranks; "
              f"floor = even ncclReduceScatter on pre-padded rows")
        print_table(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": comm.world_size, "row_bytes": ROW_BYTES, "dtype": "bfloat16",
                           "device": torch.cuda.get_device_name(), "nccl": comm.path("nccl").nccl.version_string,
                           "torch": torch.__version__, "iters": args.iters, "replays": args.replays,
                           "nvls": os.environ.get("NCCL_NVLS_ENABLE"), "rows": rows}, f, indent=1)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
