"""Message sizes: parsing ``-b/-e`` values, the ``-f`` sweep, and per-rank element layouts.

Byte counts follow nccl-tests: the reported size is the whole output for gathers, the whole
input for reduce-scatters and the tensor for all-reduce, rounded down so that every rank holds
whole elements.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

OPS = ("all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv")
# The NVFP4 gather: quantize + all_gatherv (+ dequantize), compared with an all_gatherv of the
# unquantized rows. Its size column counts the unquantized bytes, so rows line up with all_gatherv.
FP4_OP = "all_gatherv_fp4"
CLI_OPS = (*OPS, FP4_OP)
UNEVEN_OPS = ("all_gatherv", "reduce_scatterv", FP4_OP)
# Token rows of the FP4 gather, in elements: a multiple of NVFP4's 16-element block, small
# enough that 1 KiB of bf16 is one row.
FP4_ROW = 512

# Uneven layouts split the message in rows of this many bytes so every rank's slice starts on
# a 16-byte boundary, as token rows of a hidden dimension would; unaligned slices would only
# measure the fallback paths.
ROW_BYTES = 16

_SUFFIX = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"64"`` -> 64, ``"1K"`` -> 1024, ``"2M"``/``"2MB"``/``"2MiB"`` -> 2 MiB (powers of 1024)."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"invalid size {text!r} (expected an integer with optional K/M/G suffix)")
    return int(match.group(1)) * _SUFFIX[match.group(2).upper()]


def sweep(minbytes: int, maxbytes: int, stepfactor: int) -> list[int]:
    """minbytes, minbytes*f, ... up to and including maxbytes."""
    if minbytes < 1 or maxbytes < minbytes or stepfactor < 2:
        raise ValueError(f"bad sweep {minbytes}..{maxbytes} step {stepfactor}")
    sizes = []
    size = minbytes
    while size <= maxbytes:
        sizes.append(size)
        size *= stepfactor
    return sizes


def uneven_rows(total_rows: int, world: int) -> list[int]:
    """Rank r gets floor(total*(r+1)/T) rows with T = world*(world+1)/2; the last rank also
    takes the remainder. Small totals leave the first ranks with zero rows on purpose, since
    all_gatherv must cope with empty ranks."""
    weight_sum = world * (world + 1) // 2
    rows = [total_rows * (r + 1) // weight_sum for r in range(world)]
    rows[-1] += total_rows - sum(rows)
    return rows


def uneven_rule(world: int, op: str = "all_gatherv") -> str:
    """The uneven split rule as one header line, in the terms uneven_rows() uses."""
    rows = f"{FP4_ROW}-element" if op == FP4_OP else f"{ROW_BYTES}-byte"
    return (f"rank r gets floor(R*(r+1)/{world * (world + 1) // 2}) of the R {rows} rows, "
            f"the last rank the remainder; count = elements over all ranks")


@dataclass(frozen=True)
class Layout:
    """Element counts of one message size for one op.

    ``parts[r]`` is rank r's share of the gathered output / scattered input, in elements;
    ``row`` is the row width in elements for the uneven ops (1 for the even ones).
    """
    op: str
    nbytes: int        # reported size column
    count: int         # reported count column
    in_elems: int      # this rank's input elements
    out_elems: int     # this rank's output elements
    parts: tuple[int, ...]
    row: int = 1

    def offset(self, rank: int) -> int:
        """Element offset of ``rank``'s share inside the full gathered / scattered tensor."""
        return sum(self.parts[:rank])

    @property
    def total(self) -> int:
        return sum(self.parts)


def layout(op: str, nbytes: int, world: int, itemsize: int, rank: int) -> Layout:
    if op not in CLI_OPS:
        raise ValueError(f"unknown op {op!r}")
    count = nbytes // itemsize
    if op == "all_reduce":
        return Layout(op, count * itemsize, count, count, count, (count,) * world)
    if op in ("all_gather", "reduce_scatter"):
        per_rank = count // world
        parts = (per_rank,) * world
        total = per_rank * world
        in_elems, out_elems = (per_rank, total) if op == "all_gather" else (total, per_rank)
        # nccl-tests' count column is the per-rank count for these two ops.
        return Layout(op, total * itemsize, per_rank, in_elems, out_elems, parts)
    row = FP4_ROW if op == FP4_OP else max(1, ROW_BYTES // itemsize)
    rows = uneven_rows(count // row, world)
    parts = tuple(r * row for r in rows)
    total = sum(parts)
    mine = parts[rank]
    in_elems, out_elems = (total, mine) if op == "reduce_scatterv" else (mine, total)
    return Layout(op, total * itemsize, total, in_elems, out_elems, parts, row)
