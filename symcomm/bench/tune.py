"""``symcomm-bench tune``: measure every path of each op over a size sweep and write the dispatch
table that Communicator loads (symcomm.dispatch.load_table reads it back).

Each size ranks the paths by measured time; the winner goes first and the rest follow in
measured order, so a path that declines a call at dispatch time falls through to the next best.
Paths that could not serve the size (refused) follow the measured ones; a path that returned
wrong results at a size is left out there, so auto never picks it. Adjacent sizes with the same
ranking merge into one rule whose bound is the largest size measured in it; the last rule has
no bound.

One exception to "refused follows measured". At the first size a path refuses after right
results at the two sizes below (unless it is the last size swept, whose rule has no bound), the
path is ranked by an estimate: the line through its two last times, extended to the size, and
never below its last time. The rule ending at that size also covers the sizes between it and the
one below, where the path may still serve some calls (an uneven gather whose largest chunk still
fits the flag-free receive slot, or any call under a capacity that lies between the two sizes).
Where it serves none of those calls (an even op whose capacity is the size below) it declines
each, and the next path of the rule serves: one more question per call, the same choice.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from datetime import datetime, timezone
from typing import Iterable, Sequence

from .. import __version__
from ..dispatch import TUNING_VERSION, device_name
from . import ops, report
from .config import TUNE_OPS, BenchError, TuneConfig
from .runner import Runner, progress_mode, sweep

# Recorded column -> (op measured, in-place column?). The file keeps both columns of the even ops
# as a record, but a call takes its op's row whether in place or not (symcomm/dispatch.py says
# why), and the row ranks by the out-of-place column: the common call (serving and training code
# all-reduce into a new tensor). What in-place calls give up, from the world-2 table's own
# columns (2026-11-30): one-shot stages an in-place input, so at 4 MiB in-place one-shot takes
# 22.4 us where two-shot takes 20.9, while out of place one-shot leads two-shot (20.1 against 20.9).
KEYS: dict[str, tuple[str, bool]] = {
    "all_reduce": ("all_reduce", False),
    "all_reduce:inplace": ("all_reduce", True),
    "all_gather": ("all_gather", False),
    "all_gather:inplace": ("all_gather", True),
    "reduce_scatter": ("reduce_scatter", False),
    "reduce_scatter:inplace": ("reduce_scatter", True),
    "all_gatherv": ("all_gatherv", False),
    "reduce_scatterv": ("reduce_scatterv", False),
}

Times = dict[str, list[float | None]]  # path -> time in us per size; None where refused or wrong


def ranking(at: dict[str, float | None], wrong: set[str], paths: Sequence[str]) -> list[str]:
    """The preference list at one size: measured paths fastest first (ties keep ``paths``'
    order), then those that refused in ``paths``' order; wrong paths are left out."""
    measured = [p for p in paths if at.get(p) is not None and p not in wrong]
    measured.sort(key=lambda p: at[p])  # stable: ties keep the communicator's order
    refused = [p for p in paths if at.get(p) is None and p not in wrong]
    return measured + refused


def estimated(sizes: Sequence[int], times: Sequence[float | None], i: int,
              wrong_at: Sequence[bool]) -> float | None:
    """A refused path's stand-in time at ``sizes[i]`` (see the module's docstring), or None
    where it was measured here, has no two right results right below, or ``i`` is the last
    size. ``wrong_at[j]``: the path returned wrong results at ``sizes[j]``."""
    def right(j: int) -> bool:
        return times[j] is not None and not wrong_at[j]

    if i < 2 or i == len(sizes) - 1 or times[i] is not None or not (right(i - 1) and right(i - 2)):
        return None
    slope = (times[i - 1] - times[i - 2]) / (sizes[i - 1] - sizes[i - 2])
    return max(times[i - 1], times[i - 1] + slope * (sizes[i] - sizes[i - 1]))


def merge(sizes: Sequence[int], prefs: Sequence[list[str]]) -> list[list]:
    """[[max_bytes, paths], ..., [None, paths]]: runs of equal preference become one rule."""
    if not sizes or len(sizes) != len(prefs):
        raise ValueError("one preference per size, at least one size")
    rules: list[list] = []
    for size, pref in zip(sizes, prefs):
        if rules and rules[-1][1] == pref:
            rules[-1][0] = size
        else:
            rules.append([size, list(pref)])
    rules[-1][0] = None
    return rules


def table_rules(sizes: Sequence[int], times: dict[str, Times], wrong: dict[str, dict[str, list[int]]],
                paths: Sequence[str]) -> dict[str, list[list]]:
    """op -> merged rules, from the out-of-place column's per-path times (see KEYS). A path
    wrong in place is left out of the op's row too: it would serve in-place calls. Raises
    ValueError where every path was wrong at some size: no table could serve it."""
    rules = {}
    for key, per_path in times.items():
        op, inplace = KEYS[key]
        if inplace:
            continue
        columns = [k for k in times if KEYS[k][0] == op]
        bad = [{p for k in columns for p, counts in wrong.get(k, {}).items() if counts[i]} for i in range(len(sizes))]
        prefs = []
        for i in range(len(sizes)):
            at = {p: t[i] if t[i] is not None else estimated(sizes, t, i, [p in b for b in bad])
                  for p, t in per_path.items()}
            prefs.append(ranking(at, bad[i], paths))
            if not prefs[-1]:
                raise ValueError(f"every path returned wrong results for {op} at {sizes[i]} bytes")
        rules[op] = merge(sizes, prefs)
    return rules


def split_rows(rows: Iterable[report.SizeRow], sizes: Sequence[int], op: str,
               measured: Sequence[str]) -> tuple[dict[str, Times], dict[str, dict[str, list[int]]]]:
    """Rank-averaged rows of one op -> (times, wrong) for each of its recorded columns (KEYS)."""
    index = {(r.algo, r.nbytes): r for r in rows}
    times: dict[str, Times] = {}
    wrong: dict[str, dict[str, list[int]]] = {}
    for key, (key_op, inplace) in KEYS.items():
        if key_op != op:
            continue
        times[key], wrong[key] = {}, {}
        for path in measured:
            cells = [index.get((path, n)) for n in sizes]
            timings = [None if c is None else (c.in_place if inplace else c.out_of_place) for c in cells]
            times[key][path] = [None if t is None or math.isnan(t.time_us) else round(t.time_us, 3)
                                for t in timings]
            wrong[key][path] = [0 if t is None else (t.wrong or 0) for t in timings]
    return times, wrong


def default_output(gpu: str, world: int) -> str:
    """"NVIDIA H200", 4 -> "nvidia_h200_w4.json": the name a packaged table has."""
    slug = re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_") or "device"
    return f"{slug}_w{world}.json"


def payload(cfg: TuneConfig, info: report.RunInfo, gpu: str, rules: dict[str, list[list]],
            times: dict[str, Times], wrong: dict[str, dict[str, list[int]]], date: str) -> dict:
    return {
        "version": TUNING_VERSION,
        "gpu": gpu,
        "world_size": info.world,
        "nccl": info.nccl_version,
        "torch": info.torch_version,
        "symcomm": __version__,
        "date": date,
        "command": cfg.command,
        "dtype": info.type_name,
        "timing": {"iters": cfg.iters, "warmup_iters": cfg.warmup, "graph_replays": info.graph,
                   "rounds": cfg.rounds},
        "rules": rules,
        "sizes": list(cfg.sizes),
        "times_us": times,
        "wrong": wrong if cfg.check else None,
    }


def dumps(obj: object, indent: int = 0) -> str:
    """JSON with objects spread one key a line and lists kept on one line, so that each rule
    and each path's times read as a row."""
    if not isinstance(obj, dict) or not obj:
        return json.dumps(obj)
    pad = " " * (indent + 1)
    items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in obj.items()]
    return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"


def describe(rules: dict[str, list[list]]) -> list[str]:
    """The rules as comment lines: '# all_reduce: <= 32768 B: nccl-symm > nccl | ...'."""
    lines = []
    for key, steps in rules.items():
        parts = [f"{'<= %d B' % bound if bound is not None else 'above'}: {' > '.join(paths)}"
                 for bound, paths in steps]
        lines.append(f"# {key}: " + " | ".join(parts))
    return lines


def run(cfg: TuneConfig, comm) -> int:
    """Measures, prints one nccl-tests block per op and path, writes the table (rank 0).
    Returns 1 if some path returned wrong results (it is left out where it did), else 0."""
    runner = Runner(cfg, comm, TUNE_OPS)
    if not runner.algos:
        raise BenchError("tune: this communicator has no path to measure")
    base = runner.run_info()
    gpu = device_name(runner.device)
    emit = report.Emitter(runner.rank == 0)
    emit(report.header_lines(dataclasses.replace(base, op="tune")))

    times: dict[str, Times] = {}
    wrong: dict[str, dict[str, list[int]]] = {}
    status = 0
    total = len(TUNE_OPS) * len(cfg.sizes) * len(runner.algos) * cfg.rounds
    with report.Progress(total, progress_mode(emit.lead, False)) as progress:
        for op in TUNE_OPS:
            labels = ops.spec(op).labels(cfg.type_name, cfg.redop)
            info = dataclasses.replace(base, op=op, **labels._asdict())
            emit([f"# Collective test starting: {report.test_name(op)}", "#"])
            runner.refused.clear()  # each op's blocks name its own refusals, not an earlier op's
            rows = sweep(runner, op, progress)
            report.emit_blocks(emit, info, rows, runner.algos, runner.refused)
            emit.summary(rows, runner.algos)
            op_times, op_wrong = split_rows(rows, cfg.sizes, op, runner.algos)
            times.update(op_times)
            wrong.update(op_wrong)
            status |= 1 if report.total_wrong(rows) else 0

    # Paths tune did not measure (torch on CUDA) stay at the end of every list as the last resort.
    paths = [*runner.algos, *(a for a in comm.algorithms() if a not in runner.algos)]
    try:
        rules = table_rules(cfg.sizes, times, wrong, paths)
    except ValueError as exc:
        raise BenchError(f"tune: {exc}; no table written") from None
    if emit.lead:
        output = cfg.output or default_output(gpu, base.world)
        date = datetime.now(timezone.utc).isoformat(timespec="seconds")
        try:
            with open(output, "w", encoding="utf-8") as fh:
                fh.write(dumps(payload(cfg, base, gpu, rules, times, wrong, date)) + "\n")
        except OSError as exc:
            raise BenchError(f"tune: cannot write {output}: {exc.strerror or exc}") from None
        emit(["# Tuning table (preference per size, fastest first):", *describe(rules),
              f"# Wrote {output}: use it with SYMCOMM_TUNING_FILE={output}, or ship it in symcomm/tuning/",
              *(["# Some paths returned wrong results: they are left out where they did (see #wrong)"]
                if status else [])])
    return status
