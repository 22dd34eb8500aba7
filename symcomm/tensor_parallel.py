"""The tensor-parallel pair: where a replicated activation enters a tensor-parallel region and
where the region's partial sums leave it.

Under tensor parallelism every rank computes the same loss from replicated activations, so a
replicated tensor's gradient is already whole on every rank and must be counted once, not summed
over ranks as a plain ``all_reduce``'s backward does (that one is right for a loss summed over
ranks, as in data parallelism). The two functions below are each other's transpose:

    copy_to_tp_region(comm, x)       forward: x itself        backward: all-reduce (sum)
    reduce_from_tp_region(comm, x)   forward: all-reduce (sum) backward: the gradient itself

A column-parallel linear takes ``copy_to_tp_region(comm, x)``: each rank's gradient of x covers
its own columns only, and the all-reduce adds them up. A row-parallel linear's partial output
goes through ``reduce_from_tp_region``. Both run symcomm's all_reduce (its dispatch, check mode,
and under torch.compile its torch.library op); the all-reduce in copy_to_tp_region's backward
allocates its output in the symmetric pool when x sat there (eager).

Each one's backward is the other one, so a second derivative (``create_graph=True``) keeps the
same rule: the cotangent of a gradient is per rank where the gradient was replicated and the
other way round. A plain all_reduce op there would sum replicated cotangents over the ranks, a
Hessian-vector product W times too large.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import validate
from .errors import ArgumentError
from .operations.autograd import gradient_pooled, in_pool
from .registry import lookup

if TYPE_CHECKING:
    from .communicator import Communicator


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm_key: int) -> torch.Tensor:
        ctx.comm_key = comm_key
        ctx.symmetric = in_pool(comm_key, x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        symmetric = ctx.symmetric and not torch.compiler.is_compiling()  # traced: placement is the graph's
        return gradient_pooled(ctx.comm_key, symmetric,
                               lambda: _ReduceFromRegion.apply(grad.contiguous(), ctx.comm_key, "auto")), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm_key: int, algo: str) -> torch.Tensor:
        ctx.comm_key = comm_key
        return lookup(comm_key).all_reduce(x, algo=algo)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _CopyToRegion.apply(grad, ctx.comm_key), None, None


def copy_to_tp_region(comm: Communicator, x: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged (a view); in backward, its gradient all-reduced (sum) over ``comm``'s ranks.
    Collective in backward: every rank must call it alike."""
    return _CopyToRegion.apply(_tensor(x), validate.communicator_key(comm))


def reduce_from_tp_region(comm: Communicator, x: torch.Tensor, algo: str = "auto") -> torch.Tensor:
    """``comm.all_reduce(x, algo=algo)`` (sum), whose gradient passes through unchanged."""
    # x goes unchecked to the all-reduce, whose rules refuse it as a collective call's refusal.
    return _ReduceFromRegion.apply(x, validate.communicator_key(comm), algo)


def _tensor(x: object) -> torch.Tensor:
    # The forward communicates nothing, so a refusal here is this rank's alone.
    if not isinstance(x, torch.Tensor):  # autograd.Function would pass it on, to fail later
        raise ArgumentError(f"x must be a torch.Tensor, got {type(x).__name__}")
    return x

