"""FP4 all-gatherv against the bf16 one, and the quantizer against the GPU's copy bandwidth.

    torchrun --nproc-per-node=4 bench/fp4_gather.py OUT_DIR [--split uneven|equal|both]

Per total message size (bytes of the gathered bf16 rows, 64 KiB to 256 MiB by default; rows of
H = 7168 like a large MoE model's hidden size), on the same rows:

- bf16: ``comm.all_gatherv`` of the bf16 rows (the gather to beat);
- fp4: ``comm.all_gatherv_fp4``: quantize into the output slice, gather payload + scales;
- fp4+dequant: the same, then decode every gathered row to bf16;
- fp4 by path: the same call with ``algo=`` each path named by ``--fp4-algo`` (repeatable), to
  compare the FP4 paths on the same rows (a path that cannot serve a size is left out, with why);
- bytes on the wire for both (the gathered bytes);
- the quantizer alone on all the message's rows, and the dequantizer, as GB/s of bytes read +
  written, next to a device-to-device torch copy of the same bf16 rows timed in the same run.

Splits: ``uneven`` gives rank r a share proportional to UNEVEN_WEIGHTS[r % 8] (a skewed MoE
batch; small sizes leave some ranks with 0 rows), in ordinary memory, so every gather runs
NCCL broadcasts; ``equal`` gives every rank the same rows, in symmetric memory, so the
dispatch may take nccl-symm for both. Timing as in docs/measuring.md / symcomm.bench.timing.Timer:
``--iters`` calls captured in one CUDA graph, replayed ``--replays`` times back to back,
divided; averaged over ranks. Each size is also checked: the bf16 gather against the
regenerated rows, the fp4 payload and scales bitwise against quantizing those rows locally.
Writes fp4_gather.json and fp4_gather.md to OUT_DIR; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from contextlib import nullcontext
from datetime import datetime, timezone

import torch
import torch.distributed as dist

import symcomm
from symcomm import fp4
from symcomm.bench.runner import Timer

UNEVEN_WEIGHTS = (1.0, 0.55, 1.45, 0.8, 1.2, 0.65, 1.35, 1.0)
KIB, MIB = 1 << 10, 1 << 20


def parse_size(text: str) -> int:
    units = {"K": KIB, "M": MIB, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def split_rows(total: int, world: int, split: str) -> list[int]:
    if split == "equal":
        return [total // world] * world
    weights = [UNEVEN_WEIGHTS[r % len(UNEVEN_WEIGHTS)] for r in range(world)]
    exact = [total * w / sum(weights) for w in weights]
    rows = [math.floor(e) for e in exact]
    # largest remainders take the leftover rows, so the counts add up to total
    for r in sorted(range(world), key=lambda r: exact[r] - rows[r], reverse=True)[: total - sum(rows)]:
        rows[r] += 1
    return rows


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


class Bench:
    def __init__(self, comm: symcomm.Communicator, args: argparse.Namespace, split: str) -> None:
        self.comm, self.args, self.split = comm, args, split
        self.rank, self.world, self.h = comm.rank, comm.world_size, args.hidden
        self.device = comm.device
        self.timer = Timer(self.device, args.iters, args.warmup, args.replays)
        max_rows = self.total_rows(args.max_bytes)
        local = max(split_rows(max_rows, self.world, split))
        ctx = symcomm.use_symmetric_memory(comm) if split == "equal" else nullcontext()
        h, dev = self.h, self.device
        with ctx:  # the same shapes in the same order on every rank: equal offsets
            self.x = torch.empty(local, h, dtype=torch.bfloat16, device=dev)
            self.out = torch.empty(max_rows, h, dtype=torch.bfloat16, device=dev)
            self.packed = torch.empty(max_rows, h // 2, dtype=torch.uint8, device=dev)
            self.scales = torch.empty(max_rows, h // fp4.BLOCK, dtype=torch.float8_e4m3fn, device=dev)
            self.values = torch.empty(max_rows, h, dtype=torch.bfloat16, device=dev)

    def total_rows(self, nbytes: int) -> int:
        rows = max(1, round(nbytes / (2 * self.h)))
        return -(-rows // self.world) * self.world if self.split == "equal" else rows

    def time(self, call) -> float:
        t = torch.tensor([self.timer.measure(call)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.world

    def run_size(self, nbytes: int) -> dict:
        comm, h = self.comm, self.h
        total = self.total_rows(nbytes)
        rows = split_rows(total, self.world, self.split)
        first = sum(rows[: self.rank])
        gen = torch.Generator(device=self.device).manual_seed(1234 + total)
        whole = torch.randn(total, h, generator=gen, device=self.device, dtype=torch.float32).to(torch.bfloat16)
        x = self.x[: rows[self.rank]]
        x.copy_(whole[first:first + rows[self.rank]])
        out = self.out[:total]
        packed, scales, values = self.packed[:total], self.scales[:total], self.values[:total]
        gs = fp4.global_scale_for(x, comm)  # the max over ranks: the same scale everywhere
        plain = symcomm.Fp4Gathered(packed, scales, (), None, gs)
        decoded = symcomm.Fp4Gathered(packed, scales, (), values, gs)

        t_bf16 = self.time(lambda: comm.all_gatherv(x, rows, out=out))
        bf16_path = comm.select("all_gatherv", x, out=out, sizes=rows).algo
        wrong_bf16 = int((out != whole).sum())
        t_fp4 = self.time(lambda: comm.all_gatherv_fp4(x, rows, gs, out=plain))
        choice = comm.select("all_gatherv_fp4", x, sizes=rows, global_scale=gs, out=plain)
        fp4_path = choice.algo if choice.gather is None else f"{choice.algo} ({choice.gather.algo})"
        ref_packed, ref_scales = fp4.quantize(whole, gs)

        def fp4_wrong() -> int:
            return (int((packed != ref_packed).sum())
                    + int((scales.view(torch.uint8) != ref_scales.view(torch.uint8)).sum()))

        wrong_fp4 = fp4_wrong()
        by_algo: dict[str, float | str] = {}
        for algo in self.args.fp4_algo:
            # A path that cannot serve says why when forced (the same answer on every rank).
            why = comm.select("all_gatherv_fp4", x, sizes=rows, global_scale=gs, out=plain).rejected.get(algo, "")
            if why and not why.startswith("ranked below"):
                by_algo[algo] = f"N/A: {why}"
                continue
            packed.fill_(0), scales.view(torch.uint8).fill_(0xFF)  # what the path leaves unwritten counts
            by_algo[algo] = self.time(lambda a=algo: comm.all_gatherv_fp4(x, rows, gs, out=plain, algo=a))
            wrong_fp4 += fp4_wrong()
        t_deq = self.time(lambda: comm.all_gatherv_fp4(x, rows, gs, dequantize=True, out=decoded))
        wrong_fp4 += int((values.view(torch.int16) != fp4.dequantize(ref_packed, ref_scales, gs).view(torch.int16)).sum())

        # Single-GPU rates on all the message's rows.
        t_quant = self.time(lambda: fp4.quantize(whole, gs, out=(packed, scales)))
        t_dequant = self.time(lambda: fp4.dequantize(packed, scales, gs, torch.bfloat16, out=values))
        t_copy = self.time(lambda: values.copy_(out))
        elems = total * h
        fp4_bytes = elems // 2 + elems // fp4.BLOCK
        quant_io, copy_io = 2 * elems + fp4_bytes, 2 * 2 * elems
        row = {
            "bytes_bf16": 2 * elems, "rows": total, "rows_per_rank": rows,
            "bf16_us": t_bf16, "bf16_path": bf16_path,
            "fp4_us": t_fp4, "fp4_path": fp4_path, "fp4_speedup": t_bf16 / t_fp4, "fp4_by_path_us": by_algo,
            "fp4_dequant_us": t_deq, "fp4_dequant_speedup": t_bf16 / t_deq,
            "wire_bf16": 2 * elems, "wire_fp4": fp4_bytes, "wire_ratio": 2 * elems / fp4_bytes,
            "quant_us": t_quant, "quant_gbps": quant_io / t_quant / 1e3,
            "dequant_us": t_dequant, "dequant_gbps": quant_io / t_dequant / 1e3,
            "copy_us": t_copy, "copy_gbps": copy_io / t_copy / 1e3,
            "wrong_bf16": wrong_bf16, "wrong_fp4": wrong_fp4,
        }
        row["quant_of_copy"] = row["quant_gbps"] / row["copy_gbps"]
        wrong = torch.tensor([wrong_bf16, wrong_fp4], dtype=torch.int64, device=self.device)
        dist.all_reduce(wrong)
        row["wrong_bf16"], row["wrong_fp4"] = (int(v) for v in wrong.tolist())
        return row


def _size(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= div:
            return f"{n / div:.4g} {unit}"
    return f"{n:.0f} B"


def markdown(meta: dict, results: dict[str, list[dict]]) -> str:
    lines = [f"# FP4 all-gatherv, {meta['world']}x {meta['gpu']} ({meta['date']})", "",
             f"torch {meta['torch']}, NCCL {meta['nccl']}, H = {meta['hidden']}, bf16 input. {meta['timing']}", "",
             f"Splits: {meta['splits']}", "",
             "Sizes are the gathered bf16 bytes. speedup = bf16 time / fp4 time. quant and dequant run "
             "on one GPU over all the message's rows; GB/s counts bytes read + written; copy is a "
             "device-to-device torch copy of the same bf16 rows. #wrong: elements or bytes that "
             "differ from the local reference, summed over ranks.", ""]
    for split, rows in results.items():
        lines += [f"## {split} split", "",
                  "| size | rows | bf16 us | path | fp4 us | path | speedup | fp4+deq us | speedup | wire bf16 "
                  "| wire fp4 | quant us | quant GB/s | copy GB/s | quant/copy | dequant GB/s | #wrong |",
                  "|" + "---:|" * 17]
        for r in rows:
            lines.append(
                f"| {_size(r['bytes_bf16'])} | {r['rows']} | {r['bf16_us']:.1f} | {r['bf16_path']} | {r['fp4_us']:.1f} "
                f"| {r['fp4_path']} | {r['fp4_speedup']:.2f}x | {r['fp4_dequant_us']:.1f} | {r['fp4_dequant_speedup']:.2f}x "
                f"| {_size(r['wire_bf16'])} | {_size(r['wire_fp4'])} | {r['quant_us']:.1f} | {r['quant_gbps']:.0f} "
                f"| {r['copy_gbps']:.0f} | {r['quant_of_copy']:.0%} | {r['dequant_gbps']:.0f} "
                f"| {r['wrong_bf16'] + r['wrong_fp4']} |")
        lines.append("")
        algos = sorted({a for r in rows for a in r.get("fp4_by_path_us", {})})
        if algos:
            lines += [f"### {split} split, fp4 by path (us; bf16 time / path time in brackets)", "",
                      "| size | " + " | ".join(algos) + " |", "|" + "---:|" * (len(algos) + 1)]
            for r in rows:
                cells = []
                for a in algos:
                    t = r["fp4_by_path_us"].get(a, "-")
                    cells.append(f"{t:.2f} ({r['bf16_us'] / t:.2f}x)" if isinstance(t, float) else str(t)[:60])
                lines.append(f"| {_size(r['bytes_bf16'])} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--split", choices=("uneven", "equal", "both"), default="both")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--min-bytes", type=parse_size, default=64 * KIB)
    p.add_argument("--max-bytes", type=parse_size, default=256 * MIB)
    p.add_argument("--factor", type=int, default=2)
    p.add_argument("--iters", type=int, default=20, help="calls captured per graph")
    p.add_argument("--replays", type=int, default=10, help="graph replays timed back to back")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fp4-algo", action="append", default=[], metavar="PATH",
                   help="also time all_gatherv_fp4 with algo=PATH (repeatable: fused-flagfree, fused-push, unfused)")
    args = p.parse_args()
    if args.hidden % fp4.BLOCK:
        p.error(f"--hidden must be a multiple of {fp4.BLOCK}")

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local))
    rank = dist.get_rank()
    splits = ("uneven", "equal") if args.split == "both" else (args.split,)
    # x, out, packed, scales and values for the largest size, for the equal split's buffers
    capacity = (3 * args.max_bytes) + args.max_bytes // 4 + (64 * MIB)
    comm = symcomm.Communicator(symmetric_capacity=capacity if "equal" in splits else 0)
    sizes = []
    n = args.min_bytes
    while n <= args.max_bytes:
        sizes.append(n)
        n *= args.factor
    results: dict[str, list[dict]] = {}
    for split in splits:
        bench = Bench(comm, args, split)
        results[split] = []
        for nbytes in sizes:
            row = bench.run_size(nbytes)
            results[split].append(row)
            log(rank, f"[{split}] {_size(row['bytes_bf16'])}: bf16 {row['bf16_us']:.1f} us ({row['bf16_path']}), "
                      f"fp4 {row['fp4_us']:.1f} us ({row['fp4_path']}, {row['fp4_speedup']:.2f}x), "
                      f"+deq {row['fp4_dequant_us']:.1f} us, quant {row['quant_gbps']:.0f} GB/s = "
                      f"{row['quant_of_copy']:.0%} of copy, wrong {row['wrong_bf16']}/{row['wrong_fp4']}")
        del bench
        torch.cuda.empty_cache()
    caps = comm.capabilities()
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "world": comm.world_size, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "nccl": (caps.get("nccl") or {}).get("version"), "hidden": args.hidden,
        "timing": f"Timing: {args.iters} calls captured in one CUDA graph, replayed {args.replays} times back to "
                  f"back, divided; averaged over ranks.",
        "splits": "uneven: rank r gets a share of the rows proportional to "
                  f"{list(UNEVEN_WEIGHTS)}[r % 8] (ordinary memory); equal: the same rows per rank "
                  "(symmetric memory, rows rounded up to a multiple of the world size).",
        "args": vars(args),
    }
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "fp4_gather.json"), "w", encoding="utf-8") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=1)
        with open(os.path.join(args.out_dir, "fp4_gather.md"), "w", encoding="utf-8") as fh:
            fh.write(markdown(meta, results))
        log(rank, f"wrote {args.out_dir}/fp4_gather.json and fp4_gather.md")
    wrong = sum(r["wrong_bf16"] + r["wrong_fp4"] for rows in results.values() for r in rows)
    comm.close()
    dist.destroy_process_group()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
