"""Message sizes: parsing ``-b/-e`` values, the ``-f`` sweep, and how a message splits over ranks.

Which split an op uses, and which side of it is the input, is the op's spec's to say
(collectives.py); this module only knows shapes.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_SUFFIX = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)

# Uneven layouts split the message in rows of this many bytes so every rank's slice starts on
# a 16-byte boundary, as token rows of a hidden dimension would; unaligned slices would only
# measure the fallback paths.
ROW_BYTES = 16


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


@dataclass(frozen=True)
class Layout:
    """Element counts of one message size for one op on one rank.

    ``parts[r]`` is rank r's share of the gathered output / scattered input (the whole tensor
    for all_reduce), in elements; ``row`` is the row width in elements of the uneven splits
    (1 for the others).
    """
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

    @property
    def rows(self) -> list[int]:
        """Every rank's share in rows: the ``sizes`` argument of the v-collectives."""
        return [p // self.row for p in self.parts]


class Split(ABC):
    """How ``count`` elements split into one part per rank."""

    @abstractmethod
    def parts(self, count: int, world: int, itemsize: int) -> tuple[tuple[int, ...], int, int]:
        """(parts, row width, the count column)."""

    def shape(self, t: torch.Tensor, row: int) -> torch.Tensor:
        """The tensor as the collective takes it."""
        return t

    def rule(self, world: int) -> str | None:
        """The split as one header line, or None where it needs no explaining."""
        return None


@dataclass(frozen=True)
class Even(Split):
    """count // world elements each, rounded down as nccl-tests does; its count column for
    these ops is the per-rank count."""

    def parts(self, count: int, world: int, itemsize: int) -> tuple[tuple[int, ...], int, int]:
        per_rank = count // world
        return (per_rank,) * world, 1, per_rank


@dataclass(frozen=True)
class Rows(Split):
    """uneven_rows() of whole rows ``bytes`` bytes or ``elements`` elements wide; the tensors
    go to the collective as [rows, width] and the count column is the total."""
    bytes: int = 0
    elements: int = 0

    def width(self, itemsize: int) -> int:
        return self.elements or max(1, self.bytes // itemsize)

    def parts(self, count: int, world: int, itemsize: int) -> tuple[tuple[int, ...], int, int]:
        row = self.width(itemsize)
        parts = tuple(r * row for r in uneven_rows(count // row, world))
        return parts, row, sum(parts)

    def shape(self, t: torch.Tensor, row: int) -> torch.Tensor:
        return t.view(-1, row)

    def rule(self, world: int) -> str:
        unit = f"{self.elements}-element" if self.elements else f"{self.bytes}-byte"
        return (f"rank r gets floor(R*(r+1)/{world * (world + 1) // 2}) of the R {unit} rows, "
                f"the last rank the remainder; count = elements over all ranks")
