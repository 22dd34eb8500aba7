"""The registry: op name -> spec, in the order the CLI lists them. The one place that knows
which ops exist; everything else asks it."""
from __future__ import annotations

from .collectives import ALL_GATHER, ALL_GATHERV, ALL_REDUCE, REDUCE_SCATTER, REDUCE_SCATTERV
from .fp4_spec import ALL_GATHERV_FP4
from .moe_spec import MOE_DISPATCH_COMBINE
from .norm_spec import ALL_REDUCE_RMSNORM
from .spec import OpSpec

SPECS: dict[str, OpSpec] = {s.name: s for s in (
    ALL_REDUCE, ALL_GATHER, ALL_GATHERV, REDUCE_SCATTER, REDUCE_SCATTERV, ALL_GATHERV_FP4, ALL_REDUCE_RMSNORM,
    MOE_DISPATCH_COMBINE)}
NAMES: tuple[str, ...] = tuple(SPECS)
# The ops `symcomm-bench baseline` can time: those with one NCCL collective of their own.
BASELINE_NAMES: tuple[str, ...] = tuple(name for name, s in SPECS.items() if s.nccl)


def spec(name: str) -> OpSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r} (one of {', '.join(NAMES)})") from None
