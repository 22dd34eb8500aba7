"""Autograd for the operations: each operation's torch.library op is defined through
``library_op``, which binds it once to its descriptor's backward (Operation.backward). Eager
autograd (the Communicator's methods take the op whenever autograd records a call),
AOTAutograd under torch.compile and a CUDA graph that captures a backward all meet the same rule.

A backward runs collectives, so it is a collective call like the forward: every rank runs it,
in the same order, with equal shapes (SPMD), through the same Communicator dispatch (validated
once, chosen by the table, compared in check mode). Its collectives allocate their outputs in
the symmetric pool when the forward's first input sat there (gradient_pooled).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..base import capturing
from ..errors import ArgumentError, SymmetricMemoryError
from ..memory import use_symmetric_memory
from ..registry import lookup

if TYPE_CHECKING:
    from .base import Operation

T = TypeVar("T")


class Given:
    """A tensor argument as backward sees it: its metadata, not the tensor (the tensors a
    backward reads it saves through autograd, which checks their versions)."""

    __slots__ = ("needs_grad", "shape", "dtype", "device")

    def __init__(self, t: torch.Tensor) -> None:
        self.needs_grad, self.shape, self.dtype, self.device = t.requires_grad, t.shape, t.dtype, t.device


class Backward:
    """What a descriptor's backward() reads: the op's arguments by name (tensor arguments as
    Given, lists of them as lists of Given, absent ones None), the tensors it saved, and whether
    the forward's first tensor input sat in the communicator's symmetric pool."""

    __slots__ = ("args", "saved", "symmetric")

    def __init__(self, args: dict[str, Any], saved: Sequence[torch.Tensor], symmetric: bool) -> None:
        self.args, self.saved, self.symmetric = args, saved, symmetric

    @property
    def comm_key(self) -> int:
        return self.args["comm_key"]

    def needs(self, name: str) -> bool:
        given = self.args[name]
        return isinstance(given, Given) and given.needs_grad

    def pooled(self, make: Callable[[], T]) -> T:
        """``make()``, its allocations placed as gradient_pooled says."""
        return gradient_pooled(self.comm_key, self.symmetric, make)


def gradient_pooled(comm_key: int, symmetric: bool, make: Callable[[], T]) -> T:
    """Run ``make()`` (a backward's collectives) with its allocations in the symmetric pool when
    the forward's input was symmetric, so that a collective fed by these gradients can take the
    zero-copy paths; else, and inside a CUDA-graph capture always, in torch's allocator (the
    graph's pool, whose lifetime the replays rely on). Only for a backward whose allocations have
    the same shapes on every rank, in the same order (the backward is SPMD), which keeps pool
    offsets equal (not an uneven gather's, nor all_to_allv's); those ranks run out of pool alike: then
    the call runs again outside it, since the pool only makes it faster. The failed attempt
    communicated nothing (allocation comes before any communication)."""
    comm = lookup(comm_key)
    if not symmetric or comm.symmetric_pool is None or capturing(comm.device):
        return make()
    try:
        with use_symmetric_memory(comm):
            return make()
    except SymmetricMemoryError:
        return make()


def in_pool(comm_key: int, t: torch.Tensor) -> bool:
    """Whether ``t`` sits in the communicator's symmetric pool (False for a fake tensor, which
    torch.compile traces with: it has no address)."""
    if torch.compiler.is_compiling():
        return False
    try:
        return lookup(comm_key).is_symmetric(t)
    except RuntimeError:
        return False


def records(*tensors: object) -> bool:
    """Whether autograd records a call on these arguments (tensors, lists of them, result tuples
    given as ``out=`` such as Fp4Gathered, or anything: what is not a tensor records nothing, and
    the validator names it). Then the call runs as its torch.library op, which carries the
    backward. An ``out=`` that requires grad counts: the eager paths write its bytes where
    autograd does not see them, so it would keep its old history and give wrong gradients; the
    op's copy into it is recorded."""
    return torch.is_grad_enabled() and _requires_grad(tensors, 2)


def _requires_grad(values: Sequence[object], depth: int) -> bool:
    for t in values:
        if isinstance(t, torch.Tensor):
            if t.requires_grad:
                return True
        elif depth and isinstance(t, (list, tuple)) and _requires_grad(t, depth - 1):
            return True
    return False


def no_backward(op: str, why: str) -> ArgumentError:
    return ArgumentError(f"{op} has no gradient here: {why}. Detach the input (x.detach()) if no gradient "
                         f"should flow through this call")


def library_op(name: str, operation: Operation) -> Callable[[Callable], Any]:
    """Decorator: ``fn`` as the torch.library op ``name`` (functional: it mutates nothing), with
    ``operation``'s backward registered on it. ``fn`` names its communicator argument
    ``comm_key``."""

    def define(fn: Callable) -> Any:
        op = torch.library.custom_op(name, mutates_args=())(fn)
        names = tuple(inspect.signature(fn).parameters)

        def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
            args = dict(zip(names, inputs))
            ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
            ctx.save_for_backward(*operation.saved_for_backward(args, output))
            ctx.symmetric = _symmetric(args)
            ctx.args = {k: _given(v) for k, v in args.items()}

        def backward(ctx: Any, *grads: Any) -> tuple:
            got = operation.backward(Backward(ctx.args, ctx.saved_tensors, ctx.symmetric), *grads)
            return tuple(got.get(n) for n in names)

        op.register_autograd(backward, setup_context=setup_context)
        ordered(op)
        return op

    return define


def ordered(op: Any) -> None:
    """Marks a collective's torch.library op as an ordered side effect, so that torch.compile keeps
    the program's order of such ops. A functional op may otherwise move past an independent one,
    and Inductor's schedule differs by rank wherever shapes do (uneven sizes): ranks then meet in
    different collectives (PeerMismatchError in check mode, a hang over NCCL without it). torch
    names this registration privately in every release symcomm supports; where it is missing
    symcomm still runs, with the order left to torch."""
    try:
        register = getattr(torch.library, "_register_effectful_op", None)
        if register is not None:
            register(op._qualname, torch.library.EffectType.ORDERED)
        else:
            from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
            _register_effectful_op(op._opoverload, _EffectType.ORDERED)
    except (ImportError, AssertionError, RuntimeError):  # a release without it, or one that refuses
        pass                                            # mutating ops (moe_combine) there


def _given(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return Given(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return [Given(v) for v in value]
    return value


def _symmetric(args: dict[str, Any]) -> bool:
    for v in args.values():
        first = v[0] if isinstance(v, (list, tuple)) and v else v
        if isinstance(first, torch.Tensor):
            return in_pool(args["comm_key"], first)
    return False
