"""The Communicator's five collectives as bench specs.

Byte counts follow nccl-tests: the reported size is the tensor for all_reduce, the whole output
for gathers and the whole input for reduce-scatters, rounded down so that every rank holds whole
elements. In place aliases input and output as nccl-tests does: the same tensor for all_reduce,
the rank's slice of the output for gathers, the rank's slice of the input as the output for
reduce-scatters.

all_reduce, all_gather and reduce_scatter also have comparison columns: PyTorch's own
symmetric-memory collectives (torch_symm.py), checked against the same references.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from . import check, torch_symm
from .sizes import ROW_BYTES, Even, Layout, Rows, Split
from .spec import Buffers, Cases, Inputs, OpSpec, Setup

# (comm, input, output, rows per rank, redop, algo) -> the zero-argument timed call.
Launch = Callable[[Any, torch.Tensor, torch.Tensor, Sequence[int], str, str], Callable[[], object]]


@dataclass(frozen=True)
class AllReduce(OpSpec):
    name: str
    launch: Launch
    nccl: Optional[str] = None
    comparisons: tuple[str, ...] = ()  # torch_symm.ALL_REDUCE_COLUMNS, or none
    times_link: bool = False
    reduces = True

    def layout(self, nbytes: int, world: int, itemsize: int, rank: int) -> Layout:
        count = nbytes // itemsize
        return Layout(count * itemsize, count, count, count, (count,) * world)

    def bus_factor(self, world: int) -> float:
        return 2.0 * (world - 1) / world

    def input_elems(self, lay: Layout, rank: int) -> int:
        return lay.count

    def output_span(self, lay: Layout, rank: int) -> tuple[int, int]:
        """[lo, hi) of the input elements that reduce into ``rank``'s output."""
        return 0, lay.count

    def views(self, lay: Layout, bufs: Buffers, rank: int, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = bufs.send[:lay.count]
        return x, (x if inplace else bufs.recv[:lay.count])

    def run(self, comm: Any, lay: Layout, x: torch.Tensor, out: torch.Tensor, redop: str,
            algo: str) -> Callable[[], object]:
        return self.launch(comm, x, out, lay.rows, redop, algo)

    def expected(self, lay: Layout, redop: str, dtype: torch.dtype, rank: int, world: int,
                 gen: Inputs) -> check.Expected:
        lo, hi = self.output_span(lay, rank)
        return check.reduction((gen(p)[lo:hi] for p in range(world)), redop, dtype, world)

    def comparison_notes(self) -> list[str]:
        return list(torch_symm.ALL_REDUCE_NOTES)

    def comparison_cases(self, setup: Setup, lay: Layout, mine: torch.Tensor,
                         exp: check.Expected | None) -> Cases:
        out = self.views(lay, setup.bufs, setup.rank, False)[1]
        return torch_symm.all_reduce_cases(setup, lay.nbytes, lay.count, mine, out, exp)


@dataclass(frozen=True)
class Sharded(OpSpec):
    """Rank r owns part r of the full tensor: its output for gathers, its input for
    reduce-scatters. Each rank's link carries the (n-1)/n of the data that other ranks own."""
    name: str
    split: Split
    launch: Launch
    nccl: Optional[str] = None
    comparisons: tuple[str, ...] = ()  # (torch_symm.LOW_CONTENTION,) for the even ops, or none
    times_link: bool = False

    @abstractmethod
    def sides(self, total: int, mine: int) -> tuple[int, int]:
        """(input elements, output elements) of a rank that owns ``mine`` of ``total``."""

    def layout(self, nbytes: int, world: int, itemsize: int, rank: int) -> Layout:
        parts, row, count = self.split.parts(nbytes // itemsize, world, itemsize)
        total = sum(parts)
        in_elems, out_elems = self.sides(total, parts[rank])
        return Layout(total * itemsize, count, in_elems, out_elems, parts, row)

    def bus_factor(self, world: int) -> float:
        return (world - 1) / world

    def notes(self, world: int, itemsize: int, path: str) -> list[str]:
        rule = self.split.rule(world)
        return [f"Split: {rule}"] if rule else []

    def run(self, comm: Any, lay: Layout, x: torch.Tensor, out: torch.Tensor, redop: str,
            algo: str) -> Callable[[], object]:
        return self.launch(comm, x, out, lay.rows, redop, algo)

    def comparison_notes(self) -> list[str]:
        return list(torch_symm.LOW_CONTENTION_NOTES)

    def comparison_cases(self, setup: Setup, lay: Layout, mine: torch.Tensor,
                         exp: check.Expected | None) -> Cases:
        return torch_symm.low_contention_cases(setup)


class Gather(Sharded):
    reduces = False

    def sides(self, total: int, mine: int) -> tuple[int, int]:
        return mine, total

    def input_elems(self, lay: Layout, rank: int) -> int:
        return lay.parts[rank]

    def views(self, lay: Layout, bufs: Buffers, rank: int, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
        lo = lay.offset(rank)
        out = bufs.recv[:lay.total]
        x = out[lo:lo + lay.parts[rank]] if inplace else bufs.send[:lay.parts[rank]]
        return self.split.shape(x, lay.row), self.split.shape(out, lay.row)

    def expected(self, lay: Layout, redop: str, dtype: torch.dtype, rank: int, world: int,
                 gen: Inputs) -> check.Expected:
        return check.concatenation(gen(p) for p in range(world))


class ReduceScatter(Sharded):
    reduces = True

    def sides(self, total: int, mine: int) -> tuple[int, int]:
        return total, mine

    def input_elems(self, lay: Layout, rank: int) -> int:
        return lay.total  # every rank holds the whole input

    def output_span(self, lay: Layout, rank: int) -> tuple[int, int]:
        """[lo, hi) of the input elements that reduce into ``rank``'s output."""
        lo = lay.offset(rank)
        return lo, lo + lay.parts[rank]

    def views(self, lay: Layout, bufs: Buffers, rank: int, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.output_span(lay, rank)
        x = bufs.send[:lay.total]
        out = x[lo:hi] if inplace else bufs.recv[:lay.parts[rank]]
        return self.split.shape(x, lay.row), self.split.shape(out, lay.row)

    def expected(self, lay: Layout, redop: str, dtype: torch.dtype, rank: int, world: int,
                 gen: Inputs) -> check.Expected:
        lo, hi = self.output_span(lay, rank)
        return check.reduction((gen(p)[lo:hi] for p in range(world)), redop, dtype, world)


# Each closes over its arguments alone, so the timed call does no attribute lookups of ours.
def all_reduce_call(comm: Any, x: torch.Tensor, out: torch.Tensor, rows: Sequence[int], redop: str,
                algo: str) -> Callable[[], object]:
    return lambda: comm.all_reduce(x, out=out, op=redop, algo=algo)


def all_gather_call(comm: Any, x: torch.Tensor, out: torch.Tensor, rows: Sequence[int], redop: str,
                algo: str) -> Callable[[], object]:
    return lambda: comm.all_gather(x, out=out, algo=algo)


def all_gatherv_call(comm: Any, x: torch.Tensor, out: torch.Tensor, rows: Sequence[int], redop: str,
                 algo: str) -> Callable[[], object]:
    return lambda: comm.all_gatherv(x, rows, out=out, algo=algo)


def reduce_scatter_call(comm: Any, x: torch.Tensor, out: torch.Tensor, rows: Sequence[int], redop: str,
                    algo: str) -> Callable[[], object]:
    return lambda: comm.reduce_scatter(x, out=out, op=redop, algo=algo)


def reduce_scatterv_call(comm: Any, x: torch.Tensor, out: torch.Tensor, rows: Sequence[int], redop: str,
                     algo: str) -> Callable[[], object]:
    return lambda: comm.reduce_scatterv(x, rows, out=out, op=redop, algo=algo)


UNEVEN = Rows(bytes=ROW_BYTES)

# torch has no uneven symmetric-memory gather or reduce-scatter: the v-ops compare with nothing.
ALL_REDUCE = AllReduce("all_reduce", all_reduce_call, nccl="ncclAllReduce",
                       comparisons=torch_symm.ALL_REDUCE_COLUMNS, times_link=True)
ALL_GATHER = Gather("all_gather", Even(), all_gather_call, nccl="ncclAllGather",
                    comparisons=(torch_symm.LOW_CONTENTION,), times_link=True)
ALL_GATHERV = Gather("all_gatherv", UNEVEN, all_gatherv_call)
REDUCE_SCATTER = ReduceScatter("reduce_scatter", Even(), reduce_scatter_call, nccl="ncclReduceScatter",
                               comparisons=(torch_symm.LOW_CONTENTION,), times_link=True)
REDUCE_SCATTERV = ReduceScatter("reduce_scatterv", UNEVEN, reduce_scatterv_call)
