"""Output: nccl-tests' table layout, bus-bandwidth factors, the JSON record, the rich summary.

The text layout copies nccl-tests column for column so the two tools' outputs can be diffed.
Nothing here touches torch.distributed: the runner hands over rank-averaged numbers.
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import IO, Iterable, Sequence

from . import ops

SCHEMA = "symcomm-bench/1"


def bus_factor(op: str, world: int) -> float:
    """busbw / algbw: the fraction of the data each rank's link carries (nccl-tests' factors)."""
    if world < 1:
        raise ValueError("world must be positive")
    return ops.spec(op).bus_factor(world)


def algbw_gbs(nbytes: int, time_us: float) -> float:
    """Bytes per second in GB/s (10^9), 0 where the time is 0 so empty messages print."""
    return nbytes / (time_us * 1e3) if time_us > 0 else 0.0


@dataclass(frozen=True)
class Timing:
    time_us: float
    wrong: int | None  # None when the check was off


@dataclass(frozen=True)
class SizeRow:
    algo: str
    nbytes: int
    count: int
    out_of_place: Timing
    in_place: Timing


@dataclass(frozen=True)
class DeviceInfo:
    rank: int
    pid: int
    host: str
    index: int | None  # None on cpu
    pci: tuple[int, int, int] | None  # (domain, bus, device)
    name: str


def pci_address(index: int) -> tuple[int, int, int]:
    """(domain, bus, device) of visible GPU ``index``: what DeviceInfo.pci holds, and how a rank
    finds another rank's GPU among its own (link.py)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return (getattr(props, "pci_domain_id", 0), getattr(props, "pci_bus_id", 0),
            getattr(props, "pci_device_id", 0))


@dataclass
class RunInfo:
    op: str
    world: int
    type_name: str       # the table's type, redop and root columns: the op's Labels
    redop: str           # "none" for gathers
    minbytes: int
    maxbytes: int
    stepfactor: int
    warmup: int
    iters: int
    check: bool
    graph: int
    device: str          # "cpu" / "cuda"
    device_name: str
    backend: str
    torch_version: str
    nccl_version: str | None
    notes: list[str] = field(default_factory=list)
    devices: list[DeviceInfo] = field(default_factory=list)
    version: str = "unknown"  # symcomm.__version__
    rounds: int = 1           # interleaved passes; each time is the median over them
    root: int = -1


@dataclass(frozen=True)
class LinkTimes:
    """Per size of the sweep (the collective's bytes): a peer copy of its bytes on the wire (link.py)."""
    factor: float                                          # bus-bandwidth factor of the op at this world
    times: dict[int, float] = field(default_factory=dict)  # collective bytes -> copy us, rank mean
    wrong: int = 0                                         # copied bytes that arrived wrong, all ranks
    refusal: str | None = None                             # why nothing was timed

    def wire(self, nbytes: int) -> int:
        """Bytes over one GPU's links for a collective of ``nbytes``."""
        return int(nbytes * self.factor)

    def fraction(self, nbytes: int, auto_us: float | None) -> float | None:
        """auto's speed as a fraction of the copy's: copy time / auto time."""
        copy_us = self.times.get(nbytes)
        return copy_us / auto_us if copy_us and auto_us else None

    def peak(self) -> tuple[float, int] | None:
        """(GB/s, wire bytes) of the fastest copy: the link's measured peak in this run."""
        rates = [(self.wire(n) / (t * 1e3), self.wire(n)) for n, t in self.times.items() if t > 0]
        return max(rates) if rates else None

    def record(self) -> dict:
        """What the run's JSON keeps."""
        peak = self.peak()
        return {"factor": self.factor, "copy_us": {str(n): t for n, t in sorted(self.times.items())},
                "wrong": self.wrong, "refusal": self.refusal,
                "peak_gbs": round(peak[0], 2) if peak else None}

    def note(self) -> str:
        """The summary's line about the copy."""
        if self.refusal is not None:
            return f"# link: not measured: {self.refusal}"
        peak = self.peak()
        where = f"; peak {peak[0]:.1f} GB/s at {peak[1]} B" if peak else ""
        return (f"# 'wire/GPU' = size x {self.factor:g}, the bytes each GPU's links carry; 'link copy' = a "
                f"copy-engine copy of them from the next rank's GPU, every rank at once{where}; "
                f"'auto of link' = link copy time / auto's time; copied bytes wrong: {self.wrong}")


def format_time(time_us: float) -> str:
    # nccl-tests (2.18+) drops decimals as the number grows so the column stays 7 wide.
    if time_us >= 100000.0:
        return f"{time_us:7.0f}"
    if time_us >= 10000.0:
        return f"{time_us:7.1f}"
    return f"{time_us:7.2f}"


def device_line(dev: DeviceInfo) -> str:
    head = f"#  Rank {dev.rank:2d} Group  0 Pid {dev.pid:6d} on {dev.host:>10s} device "
    if dev.index is None:
        return head + f"cpu [cpu] {dev.name}"
    domain, bus, device = dev.pci or (0, 0, 0)
    return head + f"{dev.index:2d} [{domain:04x}:{bus:02x}:{device:02x}] {dev.name}"


def test_name(op: str) -> str:
    """What the "Collective test starting/concluded" lines call the run (nccl-tests: the binary)."""
    return f"symcomm-bench {op}"


def header_lines(info: RunInfo) -> list[str]:
    """nccl-tests' preamble line for line, then symcomm's own notes as comment lines after the
    device list, where NCCL prints its version: a diff against nccl-tests stays small."""
    lines = [
        f"# symcomm-bench version {info.version} nccl-library={info.nccl_version or 'n/a'} "
        f"torch={info.torch_version}",
        f"# Collective test starting: {test_name(info.op)}",
        f"# nThread 1 nGpus 1 minBytes {info.minbytes} maxBytes {info.maxbytes} "
        f"step: {f'{info.stepfactor}(factor)' if info.stepfactor else 'none(--tokens)'} "
        f"warmup iters: {info.warmup} iters: {info.iters} "
        f"agg iters: 1 validation: {int(info.check)} graph: {info.graph} unalign: 0",
        "#",
        "# Using devices",
        *(device_line(dev) for dev in info.devices),
        "#",
        f"# symcomm-bench {info.op}: world {info.world}, {info.device} ({info.backend}), "
        f"{info.device_name}",
        *(f"# {note}" for note in info.notes),
        "#",
    ]
    return lines


def column_header() -> list[str]:
    blank = ""
    side = "  {:>7s}  {:>6s}  {:>6s}  {:>6s}"
    return [
        f"# {blank:10s}  {blank:12s}  {blank:8s}  {blank:6s}  {blank:6s}"
        "           out-of-place                       in-place          ",
        f"# {'size':>10s}  {'count':>12s}  {'type':>8s}  {'redop':>6s}  {'root':>6s}"
        + side.format("time", "algbw", "busbw", "#wrong") * 2 + " ",
        f"# {'(B)':>10s}  {'(elements)':>12s}  {blank:8s}  {blank:6s}  {blank:6s}"
        + side.format("(us)", "(GB/s)", "(GB/s)", "") * 2 + " ",
    ]


def block_header(algo: str) -> list[str]:
    return [f"# Using algo: {algo}", "#", *column_header()]


def format_row(row: SizeRow, info: RunInfo) -> str:
    factor = bus_factor(info.op, info.world)
    line = (f"{row.nbytes:12d}  {row.count:12d}  {info.type_name:>8s}  {info.redop:>6s}  "
            f"{info.root:6d}")
    for timing in (row.out_of_place, row.in_place):
        wrong = "N/A" if timing.wrong is None else "%g" % timing.wrong
        if math.isnan(timing.time_us):  # the path refused this call
            line += f"  {'N/A':>7s}  {'N/A':>6s}  {'N/A':>6s}  {wrong:>6s}"
            continue
        algbw = algbw_gbs(row.nbytes, timing.time_us)
        line += (f"  {format_time(timing.time_us)}  {algbw:6.2f}  {algbw * factor:6.2f}"
                 f"  {wrong:>6s}")
    return line


def total_wrong(rows: Iterable[SizeRow]) -> int:
    return sum((t.wrong or 0) for r in rows for t in (r.out_of_place, r.in_place))


def avg_busbw(rows: Sequence[SizeRow], op: str, world: int) -> float:
    # nccl-tests averages every timed busbw, out-of-place and in-place alike.
    factor = bus_factor(op, world)
    values = [algbw_gbs(r.nbytes, t.time_us) * factor
              for r in rows for t in (r.out_of_place, r.in_place) if not math.isnan(t.time_us)]
    return sum(values) / len(values) if values else 0.0


def footer_lines(rows: Sequence[SizeRow], info: RunInfo) -> list[str]:
    wrong = total_wrong(rows)
    return [
        f"# Out of bounds values : {wrong} {'FAILED' if wrong else 'OK'}",
        "# Avg bus bandwidth    : %g " % avg_busbw(rows, info.op, info.world),
        "#",
    ]


def conclusion_lines(info: RunInfo) -> list[str]:
    return [f"# Collective test concluded: {test_name(info.op)}", "#"]


def format_block(algo: str, rows: Sequence[SizeRow], info: RunInfo) -> list[str]:
    return [*block_header(algo), *(format_row(r, info) for r in rows), *footer_lines(rows, info)]


def flat_rows(rows: Iterable[SizeRow], factor: float) -> list[dict]:
    """One JSON record per timed column: out of place, then in place, for every row."""
    flat = []
    for row in rows:
        for inplace, timing in ((False, row.out_of_place), (True, row.in_place)):
            refused = math.isnan(timing.time_us)  # JSON has no NaN: refused calls are null
            algbw = None if refused else algbw_gbs(row.nbytes, timing.time_us)
            flat.append({"algo": row.algo, "bytes": row.nbytes, "count": row.count,
                         "time_us": None if refused else timing.time_us, "algbw": algbw,
                         "busbw": None if refused else algbw * factor,
                         "wrong": timing.wrong, "inplace": inplace})
    return flat


def json_payload(info: RunInfo, rows: Sequence[SizeRow], date: str, baseline: dict | None = None,
                 wire: LinkTimes | None = None, refused: dict[str, str] | None = None) -> dict:
    """The run's record; ``baseline``: Clean.record of the --baseline file it was compared with;
    ``wire``: the peer copies of each size's bytes on the wire, where they ran; ``refused``: why
    each column with N/A rows had them (its first refusal), as printed under its block. ``notes``
    are the preamble's lines (the op's shape, the check's seed, size rounding...)."""
    payload = {
        "schema": SCHEMA,
        "op": info.op,
        "dtype": info.type_name,
        "redop": info.redop,
        "world_size": info.world,
        "device": info.device,
        "device_name": info.device_name,
        "torch": info.torch_version,
        "nccl": info.nccl_version,
        "date": date,
        "graph_replays": info.graph,
        "iters": info.iters,
        "warmup_iters": info.warmup,
        "rounds": info.rounds,
        "root": info.root,
        "notes": list(info.notes),
        "refused": dict(refused or {}),
        "rows": flat_rows(rows, bus_factor(info.op, info.world)),
    }
    if baseline is not None:
        payload["baseline"] = baseline
    if wire is not None:
        payload["link"] = wire.record()
    return payload


def write_json(path: str, payload: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=1)
        fh.write("\n")


@dataclass(frozen=True)
class Clean:
    """NCCL at its best, from a `symcomm-bench baseline` file: per size, the out-of-place time
    of its faster buffer mode, measured in a process holding no other NCCL communicator."""
    source: str                  # the file, as given on the command line
    times: dict[int, float]      # bytes -> us
    note: str = ""               # the preamble's line about it
    record: dict = field(default_factory=dict)  # what the run's JSON records of it


# symcomm's own NCCL paths, whose ratio to the clean baseline shows what symcomm's process costs
# NCCL (1.00x: nothing), and auto, whose ratio is the claim.
CLEAN_COMPARED = ("nccl", "nccl-symm", "auto")
CLEAN_WIDTH = 12  # characters of piped summary per clean column: "1192.59" and its borders


def clean_compared(algos: Sequence[str]) -> list[str]:
    """The paths of this run that get a '<path> vs clean' column."""
    return [a for a in CLEAN_COMPARED if a in algos]


def pick_baseline(algos: Sequence[str]) -> str:
    for name in ("nccl", "torch"):
        if name in algos:
            return name
    return algos[0]


def compared_label(comparisons: Sequence[str]) -> str:
    """The summary's name for the comparison columns together: their common stem
    ("symm_mem-oneshot", "symm_mem-twoshot" -> "symm_mem"), or the one column's name."""
    stem = os.path.commonprefix(list(comparisons)).rstrip("-_+")
    return stem if len(comparisons) > 1 and stem else "/".join(comparisons)


def summary_table(rows: Sequence[SizeRow], algos: Sequence[str], clean: Clean | None = None,
                  comparisons: Sequence[str] = (), wire: LinkTimes | None = None):
    """rich Table: out-of-place time per path, the winner among the concrete paths, each path's
    speed-up over the baseline path (plain nccl on GPU, torch on CPU) and, where auto ran, how
    close auto came to the winner (best time / auto time: 1.00x means auto picked the best).
    ``comparisons``: columns of ``algos`` that time another library (PyTorch's symmetric
    memory): never the winner, since auto cannot pick them, but auto's speed-up over the fastest
    of them gets a column (their best time / auto time: above 1.00x, auto is faster).
    With ``clean``: its time per size and the speed-up over it of CLEAN_COMPARED's paths.
    With ``wire`` (where its copies ran): each size's bytes on the wire per GPU, the peer copy's
    time and auto's fraction of the copy's speed."""
    from rich.table import Table

    baseline = pick_baseline(algos)
    theirs = [a for a in algos if a in comparisons]
    # auto's columns (auto+fp8 too: a quantized output is another result, not a rival) are judged, not judges
    contenders = [a for a in algos if a.split("+")[0] != "auto" and a not in theirs] or list(algos)
    judge_auto = "auto" in algos and len(algos) > 1
    judge_theirs = "auto" in algos and bool(theirs)
    table = Table()
    table.add_column("size (B)", justify="right")
    for algo in algos:
        table.add_column(algo, justify="right")
    table.add_column("winner")
    others = [a for a in algos if a != baseline]
    for algo in others:
        table.add_column(f"{algo} vs {baseline}", justify="right")
    if judge_auto:
        table.add_column("auto vs best", justify="right")
    if judge_theirs:
        table.add_column(f"auto vs {compared_label(theirs)}", justify="right")
    judge_link = wire is not None and wire.refusal is None and "auto" in algos
    if judge_link:
        table.add_column("wire/GPU (B)", justify="right")
        table.add_column("link copy", justify="right")
        table.add_column("auto of link", justify="right")
    against_clean = clean_compared(algos) if clean is not None else []
    if clean is not None:
        table.add_column("nccl clean", justify="right")
    for algo in against_clean:
        table.add_column(f"{algo} vs clean", justify="right")

    by_size: dict[int, dict[str, float]] = {}
    for row in rows:
        by_size.setdefault(row.nbytes, {})
        if not math.isnan(row.out_of_place.time_us):
            by_size[row.nbytes][row.algo] = row.out_of_place.time_us
    for nbytes, times in by_size.items():
        present = {a: t for a, t in times.items() if a in contenders}
        winner = min(present, key=present.get) if present else "-"
        cells = [str(nbytes)]
        cells += [f"{times[a]:.2f}" if a in times else "-" for a in algos]
        cells.append(winner)
        base = times.get(baseline)
        for algo in others:
            t = times.get(algo)
            cells.append(f"{base / t:.2f}x" if base and t else "-")
        auto = times.get("auto")
        if judge_auto:
            cells.append(f"{present[winner] / auto:.2f}x" if present and auto else "-")
        if judge_theirs:
            best = min((times[a] for a in theirs if a in times), default=None)
            cells.append(f"{best / auto:.2f}x" if best and auto else "-")
        if judge_link:
            copy_us, share = wire.times.get(nbytes), wire.fraction(nbytes, auto)
            cells.append(str(wire.wire(nbytes)))
            cells.append(f"{copy_us:.2f}" if copy_us is not None else "-")
            cells.append(f"{share:.2f}" if share is not None else "-")
        if clean is not None:
            ref = clean.times.get(nbytes)
            cells.append(f"{ref:.2f}" if ref is not None else "-")
            for algo in against_clean:
                t = times.get(algo)
                cells.append(f"{ref / t:.2f}x" if ref and t else "-")
        table.add_row(*cells)
    return table


def print_summary(rows: Sequence[SizeRow], algos: Sequence[str], out: IO[str] | None = None,
                  clean: Clean | None = None, comparisons: Sequence[str] = (),
                  wire: LinkTimes | None = None) -> None:
    from rich.console import Console

    out = out or sys.stdout
    # Piped output gets a fixed width so the table is never folded at rich's 80-column default;
    # the clean columns get room of their own rather than squeezing the numbers into ellipses.
    table = summary_table(rows, algos, clean, comparisons, wire)
    # 19 characters a column keep a header like "symm_mem-oneshot" (16, and the borders) whole in a wide table.
    width = max(160, 19 * len(table.columns))
    width += 0 if clean is None else CLEAN_WIDTH * (1 + len(clean_compared(algos)))
    console = Console(file=out, width=None if out.isatty() else width, highlight=False)
    baseline = pick_baseline(algos)
    note = "; 'auto vs best' = winner's time / auto's time" if "auto" in algos and len(algos) > 1 else ""
    console.print(f"# Summary: out-of-place time (us) per path; '<path> vs {baseline}' = "
                  f"{baseline} time / path time{note}", markup=False)
    theirs = [a for a in algos if a in comparisons]
    if theirs and "auto" in algos:
        best = f"the fastest of {', '.join(theirs)}'s times" if len(theirs) > 1 else f"{theirs[0]}'s time"
        console.print(f"# 'auto vs {compared_label(theirs)}' = {best} / auto's time (another library's "
                      f"collective, for comparison: never the winner, which auto can pick)",
                      markup=False, soft_wrap=True)
    if clean is not None:
        # soft_wrap: a folded comment line would leave its tail without the "#".
        console.print(f"# 'nccl clean' = NCCL alone in its process, its faster buffer mode "
                      f"({clean.source}); '<path> vs clean' = clean time / path time",
                      markup=False, soft_wrap=True)
    if wire is not None and "auto" in algos:
        console.print(wire.note(), markup=False, soft_wrap=True)
    console.print(table)


class Emitter:
    """Rank 0 writes the report to stdout; the other ranks stay silent."""

    def __init__(self, lead: bool, out: IO[str] | None = None):
        self.lead = lead
        self.out = out or sys.stdout

    def __call__(self, lines: list[str]) -> None:
        if self.lead:
            self.out.write("".join(line + "\n" for line in lines))
            self.out.flush()

    def summary(self, rows: Sequence[SizeRow], algos: Sequence[str], clean: Clean | None = None,
                comparisons: Sequence[str] = (), wire: LinkTimes | None = None) -> None:
        if self.lead:
            print_summary(rows, algos, self.out, clean, comparisons, wire)
            self.out.flush()


def emit_blocks(emit: Emitter, info: RunInfo, rows: Sequence[SizeRow], algos: Sequence[str],
                refused: dict[str, str]) -> None:
    """One nccl-tests block per path and the conclusion (the non-streaming layout)."""
    for algo in algos:
        emit(format_block(algo, [r for r in rows if r.algo == algo], info))
        if algo in refused:
            emit([f"# {algo} refused some calls (N/A above), first: {refused[algo]}", "#"])
    emit(conclusion_lines(info))


class Progress:
    """Progress on stderr, never stdout. ``mode``: "bar" (a rich bar, for a terminal), "lines"
    (one line as each measurement starts, for a log: a sweep that stalls then names the path and
    size it stalled in, which a bar erased at exit or a table printed at the end cannot), or None."""

    def __init__(self, total: int, mode: str | None):
        self._bar = None
        self._task = None
        self._lines = mode == "lines" and total > 0
        self._total, self._started = total, 0
        if mode == "bar" and total > 0:
            from rich.console import Console
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(console=Console(stderr=True), transient=True,
                                     redirect_stdout=False, redirect_stderr=False)
            self._task = self._bar.add_task("symcomm-bench", total=total)

    def __enter__(self) -> "Progress":
        if self._bar is not None:
            self._bar.start()
        return self

    def starting(self, description: str) -> None:
        """A measurement begins (lines mode prints it; the bar moves on ``advance``)."""
        self._started += 1
        if self._lines:
            print(f"# progress {self._started}/{self._total}: {description}", file=sys.stderr, flush=True)

    def advance(self, description: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=description)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
