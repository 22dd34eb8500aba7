"""Which path serves a call: a table from (op, message size) to an ordered list of paths.

The first path in the list that can serve the call wins, so the table states preferences and
each backend's ``why_not`` states ability. A forced ``algo=`` skips the table. Thresholds
are upper bounds in bytes (inclusive), in nccl-tests' byte convention (see Call.nbytes).

Where the numbers come from: bench/results/ (graph-replay timing, 2x and 4x H200, NVLS off);
ANCHORS.md has the NCCL-only picture that motivated the shape: symmetric kernels halve
latency up to ~64 KiB and lose 25-35% from 16 MiB up. Rows are keyed by Call.table_key:
the op, or "all_gather:inplace" where in-place measured differently.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

SYMM = ("nccl-symm", "nccl", "torch")
PLAIN = ("nccl", "nccl-symm", "torch")
INF = float("inf")
PLAIN_ROW = ([INF], [PLAIN])  # a key with no rules: plain NCCL first

# world size -> op -> [(max nbytes, preference)]. World sizes not listed use the nearest
# smaller one that is.
_KiB, _MiB = 1 << 10, 1 << 20
BUILTIN: dict[int, dict[str, list[tuple[float, tuple[str, ...]]]]] = {
    # bench/results/2026-11-21_h200: the faster of nccl and nccl-symm per power-of-two size,
    # bf16, CUDA-graph replay, out-of-place.
    2: {
        "all_reduce": [(32 * _KiB, SYMM), (1 * _MiB, PLAIN), (4 * _MiB, SYMM), (INF, PLAIN)],
        "all_gather": [(128 * _KiB, SYMM), (512 * _KiB, PLAIN), (16 * _MiB, SYMM), (INF, PLAIN)],
        # In place, the symmetric kernel keeps winning up to 128 MiB (220 vs 225 us), unlike
        # out of place (304 vs 234 us).
        "all_gather:inplace": [(128 * _MiB, SYMM), (INF, PLAIN)],
        "reduce_scatter": [(64 * _KiB, SYMM), (1 * _MiB, PLAIN), (4 * _MiB, SYMM), (INF, PLAIN)],
    },
    4: {
        "all_reduce": [(64 * _KiB, SYMM), (1 * _MiB, PLAIN), (8 * _MiB, SYMM), (INF, PLAIN)],
        "all_gather": [(INF, SYMM)],
        # In place (x is this rank's slice of out), NCCL's symmetric all-gather loses from
        # 64 MiB: 181 vs 174 us there, 682 vs 606 us at 256 MiB.
        "all_gather:inplace": [(32 * _MiB, SYMM), (INF, PLAIN)],
        "reduce_scatter": [(128 * _KiB, SYMM), (512 * _KiB, PLAIN), (8 * _MiB, SYMM), (INF, PLAIN)],
    },
}
# Rows a table may leave out, and the row that stands in: the v-variants with equal sizes
# are the plain collectives (with unequal sizes the symmetric backend declines by itself).
_ALIASES = {"all_gatherv": "all_gather", "reduce_scatterv": "reduce_scatter", "all_gather:inplace": "all_gather"}


@dataclass(frozen=True)
class Choice:
    """The path a call takes, and why each path ahead of it in the table was passed over."""

    algo: str
    rejected: dict[str, str]


class DispatchTable:
    """Preferences for one world size."""

    def __init__(self, rules: dict[str, list[tuple[float, tuple[str, ...]]]], source: str) -> None:
        self.source = source
        # key -> (ascending inclusive bounds, preference per bound); read per call by
        # Communicator._choose, which bisects it in place to save a frame.
        self.rows: dict[str, tuple[list[float], list[tuple[str, ...]]]] = {}
        for key, steps in rules.items():
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


def builtin_table(world_size: int) -> DispatchTable:
    known = [w for w in BUILTIN if w <= world_size]
    world = max(known) if known else min(BUILTIN)
    return DispatchTable(BUILTIN[world], source=f"builtin (measured at world {world})")
