"""What the bench asks of one collective: every op answers these, and the runner, the report,
the tuner and the CLI ask nothing else, so none of them needs to know which op it runs.

The ops themselves are in collectives.py, fp4_spec.py, norm_spec.py and moe_spec.py; ops.py looks
them up by name.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from . import check
from .sizes import Layout


@dataclass
class Buffers:
    """The sweep's buffers, sized for its largest message of every op it runs."""
    send: torch.Tensor
    recv: torch.Tensor
    symmetric: bool
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # named as in OpSpec.buffers()


@dataclass
class Case:
    """One timed column at one size: the call, how to load its input (and poison its output)
    before a checked call, and how to count wrong elements after it."""

    call: Callable[[], object]
    load: Callable[[], None]
    count: Callable[[], int] | None   # None when the check is off
    corrupt: Callable[[], None]       # test hook: spoil one output element


@dataclass(frozen=True)
class Refusal:
    """A column that cannot run at one size: N/A in the table, ``reason`` under its block.
    Decided from what every rank knows alike (device, dtype, size, world, timing mode) and
    before any communication, so every rank skips the column together."""
    reason: str


@dataclass(frozen=True)
class Setup:
    """This rank's side of a sweep, as a spec needs it to build one size's columns."""
    comm: Any
    bufs: Buffers
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    redop: str
    seed: int
    check: bool
    path: str  # the path each column of a spec with variants runs (--algo; "all" means auto)
    graphs: bool = False  # calls are captured into CUDA graphs (-G > 0 on cuda), not run eagerly


class Labels(NamedTuple):
    """The table's type / redop / root columns (the names are RunInfo's fields)."""
    type_name: str
    redop: str
    root: int


# (column, in place?) -> the case, a Refusal where the column cannot run at this size, or None
# where that column has no such side.
Cases = Callable[[str, bool], Optional[Union[Case, Refusal]]]
# rank -> that rank's input, in the run's dtype; any rank can rebuild any other's.
Inputs = Callable[[int], torch.Tensor]


class OpSpec(ABC):
    """One collective. Subclasses set ``name`` and ``reduces`` and answer the abstract methods;
    the rest has the plain collectives' answer."""

    name: str
    reduces: bool  # applies -o; gathers only move data and print redop "none"
    root: int = -1  # nccl-tests' root column: -1 for collectives without a root
    # Fixed columns, named here, in place of one column per path (--algo then picks the path
    # each column runs).
    variants: tuple[str, ...] = ()
    # The NCCL collective that does exactly what this op does, which `symcomm-bench baseline`
    # times alone in its process; None where NCCL has no such call (uneven splits, FP4).
    nccl: Optional[str] = None
    # The shape flags (--hidden, --topk, ...) this op takes; configure() applies them.
    shape_flags: tuple[str, ...] = ()
    # Columns beside the paths that time another library's own version of this op (PyTorch's
    # symmetric memory): --algo all adds them and --algo may name them; tune never measures
    # them, since auto cannot pick them. comparison_cases() builds them.
    comparisons: tuple[str, ...] = ()
    # Whether a run with auto among its columns ends with a peer copy of each size's bytes on the
    # wire (link.py): only for the even collectives, whose wire bytes per GPU are the size x the
    # bus factor on every rank.
    times_link: bool = False

    def configure(self, options: dict[str, int]) -> "OpSpec":
        """This op with the run's shape flags applied (``options``: flag name -> value)."""
        return self

    # -- what a size means --------------------------------------------------------------
    @abstractmethod
    def layout(self, nbytes: int, world: int, itemsize: int, rank: int) -> Layout:
        """Byte and element counts of ``nbytes``, rounded down to whole elements per rank."""

    @abstractmethod
    def bus_factor(self, world: int) -> float:
        """busbw / algbw: the fraction of the data each rank's link carries (nccl-tests')."""

    def redop_label(self, redop: str) -> str:
        """The redop column, which is also the reduction the input data must survive without
        overflowing: gathers reduce nothing."""
        return redop if self.reduces else "none"

    def labels(self, type_name: str, redop: str) -> Labels:
        return Labels(type_name, self.redop_label(redop), self.root)

    def notes(self, world: int, itemsize: int, path: str) -> list[str]:
        """Header lines this op adds to the preamble."""
        return []

    def comparison_notes(self) -> list[str]:
        """Header lines on the comparison columns, printed when the run measures one."""
        return []

    def buffers(self, max_out_elems: int) -> dict[str, tuple[int, torch.dtype]]:
        """Buffers beyond send/recv, by name: (elements, dtype) for the largest size."""
        return {}

    def validate(self, datatype: str) -> None:
        """Raises BenchError where this op cannot run with ``datatype`` (a DATATYPES key)."""

    def default_datatype(self, device: str) -> str:
        """-d when none is given: a type this op takes on ``device`` (nccl-tests' float on
        the CPU; bfloat16, what models send, on GPUs)."""
        return "bfloat16" if device == "cuda" else "float"

    def smallest_size(self, world: int, itemsize: int, limit: int = 1 << 24) -> int | None:
        """The smallest message, in bytes, of which this op makes a non-empty call (its count
        column above zero): one element, or one per rank, or one row. None if none up to
        ``limit`` (a size so large is a spec's bug, not a user's)."""
        for nbytes in range(itemsize, limit + 1, itemsize):
            if self.layout(nbytes, world, itemsize, 0).count > 0:
                return nbytes
        return None

    # -- data and check -----------------------------------------------------------------
    @abstractmethod
    def input_elems(self, lay: Layout, rank: int) -> int:
        """Elements in ``rank``'s input (which may differ from this rank's)."""

    @abstractmethod
    def views(self, lay: Layout, bufs: Buffers, rank: int, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) for one call; in place aliases them the way nccl-tests does."""

    @abstractmethod
    def run(self, comm: Any, lay: Layout, x: torch.Tensor, out: torch.Tensor, redop: str,
            algo: str) -> Callable[[], object]:
        """A zero-argument closure over the Communicator call, so the timed loop costs one
        Python call on top of the API."""

    @abstractmethod
    def expected(self, lay: Layout, redop: str, dtype: torch.dtype, rank: int, world: int,
                 gen: Inputs) -> check.Expected:
        """``rank``'s whole output, given every rank's input ``gen(p)``."""

    def inputs(self, setup: Setup, lay: Layout) -> Inputs:
        redop = self.redop_label(setup.redop)

        def gen(p: int) -> torch.Tensor:
            return check.make_input(self.input_elems(lay, p), setup.dtype, setup.device, setup.seed,
                                    p, lay.nbytes, redop, setup.world)
        return gen

    def cases(self, setup: Setup, lay: Layout, gen: Inputs) -> Cases:
        """One column per path, out of place and in place, checked against a float64
        reference computed from every rank's regenerated input; the comparison columns are
        checked against the same reference."""
        mine = gen(setup.rank)
        exp = self.expected(lay, setup.redop, setup.dtype, setup.rank, setup.world, gen) if setup.check else None
        theirs = self.comparison_cases(setup, lay, mine, exp) if self.comparisons else None

        def case(algo: str, inplace: bool) -> Case | Refusal | None:
            if theirs is not None and algo in self.comparisons:
                return theirs(algo, inplace)
            x, out = self.views(lay, setup.bufs, setup.rank, inplace)
            return Case(call=self.run(setup.comm, lay, x, out, setup.redop, algo),
                        load=lambda: load(x, out, mine),
                        count=None if exp is None else (lambda: check.count_wrong(out, exp)),
                        corrupt=lambda: check.corrupt(out))
        return case

    def comparison_cases(self, setup: Setup, lay: Layout, mine: torch.Tensor,
                         exp: check.Expected | None) -> Cases:
        """The comparison columns at one size: ``mine`` is this rank's input, ``exp`` its
        expected output (None when the check is off), the same as the paths' columns get."""
        raise NotImplementedError(f"{self.name} names comparison columns but builds none")


def load(x: torch.Tensor, out: torch.Tensor, mine: torch.Tensor) -> None:
    """Poison the output, then write this rank's input (in-place layouts overlap the two, so
    the order matters)."""
    check.poison_fill(out)
    if x.numel():
        x.reshape(-1).copy_(mine)
