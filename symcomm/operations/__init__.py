"""Every public operation of a Communicator, one descriptor each (symcomm/operations/base.py says what a
descriptor holds). OPERATIONS is what a Communicator runs unless told otherwise."""
from __future__ import annotations

from .all_gatherv_fp4 import ALL_GATHERV_FP4
from .all_reduce_rmsnorm import ALL_REDUCE_RMSNORM
from .all_to_allv import ALL_TO_ALLV
from .base import Operation
from .collectives import ALL_GATHER, ALL_GATHERV, ALL_REDUCE, COLLECTIVES, REDUCE_SCATTER, REDUCE_SCATTERV
from .moe_combine import MOE_COMBINE
from .moe_dispatch import MOE_DISPATCH

OPERATIONS: tuple[Operation, ...] = (*COLLECTIVES, ALL_TO_ALLV, ALL_GATHERV_FP4, ALL_REDUCE_RMSNORM, MOE_DISPATCH,
                                     MOE_COMBINE)

__all__ = ["ALL_GATHER", "ALL_GATHERV", "ALL_GATHERV_FP4", "ALL_REDUCE", "ALL_REDUCE_RMSNORM", "ALL_TO_ALLV",
           "MOE_COMBINE", "MOE_DISPATCH", "OPERATIONS", "Operation", "REDUCE_SCATTER", "REDUCE_SCATTERV"]
