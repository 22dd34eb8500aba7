#!/usr/bin/env python3
"""symcomm's auto path against external yardsticks measured in the same call: NVIDIA's
nccl-tests (plain buffers, -R 0, and symmetric windows, -R 2) and, where symcomm-bench ran them,
PyTorch's symmetric-memory paths (any path whose name starts with ``symm_mem``).

    python3 scripts/compare.py DIR [--md FILE] [--json FILE]

DIR holds, per op, what ``gpu_check.sh compare`` writes there:

    OP_nccl_tests_R0.txt   nccl-tests' stdout, plain buffers
    OP_nccl_tests_R2.txt   nccl-tests' stdout, buffers registered as symmetric windows
    OP_symcomm.json        symcomm-bench OP --algo all --json

and prints one markdown table per op: out-of-place times per size, and auto's time divided by
the best yardstick's (above 1.00: symcomm's auto is slower, shown in bold with '!'). Where
symcomm-bench timed its link copies (the JSON's ``link``), a last column gives auto's wire bytes
per second as a share of the copy's peak in that run (docs/measuring.md, "How close to the wire").

Sizes mean the same bytes on both sides: the tensor for all_reduce, the whole output for
all_gather, the whole input for reduce_scatter (nccl-tests' convention, which symcomm-bench
copies: docs/measuring.md), both rounded down to whole elements per rank. Rows are matched on
that byte count, so a size one tool rounded differently shows up as two half-empty rows rather
than a wrong ratio.

Exit status: 1 if any #wrong column of either tool is above 0; else 2 if an input is missing or
cannot be compared (different world, different datatype, a run that did not finish); else 0.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

SCHEMA = "symcomm-compare/1"
MODES = ("R0", "R2")  # nccl-tests' -R: 0 plain buffers, 2 symmetric windows
SYMM_MEM_PREFIX = "symm_mem"  # PyTorch's own symmetric-memory paths in symcomm-bench
WRONG_LABELS = {"R0": "nccl-tests R0", "R2": "nccl-tests R2", "symcomm": "symcomm-bench"}


# -- nccl-tests' stdout ------------------------------------------------------------------

@dataclass(frozen=True)
class Side:
    """One side (out-of-place or in-place) of a row: time and #wrong (None: not checked)."""
    time_us: Optional[float]
    wrong: Optional[int]


@dataclass(frozen=True)
class NcclRow:
    nbytes: int
    count: int
    type_name: str
    redop: str
    out_of_place: Side
    in_place: Side


@dataclass
class NcclRun:
    """One nccl-tests run as its stdout shows it."""
    rows: dict[int, NcclRow] = field(default_factory=dict)  # by size in bytes
    world: Optional[int] = None          # nThread x nGpus of the header (MPI=0: one process)
    version: Optional[str] = None        # the '# nccl-tests version ...' line
    library: Optional[str] = None        # the libnccl it ran, as "2.28.9"
    footer_wrong: Optional[int] = None   # '# Out of bounds values : N'; None: the run never got there

    @property
    def wrong(self) -> int:
        return sum(s.wrong or 0 for r in self.rows.values() for s in (r.out_of_place, r.in_place))


_HEADER = re.compile(r"#\s*nThread\s+(\d+)\s+nGpus\s+(\d+)")
_FOOTER = re.compile(r"#\s*Out of bounds values\s*:\s*(\d+)")
_LIBRARY = re.compile(r"nccl-library=(\d+)")


def nccl_version(code: int) -> str:
    """NCCL_VERSION_CODE as a dotted version: 22809 -> "2.28.9" (the 2.9+ encoding)."""
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def _number(text: str) -> Optional[float]:
    """A time or #wrong cell; None for 'N/A' (nccl-tests prints it where the check was off)."""
    return None if text == "N/A" else float(text)


def _side(cells: Sequence[str]) -> Side:
    # time, algbw, busbw, #wrong: bandwidths follow from the time and the size, so only those two count.
    time_us, wrong = _number(cells[0]), _number(cells[3])
    return Side(time_us, None if wrong is None else int(wrong))


def parse_nccl_tests(text: str) -> NcclRun:
    """Rows of size, count, type, redop, root, then out-of-place time, algbw, busbw, #wrong and
    in-place the same. '#' lines are comments, of which the header's nThread/nGpus and the
    footer's '#wrong' total are read; any other line (NCCL's warnings, an error) is skipped."""
    run = NcclRun()
    for line in text.splitlines():
        if line.startswith("#"):
            if line.startswith("# nccl-tests version"):
                run.version = line[2:].strip()
                if (m := _LIBRARY.search(line)) is not None:
                    run.library = nccl_version(int(m.group(1)))
            elif (m := _HEADER.match(line)) is not None:
                run.world = int(m.group(1)) * int(m.group(2))
            elif (m := _FOOTER.match(line)) is not None:
                run.footer_wrong = int(m.group(1))
            continue
        cells = line.split()
        if len(cells) < 13 or not (cells[0].isdigit() and cells[1].isdigit()):
            continue
        try:
            row = NcclRow(int(cells[0]), int(cells[1]), cells[2], cells[3],
                          _side(cells[5:9]), _side(cells[9:13]))
        except ValueError:  # a line that only looks like a row
            continue
        run.rows.setdefault(row.nbytes, row)
    return run


# -- symcomm-bench's --json ----------------------------------------------------------------

@dataclass
class SymcommRun:
    op: str
    dtype: str
    world: int
    times: dict[int, dict[str, Optional[float]]]  # bytes -> path -> out-of-place us (None: refused)
    wrong: int                                   # every column, in place too, summed
    nccl: Optional[str] = None
    torch: Optional[str] = None
    date: Optional[str] = None
    link: Optional[dict] = None  # the record's "link": peer copies of the wire bytes (docs/measuring.md)

    @property
    def paths(self) -> list[str]:
        seen: dict[str, None] = {}
        for by_path in self.times.values():
            seen.update(dict.fromkeys(by_path))
        return list(seen)


def load_symcomm(payload: dict) -> SymcommRun:
    """symcomm-bench's record (symcomm/bench/report.py json_payload): one row per path, size and
    side, each with algo, bytes, time_us (null where the path refused) and wrong."""
    times: dict[int, dict[str, Optional[float]]] = {}
    wrong = 0
    for row in payload["rows"]:
        wrong += row.get("wrong") or 0
        if not row["inplace"]:
            times.setdefault(row["bytes"], {})[row["algo"]] = row["time_us"]
    return SymcommRun(payload["op"], payload["dtype"], payload["world_size"], times, wrong,
                      payload.get("nccl"), payload.get("torch"), payload.get("date"), payload.get("link"))


def is_symm_mem(path: str) -> bool:
    return path.startswith(SYMM_MEM_PREFIX)


def is_symcomm_path(path: str) -> bool:
    """One of symcomm's own concrete paths: auto (and auto+fp8 and the like) is what is judged,
    and PyTorch's symmetric memory is a yardstick, not one of symcomm's paths."""
    return path.split("+")[0] != "auto" and not is_symm_mem(path)


# -- the comparison ------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    nbytes: int
    nccl_tests: dict[str, Optional[float]]  # mode (R0, R2) -> out-of-place us
    auto: Optional[float]
    best_path: Optional[str]                # symcomm's fastest concrete path here
    best_path_us: Optional[float]
    symm_mem: dict[str, Optional[float]]    # PyTorch's paths -> us
    of_link_peak: Optional[float] = None    # auto's wire bytes per second / the link copy's peak

    @property
    def best_nccl_tests(self) -> Optional[float]:
        return _least(self.nccl_tests.values())

    @property
    def best_yardstick(self) -> Optional[float]:
        return _least([*self.nccl_tests.values(), *self.symm_mem.values()])

    @property
    def auto_vs_nccl_tests(self) -> Optional[float]:
        return _ratio(self.auto, self.best_nccl_tests)

    @property
    def auto_vs_best(self) -> Optional[float]:
        return _ratio(self.auto, self.best_yardstick)


@dataclass
class OpResult:
    op: str
    rows: list[Row]
    symm_mem_paths: list[str]
    wrong: dict[str, Optional[int]]  # R0, R2, symcomm -> #wrong summed (None: no such run)
    problems: list[str]
    sources: dict[str, str]          # what each input says it is
    world: Optional[int] = None      # symcomm-bench's, else nccl-tests'
    link_peak_gbs: Optional[float] = None  # the link copy's fastest GB/s in symcomm-bench's run
    link_refusal: Optional[str] = None     # why symcomm-bench measured no link copy


def _dotted(version: str) -> str:
    """"2.28.9" out of whatever symcomm-bench recorded ("2.28.9", or with a suffix)."""
    m = re.match(r"\d+\.\d+\.\d+", version)
    return m.group(0) if m else version


def _least(values: Iterable[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None and not math.isnan(v)]
    return min(present) if present else None


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return num / den if num is not None and den else None


def _label(mode: str) -> str:
    return f"nccl-tests -{mode[0]} {mode[1]}"  # "R0" -> "nccl-tests -R 0", its own flag


def _unfinished(mode: str, run: Optional[NcclRun]) -> list[str]:
    if run is None:
        return [f"{_label(mode)}: no output"]
    if not run.rows:
        return [f"{_label(mode)}: no rows (did it start?)"]
    if run.footer_wrong is None:
        return [f"{_label(mode)}: no footer, the run did not finish"]
    return []


def _mismatches(mode: str, run: NcclRun, sym: SymcommRun) -> list[str]:
    """What makes one nccl-tests run's times no yardstick for this symcomm-bench run."""
    problems = []
    if run.world is not None and run.world != sym.world:
        problems.append(f"world differs: {_label(mode)} {run.world}, symcomm {sym.world}")
    if run.library and sym.nccl and run.library != _dotted(sym.nccl):
        problems.append(f"NCCL differs: {_label(mode)} ran {run.library}, symcomm {sym.nccl}")
    types = {r.type_name for r in run.rows.values()}
    if types and types != {sym.dtype}:
        problems.append(f"datatype differs: {_label(mode)} {'/'.join(sorted(types))}, symcomm {sym.dtype}")
    return problems


def compare_op(op: str, nccl: dict[str, Optional[NcclRun]], sym: Optional[SymcommRun]) -> OpResult:
    """One op's rows, sizes matched on bytes, plus what keeps the numbers from being comparable."""
    problems: list[str] = []
    sources: dict[str, str] = {}
    wrong: dict[str, Optional[int]] = {}
    for mode in MODES:
        run = nccl.get(mode)
        problems += _unfinished(mode, run)
        wrong[mode] = run.wrong if run is not None and run.rows else None
        if run is not None:
            sources[f"nccl_tests_{mode}"] = run.version or "version line missing"
    wrong["symcomm"] = None if sym is None else sym.wrong
    if sym is None:
        problems.append("symcomm-bench: no JSON")
    else:
        sources["symcomm"] = f"symcomm-bench {sym.op}, torch {sym.torch}, nccl {sym.nccl}, {sym.date}"
        if sym.op != op:
            problems.append(f"symcomm-bench JSON is for {sym.op}, not {op}")
        for mode in MODES:
            if (run := nccl.get(mode)) is not None:
                problems += _mismatches(mode, run, sym)

    symm_paths = [p for p in sym.paths if is_symm_mem(p)] if sym else []
    link = (sym.link if sym else None) or {}
    peak, factor = link.get("peak_gbs"), link.get("factor")
    sizes = sorted({*(sym.times if sym else {}), *(n for run in nccl.values() if run for n in run.rows)})
    rows = []
    for nbytes in sizes:
        by_path = sym.times.get(nbytes, {}) if sym else {}
        ours = {p: t for p, t in by_path.items() if is_symcomm_path(p) and t is not None}
        best = min(ours, key=ours.__getitem__) if ours else None
        tested = {}
        for mode in MODES:
            run = nccl.get(mode)
            row = run.rows.get(nbytes) if run else None
            tested[mode] = row.out_of_place.time_us if row else None
        auto = by_path.get("auto")
        # wire bytes / auto's time, as a share of the fastest copy of wire bytes in the same run
        of_peak = nbytes * factor / (auto * 1e3) / peak if peak and factor and auto else None
        rows.append(Row(nbytes, tested, auto, best, ours.get(best) if best else None,
                        {p: by_path.get(p) for p in symm_paths}, of_peak))
    worlds = [sym.world] if sym else [run.world for run in nccl.values() if run and run.world]
    return OpResult(op, rows, symm_paths, wrong, problems, sources, worlds[0] if worlds else None,
                    peak, link.get("refusal"))


# -- output --------------------------------------------------------------------------------

def human_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def fmt_time(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def fmt_ratio(value: Optional[float]) -> str:
    """Above 1.0, auto is slower than the yardstick: bold and '!' so it cannot be missed."""
    if value is None:
        return "-"
    return f"**{value:.2f}!**" if value > 1.0 else f"{value:.2f}"


def markdown(result: OpResult) -> list[str]:
    symm = result.symm_mem_paths
    head = ["size", "nccl-tests R0", "nccl-tests R2", "symcomm auto", "symcomm best path",
            *(f"{p}" for p in symm), "auto / best(nccl-tests)",
            "auto / best(nccl-tests, symm_mem)" if symm else "auto / best(nccl-tests, symm_mem: none ran)",
            *(["auto of link peak"] if result.link_peak_gbs else [])]
    lines = [f"### {result.op}" + (f", world {result.world}" if result.world else ""), "",
             "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for row in result.rows:
        best = "-" if row.best_path is None else f"{fmt_time(row.best_path_us)} ({row.best_path})"
        cells = [human_size(row.nbytes), fmt_time(row.nccl_tests["R0"]), fmt_time(row.nccl_tests["R2"]),
                 fmt_time(row.auto), best, *(fmt_time(row.symm_mem[p]) for p in symm),
                 fmt_ratio(row.auto_vs_nccl_tests), fmt_ratio(row.auto_vs_best)]
        if result.link_peak_gbs:
            cells.append("-" if row.of_link_peak is None else f"{row.of_link_peak:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    slower = [r for r in result.rows if (r.auto_vs_best or 0) > 1.0]
    judged = [r for r in result.rows if r.auto_vs_best is not None]
    lines.append("")
    if judged:
        worst = max(judged, key=lambda r: r.auto_vs_best or 0)
        lines.append(f"auto slower than the best yardstick at {len(slower)} of {len(judged)} sizes; "
                     f"worst {worst.auto_vs_best:.2f} at {human_size(worst.nbytes)}.")
    wrong = ", ".join(f"{WRONG_LABELS[k]} {'-' if v is None else v}" for k, v in result.wrong.items())
    lines.append(f"#wrong: {wrong}.")
    if result.link_peak_gbs:
        lines.append(f"Link: a copy-engine copy of the wire bytes from the other GPU peaked at "
                     f"{result.link_peak_gbs:.1f} GB/s; 'auto of link peak' = auto's wire bytes per second / that.")
    elif result.link_refusal:
        lines.append(f"Link: not measured: {result.link_refusal}.")
    lines += [f"PROBLEM: {p}" for p in result.problems]
    lines.append("")
    return lines


def report_json(results: Sequence[OpResult]) -> dict:
    ops = {}
    for result in results:
        ops[result.op] = {
            "rows": [{"bytes": r.nbytes,
                      **{f"nccl_tests_{m}_us": r.nccl_tests[m] for m in MODES},
                      "auto_us": r.auto, "best_path": r.best_path, "best_path_us": r.best_path_us,
                      "symm_mem_us": r.symm_mem,
                      "auto_vs_nccl_tests": r.auto_vs_nccl_tests, "auto_vs_best": r.auto_vs_best,
                      "auto_of_link_peak": r.of_link_peak}
                     for r in result.rows],
            "link_peak_gbs": result.link_peak_gbs, "link_refusal": result.link_refusal,
            "world": result.world, "wrong": result.wrong, "problems": result.problems,
            "sources": result.sources,
        }
    return {"schema": SCHEMA, "ops": ops}


# -- files ---------------------------------------------------------------------------------

def read_nccl(path: Path) -> Optional[NcclRun]:
    return parse_nccl_tests(path.read_text(errors="replace")) if path.is_file() else None


def read_symcomm(path: Path) -> Optional[SymcommRun]:
    if not path.is_file():
        return None
    try:
        return load_symcomm(json.loads(path.read_text()))
    except (ValueError, KeyError) as exc:  # a run killed while writing leaves half a file
        print(f"{path}: unreadable ({exc})", file=sys.stderr)
        return None


def ops_in(folder: Path) -> list[str]:
    """Every op that has any of its three files in ``folder``, in the usual order first."""
    found = {p.name.split("_nccl_tests_")[0] for p in folder.glob("*_nccl_tests_R*.txt")}
    found |= {p.name[: -len("_symcomm.json")] for p in folder.glob("*_symcomm.json")}
    usual = ["all_reduce", "all_gather", "reduce_scatter"]
    return [op for op in usual if op in found] + sorted(found - set(usual))


def compare_folder(folder: Path, ops: Optional[Sequence[str]] = None) -> list[OpResult]:
    results = []
    for op in ops or ops_in(folder):
        nccl = {mode: read_nccl(folder / f"{op}_nccl_tests_{mode}.txt") for mode in MODES}
        results.append(compare_op(op, nccl, read_symcomm(folder / f"{op}_symcomm.json")))
    return results


def exit_status(results: Sequence[OpResult]) -> int:
    if any(v for r in results for v in r.wrong.values()):
        return 1
    return 2 if not results or any(r.problems for r in results) else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="where OP_nccl_tests_R0.txt, ..._R2.txt and OP_symcomm.json are")
    parser.add_argument("--ops", nargs="+", help="ops to compare (default: every op with a file in the folder)")
    parser.add_argument("--md", type=Path, help="also write the tables here")
    parser.add_argument("--json", type=Path, help="write the numbers and ratios here")
    args = parser.parse_args(argv)

    results = compare_folder(args.folder, args.ops)
    lines = ["Out-of-place times in us. R0: nccl-tests, plain buffers; R2: nccl-tests, symmetric windows; "
             "ratios are symcomm auto's time / the best yardstick's, above 1.00 (auto slower) in bold with '!'.",
             ""]
    for result in results:
        lines += markdown(result)
    if not results:
        lines.append(f"PROBLEM: no inputs in {args.folder}")
    text = "\n".join(lines)
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(report_json(results), indent=1) + "\n")
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
