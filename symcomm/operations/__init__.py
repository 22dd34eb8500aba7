"""Every public operation of a Communicator, one descriptor each (symcomm/operations/base.py says what a
descriptor holds). OPERATIONS is what a Communicator runs unless told otherwise."""
from __future__ import annotations

from .all_gatherv_fp4 import ALL_GATHERV_FP4
from .all_reduce_rmsnorm import ALL_REDUCE_RMSNORM
from .base import Operation
from .collectives import ALL_GATHER, ALL_GATHERV, ALL_REDUCE, COLLECTIVES, REDUCE_SCATTER, REDUCE_SCATTERV

OPERATIONS: tuple[Operation, ...] = (*COLLECTIVES, ALL_GATHERV_FP4, ALL_REDUCE_RMSNORM)

__all__ = ["ALL_GATHER", "ALL_GATHERV", "ALL_GATHERV_FP4", "ALL_REDUCE", "ALL_REDUCE_RMSNORM", "OPERATIONS", "Operation",
           "REDUCE_SCATTER", "REDUCE_SCATTERV"]
