"""Operation: one public operation of a Communicator, described once.

Every operation runs the same way (Communicator._run): ``build`` applies every argument rule
and returns the validated Call, before any communication (once; twice for a call autograd
records, which OperationMethods._recorded checks before it becomes the op); dispatch.choose
takes the first path of the operation's order that can serve it; check mode compares the call's
signature across ranks; the path runs it; ``result`` is what the public method returns. A
descriptor holds what differs between operations, as nccl-tests keeps one struct per
collective, so adding an operation is one module (its descriptor and its paths) and one row
of the dispatch table:

    name                      the op name: Call.op, the table's row key, select()'s first argument
    build(ctx, *args)         the argument rules, producing the Call
    result(call)              what the public method returns
    order(table, call)        the paths auto tries, in order
    resolve(call, algo, d)    what ``algo=`` may name (a composite op also takes an inner path)
    check_signature(...)      check mode's vector, with this op's own scalars
    compiled(comm, *args)     the same call as a torch.library op: under torch.compile, and
                              whenever autograd records the call; build's arguments with
                              build's defaults, then algo="auto" (Communicator.run passes any)
    saved_for_backward, backward   its gradient (symcomm/operations/autograd.py binds them to
                              the torch.library op); without them autograd through it raises
    bench                     "module:attribute" of its symcomm-bench spec (None: none)
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .. import check_mode, validate
from ..base import Call
from ..errors import ArgumentError
from .autograd import Backward, no_backward

if TYPE_CHECKING:
    from ..base import Path
    from ..dispatch import Choice, DispatchTable
    from ..peers import Peers

# All-reduce-like operations with no table row prefer plain NCCL, then symmetric, then torch.
PLAIN_FIRST = ("nccl", "nccl-symm", "torch")


class CallContext(Protocol):
    """What an operation's build() reads of the Communicator."""

    rank: int
    world_size: int
    device: torch.device


class Dispatcher(Protocol):
    """What a composite path (one that runs other operations) and an operation's resolve() may
    ask of the Communicator: its paths per operation, and a choice for an already-validated
    inner call, made and run without a second validation or check-mode exchange."""

    table: DispatchTable

    def paths_of(self, op: str) -> dict[str, Path]: ...

    def off_of(self, op: str) -> dict[str, str]: ...

    def choose_inner(self, call: Call, algo: str) -> Path: ...

    def run_inner(self, call: Call, algo: str) -> None: ...

    def explain_inner(self, call: Call, algo: str) -> Choice: ...


class Operation:
    """Base of every operation descriptor: the plain collectives' answers, which composite
    operations override."""

    name: str = ""
    # Collectives skip the launch of an empty call (no bytes move); a composite op still writes
    # its outputs' shapes and lets its path decide.
    skips_empty: bool = True
    bench: str | None = None
    # Check mode: readable forms of this op's scalars, by name, and the advice for a call whose
    # tensors sit at different pool offsets (None: the generic advice).
    check_decode: dict[str, Callable[[int], object]] = {}
    window_rule: str | None = None

    def build(self, ctx: CallContext, *args: Any, **kwargs: Any) -> Call:
        raise NotImplementedError

    def result(self, call: Call) -> Any:
        return call.outputs[0]

    def order(self, table: DispatchTable, call: Call) -> tuple[str, ...]:
        """The paths auto tries, best first: the table's row for the call (plain NCCL first
        where the table has none). A path the row leaves out is never chosen by auto."""
        return table.preference(call.op, call.nbytes) or PLAIN_FIRST

    def ranking(self, table: DispatchTable, call: Call) -> str:
        """Who ranked the paths, for select()'s "ranked below" reasons."""
        return f"at {call.nbytes} bytes by the {table.source} table"

    def resolve(self, call: Call, algo: object, dispatcher: Dispatcher) -> str:
        """The path name ``algo=`` forces, or "auto". Raises ArgumentError for what cannot be one."""
        if not isinstance(algo, str):
            raise ArgumentError(f"algo must be a string, got {type(algo).__name__}")
        return algo

    def resolve_inner(self, call: Call, algo: str, dispatcher: Dispatcher, inner_op: str, via: str,
                      own: Sequence[str], own_label: str) -> str:
        """What every composite operation's resolve() shares: ``algo`` naming a path of
        ``inner_op`` (the collective the composite runs inside) is kept in ``call.inner_algo`` and
        the composite path ``via`` runs it; anything else raises ArgumentError listing this
        operation's ``own`` paths (called ``own_label``) and the inner ones."""
        if algo in dispatcher.paths_of(inner_op):
            call.inner_algo = algo
            return via
        off = dispatcher.off_of(inner_op)
        if algo in off:
            raise ArgumentError(f"algo={algo!r} is unavailable: {off[algo]}")
        raise ArgumentError(f"algo must be 'auto', {own_label} ({', '.join(own)}) or a path of {inner_op} on this "
                            f"communicator ({', '.join(dispatcher.paths_of(inner_op))}), got {algo!r}")

    def inner_choice(self, call: Call, path: Path, dispatcher: Dispatcher) -> Choice | None:
        """For select(): the choice of the operation a composite path runs inside (None here)."""
        return None

    def explain(self, choice: Choice, inner: Choice | None) -> Choice:
        """select()'s answer: the Choice, or this op's richer form of it holding ``inner``."""
        return choice

    def check_scalars(self, call: Call) -> Sequence[tuple[str, int]]:
        """This operation's own result-changing values, compared in check mode."""
        return ()

    def check_signature(self, call: Call, path_index: int, world: int,
                        locate: Callable[[int], tuple[int, int]] | None,
                        compared: Collection[str]) -> tuple[list[int], list[str]]:
        return check_mode.signature(call, path_index, world, locate, compared, self.name, self.check_scalars(call))

    def check_more(self, call: Call, path: Path, peers: Peers) -> None:
        """Check mode, collective, after the signature matched: what this op compares beyond it."""

    def compiled(self, comm: Any, *args: Any) -> Any:
        raise NotImplementedError(f"{self.name} has no torch.library form (torch.compile and autograd use it)")

    def saved_for_backward(self, args: dict[str, Any], output: Any) -> Sequence[torch.Tensor]:
        """The tensors backward() reads, of the torch.library op's arguments (by name) and output."""
        return ()

    def backward(self, grad: Backward, *grads: Any) -> dict[str, Any]:
        """The gradients of the torch.library op's arguments, by name (absent: none), given the
        gradients of its outputs (None for an output nothing used). Runs collectives: every rank
        calls it alike."""
        raise no_backward(self.name, "the operation defines no backward")


def into(out: torch.Tensor | None, result: torch.Tensor, name: str = "out") -> torch.Tensor:
    """The compiled ops are functional: an ``out=`` argument receives a copy of the result. It
    must be the result's shape and dtype, as eager requires: copy_ would broadcast and cast."""
    if out is None:
        return result
    validate.destination(name, out, tuple(result.shape), result.dtype, result.device)
    out.copy_(result)
    return out


def scale_args(scale: object) -> tuple[float | None, torch.Tensor | None]:
    """A global scale as a custom op takes it: (float or None, tensor or None)."""
    return (None, scale) if isinstance(scale, torch.Tensor) else (None if scale is None else float(scale), None)
