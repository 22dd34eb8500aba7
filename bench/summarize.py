"""Turn symcomm-bench --algo all JSON files into one markdown comparison per op and world.

    python bench/summarize.py bench/results/DIR/*_w*.json > bench/results/DIR/SUMMARY.md

For every size: each path's time (out-of-place and in-place), and auto's time over the faster
of plain and symmetric NCCL measured in the same run. Ratios above 1.05 are marked **; N/A where a path refused the call.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict


def human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def table(doc: dict) -> list[str]:
    times: dict[tuple[int, bool], dict[str, float]] = defaultdict(dict)
    for row in doc["rows"]:
        if row["time_us"] is not None:  # None: the path refused that call
            times[(row["bytes"], row["inplace"])][row["algo"]] = row["time_us"]
    checked = [row["wrong"] for row in doc["rows"] if row["wrong"] is not None]  # None with -c 0
    wrong = sum(checked) if checked else "not checked"
    lines = [f"### {doc['op']}, world {doc['world_size']} ({doc['dtype']}, {doc['device_name']}, "
             f"NCCL {doc['nccl']}, torch {doc['torch']}, {doc['graph_replays']} graph replays x "
             f"{doc['iters']} ops, #wrong total {wrong})", "",
             "| bytes | nccl | nccl-symm | auto | auto / best | in place: nccl | nccl-symm | auto | auto / best |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    worst = 0.0
    for nbytes in sorted({b for b, _ in times}):
        cells = [human(nbytes)]
        for inplace in (False, True):
            t = times[(nbytes, inplace)]
            cells += [f"{t[a]:.2f}" if a in t else "N/A" for a in ("nccl", "nccl-symm", "auto")]
            contenders = [t[a] for a in ("nccl", "nccl-symm") if a in t]
            if "auto" in t and contenders:
                ratio = t["auto"] / min(contenders)
                worst = max(worst, ratio)
                cells.append(f"{ratio:.3f}" + (" **" if ratio > 1.05 else ""))
            else:
                cells.append("N/A")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Worst auto / best: {worst:.3f}", ""]
    return lines


def main(paths: list[str]) -> None:
    docs = [json.load(open(p)) for p in paths]
    docs.sort(key=lambda d: (d["op"], -d["world_size"]))
    out = ["Times in microseconds per collective (CUDA-graph replay, averaged over ranks).", ""]
    for doc in docs:
        out += table(doc)
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1:])
