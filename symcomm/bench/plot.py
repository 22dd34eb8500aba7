"""``--plot PATH.png``: latency and bus bandwidth against message size, one line per path.

matplotlib is optional: it is imported only when a plot is asked for, and the CLI checks for it
before any rank starts, so a missing install costs one line instead of a finished sweep. A GPU
machine without it can record ``--json`` and plot elsewhere:

    python -m symcomm.bench.plot RUN.json RUN.png
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from typing import Sequence

from .config import BenchError
from .report import RunInfo, SizeRow, Timing, algbw_gbs, bus_factor

MISSING = "--plot needs matplotlib, which is not installed (pip install matplotlib)"


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise BenchError(MISSING)


def check_path(path: str) -> None:
    if not path.lower().endswith(".png"):
        raise BenchError(f"--plot writes PNG: give a path ending in .png, not {path!r}")


def series(rows: Sequence[SizeRow], algos: Sequence[str], op: str,
           world: int) -> dict[str, tuple[list[int], list[float], list[float]]]:
    """algo -> (bytes, out-of-place time in us, busbw in GB/s), sizes ascending. Refused
    calls are left out, as are points a log axis cannot show (zero time or bandwidth)."""
    factor = bus_factor(op, world)
    out: dict[str, tuple[list[int], list[float], list[float]]] = {a: ([], [], []) for a in algos}
    for row in sorted(rows, key=lambda r: r.nbytes):
        t = row.out_of_place.time_us
        if row.algo not in out or math.isnan(t) or t <= 0 or row.nbytes <= 0:
            continue
        sizes, times, busbws = out[row.algo]
        sizes.append(row.nbytes)
        times.append(t)
        busbws.append(algbw_gbs(row.nbytes, t) * factor)
    return {a: s for a, s in out.items() if s[0]}


def size_label(nbytes: float) -> str:
    """1024 -> "1K", 1048576 -> "1M": the -b/-e spelling."""
    for suffix, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g}{suffix}"
    return f"{nbytes:g}"


def write_plot(path: str, info: RunInfo, rows: Sequence[SizeRow], algos: Sequence[str]) -> None:
    """Two log-log panels, latency and busbw, out-of-place, one line per path."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, LogLocator
    except ImportError:
        raise BenchError(MISSING) from None

    # A bare Figure (no pyplot): no global backend state, no display needed.
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    ax_time, ax_bw = fig.subplots(1, 2)
    data = series(rows, algos, info.op, info.world)
    for algo, (sizes, times, busbws) in data.items():
        style = dict(marker="o", markersize=3, linewidth=1.5, label=algo)
        if algo == "auto":
            style.update(linestyle="--", color="black")  # the choice, drawn over the paths
        ax_time.plot(sizes, times, **style)
        if any(b > 0 for b in busbws):
            ax_bw.plot(*zip(*[(s, b) for s, b in zip(sizes, busbws) if b > 0]), **style)
    for ax, ylabel in ((ax_time, "time (us), lower is better"), (ax_bw, "busbw (GB/s), higher is better")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=4))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: size_label(x)))
        ax.set_xlabel("message size (B)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.4)
        ax.grid(True, which="minor", alpha=0.1)
    if data:
        ax_time.legend(fontsize="small")
    timing = f"graph replay x{info.graph}" if info.graph else "eager"
    fig.suptitle(f"symcomm-bench {info.op}: world {info.world}, {info.type_name}, {info.device_name}, "
                 f"{timing}, out-of-place")
    try:
        fig.savefig(path, dpi=110, format="png")
    except OSError as exc:
        raise BenchError(f"--plot {path}: {exc.strerror or exc}") from None


def from_json(payload: dict) -> tuple[RunInfo, list[SizeRow], list[str]]:
    """A --json record back into what write_plot draws (paths in the order they ran)."""
    cells: dict[tuple[str, int], dict[bool, Timing]] = {}
    counts: dict[int, int] = {}
    algos: list[str] = []
    for r in payload["rows"]:
        if r["algo"] not in algos:
            algos.append(r["algo"])
        t = math.nan if r["time_us"] is None else r["time_us"]
        cells.setdefault((r["algo"], r["bytes"]), {})[r["inplace"]] = Timing(t, r["wrong"])
        counts[r["bytes"]] = r["count"]
    missing = Timing(math.nan, None)
    rows = [SizeRow(algo, nbytes, counts[nbytes], sides.get(False, missing), sides.get(True, missing))
            for (algo, nbytes), sides in cells.items()]
    info = RunInfo(op=payload["op"], world=payload["world_size"], type_name=payload["dtype"],
                   redop=payload["redop"], minbytes=min(counts), maxbytes=max(counts), stepfactor=0,
                   warmup=payload["warmup_iters"], iters=payload["iters"], check=True,
                   graph=payload["graph_replays"], device=payload["device"],
                   device_name=payload["device_name"], backend="", torch_version=payload["torch"],
                   nccl_version=payload["nccl"], rounds=payload.get("rounds", 1))
    return info, rows, algos


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    prog = "python -m symcomm.bench.plot"
    if len(args) != 2:
        print(f"usage: {prog} RUN.json OUT.png  (RUN.json from symcomm-bench --json)", file=sys.stderr)
        return 2
    try:
        check_path(args[1])
        with open(args[0], encoding="utf-8") as fh:
            info, rows, algos = from_json(json.load(fh))
        write_plot(args[1], info, rows, algos)
    except BenchError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"{prog}: error: {args[0]} is not a symcomm-bench --json record ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
