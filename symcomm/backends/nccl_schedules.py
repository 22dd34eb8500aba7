"""The schedules plain NCCL runs uneven gathers and reduce-scatters with, chosen by rules measured
per world size (NcclPath in symcomm/backends/nccl.py enqueues them). Everything a rule reads is
the same on every rank, so every rank runs the same schedule: a rank on another schedule would
wait forever for collectives nobody else enqueued."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

# Uneven all_gatherv schedule, by the gathered bytes (all tensors of the call). Same-run
# measurement (bench/gatherv_variants.py, 2026-11-22, H200, NCCL 2.28.9): a group of sends and
# receives beat a group of one broadcast per root by 1.35x/2.0x/1.6x/1.06x at 1/4/16/64 MiB at
# world 4, and 2.0x/1.6x/1.3x/1.02x at world 2. Above 64 MiB only a cross-run comparison
# exists (bench/fp4_gather.py's bf16 gather: 128 MiB 465 vs 415 us, 256 MiB 941 vs 745 us with
# send/recv vs broadcasts), so broadcasts keep the sizes where send/recv was not shown to win.
SENDRECV_GATHERV_MAX_BYTES = 64 << 20

# Uneven reduce_scatterv schedules (NcclPath._reduce_scatterv; an even call is one
# ncclReduceScatter whatever the table says):
RSV_REDUCE_PER_ROOT = "reduce-per-root"  # one ncclReduce per non-empty root, in one group
RSV_PADDED = "padded"  # every root padded to max(sizes) rows, one ncclReduceScatter
RSV_SEND_RECV = "send-recv"  # each root receives its rows from every peer and sums them itself
RSV_SCHEDULES = (RSV_REDUCE_PER_ROOT, RSV_PADDED, RSV_SEND_RECV)


class RsvRule(NamedTuple):
    """One row of RSV_SCHEDULE_RULES: ``schedule`` for calls within both limits."""

    max_bytes: int  # the call's input bytes, sum(sizes) rows (Call.nbytes), at most this
    # world * max(sizes) / sum(sizes) at most this: the factor by which padding multiplies the
    # bytes every rank reduces, and the padded schedule's temporary over x (1.0 for even sizes)
    max_padding: float
    schedule: str


# Uneven reduce_scatterv schedule, by world size. The first rule the call fits picks; a rule
# whose schedule the call cannot use (send-recv off a float sum) passes to the next; a call that
# fits no rule, or a world without rules, keeps one ncclReduce per root. Everything it reads
# (sizes, row bytes, world, dtype, op) is the same on every rank, so every rank runs the same
# schedule: a rank on another schedule would wait forever for collectives nobody else enqueued.
# Measured with bench/reduce_scatterv_variants.py (2026-11-23, 2 x H200, NCCL 2.28.9, bf16 rows
# of 7168, split 1.0 : 0.55, i.e. padding 1.29; two runs within 0.6 us; bench/results/
# 2026-11-23_session6_2xH200): padded beat reduce-per-root by 1.12x/1.15x/1.16x/1.04x at 56 KiB/
# 252 KiB/1 MiB/4 MiB and lost from 16 MiB (0.73x, 0.55x at 64 MiB); send-recv won nowhere by
# more than 1.03x. Only that padding was measured, so padded is kept to it. Other worlds keep
# reduce-per-root until a run at that world says otherwise.
RSV_SCHEDULE_RULES: dict[int, tuple[RsvRule, ...]] = {
    2: (RsvRule(max_bytes=4 << 20, max_padding=1.3, schedule=RSV_PADDED),),
}

# The send-recv schedule sums on the receiving rank: every peer's rows, in rank order
# 0..world-1, in the accumulator dtype here, rounded once to the call's dtype on the write to
# the output. NCCL rounds to the dtype after every step of its own chain (ring or tree order),
# so for 16-bit floats this is more accurate, and for any dtype not bitwise NCCL's result (an
# fp32 call accumulates in fp32 like NCCL, in another order). fp8 stays out: torch does not
# promote fp8 in mixed-dtype arithmetic. Sum only: NCCL's avg premultiplies floats by 1/world,
# a rounding this sum would not reproduce.
LOCAL_SUM_ACCUMULATOR: dict[torch.dtype, torch.dtype] = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float32: torch.float32,
    torch.float64: torch.float64,
}

# schedule -> whether it can run a call of this (dtype, redop); NCCL's own schedules take any
# call the path accepted.
_RSV_ELIGIBLE = {
    RSV_REDUCE_PER_ROOT: lambda dtype, redop: True,
    RSV_PADDED: lambda dtype, redop: True,
    RSV_SEND_RECV: lambda dtype, redop: redop == "sum" and dtype in LOCAL_SUM_ACCUMULATOR,
}


def rsv_schedule(sizes: Sequence[int], row_bytes: int, world: int, dtype: torch.dtype, redop: str,
                 forced: str | None = None) -> str:
    """The schedule of one uneven reduce_scatterv: ``forced`` where the call can use it, else
    RSV_SCHEDULE_RULES'. Reads nothing rank-specific, so every rank gets the same answer."""
    if forced is not None and _RSV_ELIGIBLE[forced](dtype, redop):
        return forced
    total = sum(sizes)
    nbytes = total * row_bytes
    padding = world * max(sizes) / total if total else 1.0
    for rule in RSV_SCHEDULE_RULES.get(world, ()):
        if nbytes <= rule.max_bytes and padding <= rule.max_padding and _RSV_ELIGIBLE[rule.schedule](dtype, redop):
            return rule.schedule
    return RSV_REDUCE_PER_ROOT


def sum_in_rank_order(parts: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """out = parts[0] + ... + parts[-1], left to right in LOCAL_SUM_ACCUMULATOR's dtype, one
    rounding to out's dtype. Two parts at least."""
    acc = parts[0].to(LOCAL_SUM_ACCUMULATOR[out.dtype], copy=True)  # a copy: parts[0] may be x
    for part in parts[1:-1]:
        acc.add_(part)  # in place on the accumulator: torch computes in its wider dtype
    torch.add(acc, parts[-1], out=out)  # computed in the accumulator dtype, rounded on the write
