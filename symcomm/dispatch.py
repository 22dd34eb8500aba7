"""Which path serves a call: a table from (op, message size) to an ordered list of paths.

The first path in the list that can serve the call wins, so the table states preferences and
each backend's ``why_not`` states ability. A forced ``algo=`` skips the table. Thresholds
are upper bounds in bytes (inclusive), in nccl-tests' byte convention (see Call.nbytes).

Where the numbers come from: bench/results/ (graph-replay timing, 2x and 4x H200, NVLS off);
docs/measuring.md has the NCCL-only picture that motivated the shape: symmetric kernels halve
latency up to ~64 KiB and lose 25-35% from 16 MiB up.

Rows are keyed by the op alone. The choice may depend only on what every rank of a correct
program agrees on (op, dtype, sizes, reduction; the pool rule of docs/guide.md), never on a
fact of this rank alone such as whether its call is in place: NCCL lets one rank call in place
while another does not, and two ranks on different paths wait for each other until the
timeout (on NCCL's communicators, for ever).

A measured table (``symcomm-bench tune``) replaces the built-in one: see load_table for the
order in which tables are looked for, and check_tuning for the file format.
"""
from __future__ import annotations

import bisect
import json
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from typing import TYPE_CHECKING

from . import settings
from .base import FLAGFREE, OPS, Call
from .base import Path as CommPath
from .errors import ArgumentError

if TYPE_CHECKING:
    from .operations.base import Operation

SYMM_FIRST = ("nccl-symm", "nccl", "torch")
PLAIN_FIRST = ("nccl", "nccl-symm", "torch")
# symcomm's all-reduce kernels, each followed by the others: a kernel that declines a call
# (odd size, over capacity) hands it to the next, and NCCL comes last.
FLAGFREE_FIRST = ("custom-flagfree", "custom-oneshot", "custom-twoshot")
ONESHOT_FIRST = ("custom-oneshot", "custom-twoshot", "custom-flagfree")
# custom-flagfree also serves all_gather(v) and reduce_scatter(v) (each rank's chunk up to its
# receive slot), at world 2 only (backends/custom_ar.py, FLAGFREE_COLLECTIVE_WORLDS): the world-2
# rows name it to 1 MiB, where it was measured on 2x H200 (the v-ops take those rows through
# _ALIASES), and no world-4 row names it.
TWOSHOT_FIRST = ("custom-twoshot", "custom-oneshot")
INF = float("inf")
PLAIN_ROW = ([INF], [PLAIN_FIRST])  # a key with no rules: plain NCCL first

# world size -> op -> [(max nbytes, preference)]. World sizes not listed use the nearest
# smaller one that is.
_KiB, _MiB = 1 << 10, 1 << 20
BUILTIN: dict[int, dict[str, list[tuple[float, tuple[str, ...]]]]] = {
    # bench/results/2026-11-22_4xH200_nccl2.28.9: the faster of nccl and nccl-symm per
    # power-of-two size, bf16, CUDA-graph replay, out-of-place.
    2: {
        # Custom kernels: extrapolated from world 4 until `symcomm-bench tune -g 2` replaces them.
        "all_reduce": [(32 * _KiB, FLAGFREE_FIRST + SYMM_FIRST), (512 * _KiB, FLAGFREE_FIRST + PLAIN_FIRST), (1 * _MiB, TWOSHOT_FIRST + PLAIN_FIRST),
                       (4 * _MiB, TWOSHOT_FIRST + SYMM_FIRST), (8 * _MiB, TWOSHOT_FIRST + PLAIN_FIRST), (INF, PLAIN_FIRST)],
        # Flag-free to 1 MiB (bench/results/2026-11-28_nvidia-h200-x4_w2_baseline): 0.64-0.77x
        # nccl-tests' faster mode for all_gather, 0.58-1.01x for reduce_scatter, 2x faster than
        # symcomm's NCCL paths.
        # Behind it, where it declines (odd sizes, chunks over its receive slot), the 2026-11-22
        # NCCL order.
        "all_gather": [(128 * _KiB, (FLAGFREE,) + SYMM_FIRST), (512 * _KiB, (FLAGFREE,) + PLAIN_FIRST),
                       (1 * _MiB, (FLAGFREE,) + SYMM_FIRST), (16 * _MiB, SYMM_FIRST), (INF, PLAIN_FIRST)],
        "reduce_scatter": [(64 * _KiB, (FLAGFREE,) + SYMM_FIRST), (1 * _MiB, (FLAGFREE,) + PLAIN_FIRST),
                           (4 * _MiB, SYMM_FIRST), (INF, PLAIN_FIRST)],
    },
    4: {
        # Custom kernels (2026-11-22 sweep, bf16, graph replay): flag-free fastest to 512 KiB
        # (5.5 us at 64 KiB vs 15.0 for NCCL), two-shot from 1 MiB to 4 MiB (39 vs 42 us).
        "all_reduce": [(64 * _KiB, FLAGFREE_FIRST + SYMM_FIRST), (512 * _KiB, FLAGFREE_FIRST + PLAIN_FIRST), (1 * _MiB, TWOSHOT_FIRST + PLAIN_FIRST),
                       (8 * _MiB, TWOSHOT_FIRST + SYMM_FIRST), (INF, PLAIN_FIRST)],
        "all_gather": [(INF, SYMM_FIRST)],
        "reduce_scatter": [(128 * _KiB, SYMM_FIRST), (512 * _KiB, PLAIN_FIRST), (8 * _MiB, SYMM_FIRST), (INF, PLAIN_FIRST)],
    },
}
# Rows a table may leave out, and the row that stands in: the v-variants with equal sizes
# are the plain collectives (with unequal sizes the symmetric backend declines by itself).
_ALIASES = {"all_gatherv": "all_gather", "reduce_scatterv": "reduce_scatter"}
# Rows of tables written before in-place calls lost their own rows (see the module's docstring),
# refused by DispatchTable and by check_tuning alike, with this reason.
RETIRED_KEYS = ("all_reduce:inplace", "all_gather:inplace", "reduce_scatter:inplace")
RETIRED_REASON = ("is retired: in-place calls take the op's own row, so that ranks that differ only in "
                  "calling in place take one path; delete the row, or run `symcomm-bench tune` again")


@dataclass(frozen=True)
class Choice:
    """The path a call takes, and why each path ahead of it in the table was passed over."""

    algo: str
    rejected: dict[str, str]


class DispatchTable:
    """Preferences for one world size."""

    def __init__(self, rules: dict[str, list[tuple[float, tuple[str, ...]]]], source: str) -> None:
        self.source = source
        # key -> (ascending inclusive bounds, preference per bound); bisected per call.
        self.rows: dict[str, tuple[list[float], list[tuple[str, ...]]]] = {}
        for key, steps in rules.items():
            if key in RETIRED_KEYS:
                raise ValueError(f"rule key {key!r} {RETIRED_REASON}")
            bounds = [b for b, _ in steps]
            if bounds != sorted(bounds) or bounds[-1] != INF:
                raise ValueError(f"tuning rules for {key} must ascend and end at infinity")
            self.rows[key] = (bounds, [p for _, p in steps])
        for alias, key in _ALIASES.items():
            if alias not in self.rows and key in self.rows:
                self.rows[alias] = self.rows[key]

    def preference(self, key: str, nbytes: int) -> tuple[str, ...]:
        bounds, prefs = self.rows.get(key, PLAIN_ROW)
        return prefs[bisect.bisect_left(bounds, nbytes)]

    def digest(self) -> int:
        """A 31-bit checksum of the rows: the Communicator's first vote compares it, since a
        table is read per rank (a tuning file, the GPU's name) and ranks with different tables
        would take different paths for one call."""
        text = repr(sorted((key, bounds, prefs) for key, (bounds, prefs) in self.rows.items()))
        return zlib.crc32(text.encode()) & 0x7FFFFFFF


def named_path(paths: dict[str, CommPath], off: dict[str, str], algo: str) -> CommPath:
    """The open path ``algo`` names; ArgumentError if it names one that is off, or none."""
    path = paths.get(algo)
    if path is None:
        if algo in off:
            raise ArgumentError(f"algo={algo!r} is unavailable: {off[algo]}")
        raise ArgumentError(f"algo must be 'auto' or one of {', '.join(paths)}, got {algo!r}")
    return path


def choose(table: DispatchTable, paths: dict[str, CommPath], off: dict[str, str], call: Call,
           algo: str = "auto", explain: bool = False, operation: Operation | None = None,
           asked: str | None = None) -> tuple[CommPath | None, Choice | None]:
    """The one place a path is chosen: every operation's launch, Communicator.select() and the
    benchmark's ``auto`` all come through here.

    ``paths`` are the operation's open paths by name, ``off`` the others with the reason they are
    off. ``algo="auto"`` takes the first path of the operation's order (its table row) that can
    serve the call; a path name forces that path (the operation resolved what ``algo=`` named
    before, from what the caller ``asked``). Returns (path, None), or with ``explain`` (path,
    Choice) where the Choice names every other path and why it was passed over. Raises
    ArgumentError when nothing can serve the call, before any communication.
    """
    if algo == "auto":
        preference = (operation.order(table, call) if operation is not None
                      else table.preference(call.op, call.nbytes))
        if not explain:
            for name in preference:
                path = paths.get(name)
                if path is not None and path.why_not(call) is None:
                    return path, None
        chosen: CommPath | None = None
        rejected: dict[str, str] = {}
        ranking = (operation.ranking(table, call) if operation is not None
                   else f"at {call.nbytes} bytes by the {table.source} table")
        for name in (*preference, *(n for n in (*paths, *off) if n not in preference)):
            path = paths.get(name)
            reason = off.get(name, "not opened") if path is None else path.why_not(call)
            if reason is None and chosen is None and name in preference:
                chosen = path
            elif name not in rejected and (chosen is None or name != chosen.name):
                rejected[name] = reason or (f"not in the {table.source} table's row for {call.op}"
                                            if name not in preference else f"ranked below {chosen.name} {ranking}")
        if chosen is None:
            raise ArgumentError(no_path(call.op, rejected, paths))
        return chosen, Choice(chosen.name, rejected)
    path = named_path(paths, off, algo)
    reason = path.why_not(call)
    if reason is not None:
        raise ArgumentError(f"algo={algo!r} cannot serve this {call.op}: {reason}")
    if not explain:
        return path, None
    why = (f"not requested (algo={algo!r})" if asked in (None, algo) else
           f"algo={asked!r} forces {algo} (with that path inside it)")
    return path, Choice(algo, {n: why for n in (*paths, *off) if n != algo})


def no_path(op: str, rejected: dict[str, str], paths: dict[str, CommPath]) -> str:
    """Why nothing can serve a call: the open paths' reasons, which are about the call, first;
    the paths that are off on this communicator only by name (their reasons are about the
    communicator, the same for every call: on the CPU seven paths would say "needs NCCL")."""
    about_call = {n: r for n, r in rejected.items() if n in paths}
    off = [n for n in rejected if n not in paths]
    if not about_call:
        return f"no path can serve this {op}: " + "; ".join(f"{n}: {r}" for n, r in rejected.items())
    return (f"no path can serve this {op}: " + "; ".join(f"{n}: {r}" for n, r in about_call.items())
            + (f" (off on this communicator: {', '.join(off)}; capabilities() says why)" if off else ""))


class Router:
    """One communicator's dispatch: its table and, per operation, its paths (the open ones by
    name, the others with their reason, and all of them in open order: check mode's codes). It
    is the Dispatcher composite paths and operations' resolve() ask (operations/base.py)."""

    def __init__(self, table: DispatchTable, operations: dict[str, Operation], rank: int) -> None:
        self.table = table
        self.operations = operations
        self.rank = rank
        self._paths: dict[str, dict[str, CommPath]] = {op: {} for op in operations}
        self._off: dict[str, dict[str, str]] = {op: {} for op in operations}
        self._names: dict[str, list[str]] = {op: [] for op in operations}

    def add(self, path: CommPath, reason: str | None) -> None:
        """List ``path`` (open when ``reason`` is None) under every operation it serves."""
        for op in path.ops & self.operations.keys():
            self._names[op].append(path.name)
            if reason is None:
                self._paths[op][path.name] = path
            else:
                self._off[op][path.name] = reason

    def clear(self) -> None:
        for paths in self._paths.values():
            paths.clear()

    def paths_of(self, op: str) -> dict[str, CommPath]:
        return self._paths[op]

    def off_of(self, op: str) -> dict[str, str]:
        return self._off[op]

    def names_of(self, op: str) -> list[str]:
        return self._names[op]

    def choose(self, operation: Operation, call: Call, algo: str = "auto",
               explain: bool = False) -> tuple[CommPath | None, Choice | None]:
        """choose() for a call of ``operation``, after the operation resolved what ``algo`` names."""
        asked = algo
        if algo != "auto":
            algo = operation.resolve(call, algo, self)
        name = operation.name
        return choose(self.table, self._paths[name], self._off[name], call, algo, explain, operation, asked)

    def check_algo(self, operation: Operation, call: Call, algo: object) -> None:
        """What ``algo`` names is a path of ``operation`` that is open, without asking whether it
        can serve ``call``: for a call that runs later in another form (methods.py's _recorded)."""
        if algo != "auto":
            algo = operation.resolve(call, algo, self)
        if algo != "auto":
            named_path(self._paths[operation.name], self._off[operation.name], algo)

    def choose_inner(self, call: Call, algo: str) -> CommPath:
        """The path for ``call``, already validated by the composite operation that makes it: no
        second validation, no check-mode exchange (the composite's own check covers it)."""
        return self.choose(self.operations[call.op], call, algo)[0]

    def run_inner(self, call: Call, algo: str) -> None:
        """Choose as choose_inner does and run; a call that is empty, of an operation that skips
        empty calls, goes to the path's skip() instead (the rule Communicator applies to a direct
        call)."""
        operation = self.operations[call.op]
        path = self.choose(operation, call, algo)[0]
        if call.nbytes or not operation.skips_empty:
            path.run(call)
        else:
            path.skip(call)

    def explain_inner(self, call: Call, algo: str) -> Choice:
        return self.choose(self.operations[call.op], call, algo, explain=True)[1]


def builtin_table(world_size: int) -> DispatchTable:
    known = [w for w in BUILTIN if w <= world_size]
    world = max(known) if known else min(BUILTIN)
    return DispatchTable(BUILTIN[world], source=f"builtin (measured at world {world})")


# ----------------------------------------------------------------------------- tuning files
TUNING_ENV = "SYMCOMM_TUNING_FILE"
TUNING_VERSION = 1
PACKAGED_DIR = Path(__file__).resolve().parent / "tuning"
# The rows a table may hold: the collectives'; a Communicator accepts a row named after any of
# its operations too.
TABLE_KEYS = OPS
_PATH_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


@dataclass(frozen=True)
class TuningFile:
    """A checked tuning file: where it was measured, and its rules in DispatchTable's form."""

    gpu: str
    world_size: int
    rules: dict[str, list[tuple[float, tuple[str, ...]]]]


def device_name(device: torch.device) -> str:
    """The name a tuning file is matched on: the CUDA device's name, or "cpu"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def check_tuning(payload: Any, keys: Sequence[str] = TABLE_KEYS) -> TuningFile:
    """Validates a tuning file's JSON and converts its rules; raises ValueError saying what is
    wrong. Only the fields dispatch needs are required: the rest (versions, date, command,
    raw times) is a record for people."""
    if not isinstance(payload, dict):
        raise ValueError("the top level must be a JSON object")
    if payload.get("version") != TUNING_VERSION:
        raise ValueError(f"version must be {TUNING_VERSION}, got {payload.get('version')!r}")
    gpu, world = payload.get("gpu"), payload.get("world_size")
    if not isinstance(gpu, str) or not gpu:
        raise ValueError("gpu must be a non-empty string")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world_size must be a positive integer, got {world!r}")
    rules = payload.get("rules")
    if not isinstance(rules, dict) or not rules:
        raise ValueError("rules must be a non-empty object")
    return TuningFile(gpu, world, {key: _check_steps(key, steps, keys) for key, steps in rules.items()})


def _check_steps(key: str, steps: Any, keys: Sequence[str]) -> list[tuple[float, tuple[str, ...]]]:
    if key in RETIRED_KEYS:
        raise ValueError(f"rule key {key!r} {RETIRED_REASON}")
    if key not in keys:
        raise ValueError(f"unknown rule key {key!r} (known: {', '.join(keys)})")
    if not isinstance(steps, list) or not steps:
        raise ValueError(f"rules[{key!r}] must be a non-empty list of [max_bytes, [paths]]")
    out: list[tuple[float, tuple[str, ...]]] = []
    last = 0
    for i, step in enumerate(steps):
        where = f"rules[{key!r}][{i}]"
        if not isinstance(step, list) or len(step) != 2:
            raise ValueError(f"{where} must be [max_bytes, [paths]]")
        bound, paths = step
        final = i == len(steps) - 1
        if bound is None:
            if not final:
                raise ValueError(f"{where}: only the last rule may have no upper bound (null)")
        elif final:
            raise ValueError(f"{where}: the last rule must have no upper bound (null), got {bound!r}")
        elif not isinstance(bound, int) or isinstance(bound, bool) or bound <= last:
            raise ValueError(f"{where}: bounds must be integers in strictly ascending order, "
                             f"got {bound!r} after {last}")
        if (not isinstance(paths, list) or not paths
                or not all(isinstance(p, str) and _PATH_NAME.match(p) for p in paths)):
            raise ValueError(f"{where}: paths must be a non-empty list of path names, got {paths!r}")
        if len(set(paths)) != len(paths):
            raise ValueError(f"{where}: a path is listed twice in {paths!r}")
        out.append((INF if bound is None else bound, tuple(paths)))
        last = bound if bound is not None else last
    return out


def read_tuning(path: str | Path, keys: Sequence[str] = TABLE_KEYS) -> TuningFile:
    """Reads and checks one tuning file; ArgumentError names the file and the problem."""
    try:
        with open(path, encoding="utf-8") as fh:
            payload = json.load(fh)
        return check_tuning(payload, keys)
    except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ArgumentError(f"tuning file {path}: {detail}") from None


def load_table(world_size: int, device: torch.device, env: dict[str, str] | None = None,
               packaged: Path = PACKAGED_DIR, keys: Sequence[str] = TABLE_KEYS) -> DispatchTable:
    """The table a communicator dispatches with. In order: the file named by
    SYMCOMM_TUNING_FILE (which must match this GPU and world size, else ArgumentError); a
    packaged table measured on this GPU at this world size; the built-in table."""
    name = device_name(device)
    path = settings.tuning_file() if env is None else env.get(TUNING_ENV)
    if path:
        tuned = read_tuning(path, keys)
        if tuned.world_size != world_size:
            raise ArgumentError(f"tuning file {path}: measured at world size {tuned.world_size}, "
                                f"but this communicator has {world_size} ranks ({TUNING_ENV})")
        if tuned.gpu != name:
            raise ArgumentError(f"tuning file {path}: measured on {tuned.gpu!r}, but this "
                                f"communicator runs on {name!r} ({TUNING_ENV})")
        return DispatchTable(tuned.rules, source=str(path))
    for candidate in sorted(packaged.glob("*.json")):
        tuned = read_tuning(candidate)  # a broken shipped table is a bug: say so, loudly
        if tuned.world_size == world_size and tuned.gpu == name:
            return DispatchTable(tuned.rules, source=f"packaged {candidate.name}")
    return builtin_table(world_size)
