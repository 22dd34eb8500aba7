"""What a backend sees of a collective call, and what it must answer."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

# The current cudaStream_t as an int, without building a torch.cuda.Stream (about 1 us saved per
# eager call). Absent from CPU builds, where nothing that launches GPU work is constructed.
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

OPS = ("all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv")
SCATTERING_OPS = frozenset({"reduce_scatter", "reduce_scatterv"})


class Call:
    """One validated collective call. Built per call, so it stays a bag of slots.

    ``inputs[i]`` pairs with ``outputs[i]`` (several only for all_gatherv); ``in_ptrs`` and
    ``out_ptrs`` are their data pointers, read once by the validator. ``sizes`` holds per-rank
    row counts for the v-variants and is None otherwise; ``redop`` is None for gathers.
    ``nbytes`` is the size that selects a path: the tensor for all_reduce, the whole output for
    gathers, the whole input for reduce-scatters (nccl-tests' convention, so tuning tables read
    like its output).
    """

    __slots__ = ("op", "inputs", "outputs", "in_ptrs", "out_ptrs", "sizes", "redop", "nbytes", "dtype",
                 "table_key", "_symmetric")

    def __init__(self, op: str, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                 in_ptrs: Sequence[int], out_ptrs: Sequence[int], sizes: list[int] | None,
                 redop: str | None, nbytes: int) -> None:
        self.op = op
        self.inputs = inputs
        self.outputs = outputs
        self.in_ptrs = in_ptrs
        self.out_ptrs = out_ptrs
        self.sizes = sizes
        self.redop = redop
        self.nbytes = nbytes
        self.dtype = inputs[0].dtype
        # The tuning-table row: the op, or a variant of it that measured differently
        # (see dispatch.BUILTIN).
        self.table_key = op
        self._symmetric: bool | None = None

    @property
    def even(self) -> bool:
        """True unless a v-variant has unequal per-rank sizes."""
        sizes = self.sizes
        return sizes is None or sizes.count(sizes[0]) == len(sizes)


def runner_table(namespace: dict) -> dict:
    """op -> the class's ``_<op>`` function, from a class body's namespace (``locals()``).

    Kept on the class, unbound: a dict of bound methods on the instance would form a
    reference cycle that keeps the process group alive past destroy_process_group()."""
    return {op: namespace[f"_{op}"] for op in OPS}


class Backend(Protocol):
    """One path a collective can take."""

    name: str

    def why_not(self, call: Call) -> str | None:
        """None if this backend can serve ``call``; otherwise the reason, for people."""

    def run(self, call: Call) -> None:
        """Enqueue the collective on the current stream (CUDA) or run it (CPU)."""
