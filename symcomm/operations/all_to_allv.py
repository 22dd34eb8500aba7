"""all_to_allv as an operation: every rank sends a run of its rows to every rank, with per-pair
row counts (zeros allowed), several tensors in one call, as all_gatherv takes them.

Rank r's input has ``sum(send_sizes)`` rows: the first ``send_sizes[0]`` go to rank 0, the next
``send_sizes[1]`` to rank 1, and so on; its output has ``sum(recv_sizes)`` rows, rank 0's first.
``send_sizes`` and ``recv_sizes`` are this rank's own (as torch.distributed.all_to_all_single
takes them): rank r's ``send_sizes[p]`` must equal rank p's ``recv_sizes[r]``. No rank can see
another's counts without communicating, so that rule is checked in check mode (SYMCOMM_CHECK=1,
which exchanges every rank's counts before the call), not on every call.

Its paths are the collectives' ``nccl`` (one group of sends and receives: NCCL 2.28 has no
all-to-all call of its own, and send/recv is what its later ncclAlltoAll does with equal counts)
and ``torch`` (all_to_all_single over the rows' bytes; gloo serves it on the CPU). The MoE
dispatch and combine (moe_dispatch.py, moe_combine.py) run it inside their ``a2a`` path.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import check_mode, validate
from ..base import Call
from ..errors import ArgumentError, PeerMismatchError
from ..registry import lookup
from .autograd import Backward, library_op
from .base import PLAIN_FIRST, CallContext, Operation, into
from .collectives import tensor_lists

if TYPE_CHECKING:
    from ..base import Path
    from ..dispatch import DispatchTable
    from ..peers import Peers

OP = "all_to_allv"


class AllToAllvCall(Call):
    """A validated all_to_allv: ``sizes`` holds send_sizes, ``recv_sizes`` the other side."""

    __slots__ = ("recv_sizes",)


def make_all_to_allv(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], send_sizes: list[int],
                     recv_sizes: list[int]) -> AllToAllvCall:
    """The all_to_allv of already-valid tensors (a composite operation's own buffers)."""
    call = AllToAllvCall(OP, inputs, outputs, [t.data_ptr() for t in inputs], [t.data_ptr() for t in outputs],
                         send_sizes, None, sum(t.nbytes for t in inputs) + sum(t.nbytes for t in outputs))
    call.recv_sizes = recv_sizes
    call.single = False
    return call


def all_to_allv_call(tensors: object, send_sizes: object, recv_sizes: object, out: object, rank: int,
                     world_size: int, device: torch.device) -> AllToAllvCall:
    single, xs, outs = tensor_lists(tensors, out)
    send = validate.sizes_arg(send_sizes, world_size, "send_sizes")
    recv = validate.sizes_arg(recv_sizes, world_size, "recv_sizes")
    if send[rank] != recv[rank]:
        raise ArgumentError(f"send_sizes[{rank}] ({send[rank]}) and recv_sizes[{rank}] ({recv[rank]}) must be equal: "
                            f"they count the rows this rank ({rank}) sends to itself")
    sent, received = sum(send), sum(recv)
    for i, x in enumerate(xs):
        name, out_name = ("tensors", "out") if single else (f"tensors[{i}]", f"out[{i}]")
        xs[i] = x = validate.tensor(name, x, device)
        if validate.rows(name, x) != sent:
            raise ArgumentError(f"{name} has {x.shape[0]} rows, but send_sizes add up to {sent}")
        validate.check_extent(out_name, received, x)
        outs[i] = o = validate.output(out_name, outs[i], (received, *x.shape[1:]), x)
        if x.nbytes and o.nbytes and o.data_ptr() < x.data_ptr() + x.nbytes and x.data_ptr() < o.data_ptr() + o.nbytes:
            raise ArgumentError(f"{out_name} overlaps {name}: all_to_allv has no in-place form (rows move between "
                                f"ranks in both directions); pass separate tensors")
    if len(xs) > 1:
        validate.apart([(f"tensors[{i}]", x) for i, x in enumerate(xs)],
                       [(f"out[{i}]", o) for i, o in enumerate(outs)], "all_to_allv", len(outs))
    call = make_all_to_allv(xs, outs, send, recv)
    call.single = single
    return call


class AllToAllv(Operation):
    name = OP
    bench = None  # measured inside moe_dispatch_combine's columns (symcomm/bench/moe_spec.py)
    window_rule = None
    # A call's bytes are this rank's own sends and receives, which differ between ranks, so
    # they decide nothing every rank must agree on: a rank with none still runs its path (the
    # torch path's all_to_all_single is a collective every rank joins), and the table's row is
    # read at one size for every call.
    skips_empty = False

    def order(self, table: DispatchTable, call: AllToAllvCall) -> tuple[str, ...]:
        return table.preference(OP, math.inf) or PLAIN_FIRST

    def ranking(self, table: DispatchTable, call: AllToAllvCall) -> str:
        return f"by the {table.source} table at every size (each rank's bytes are its own)"

    def build(self, ctx: CallContext, tensors: Any, send_sizes: Any, recv_sizes: Any, out: Any = None) -> Call:
        return all_to_allv_call(tensors, send_sizes, recv_sizes, out, ctx.rank, ctx.world_size, ctx.device)

    def result(self, call: AllToAllvCall) -> torch.Tensor | list[torch.Tensor]:
        return call.outputs[0] if call.single else list(call.outputs)

    def check_signature(self, call: AllToAllvCall, path_index: int, world: int,
                        locate: Callable[[int], tuple[int, int]] | None,
                        compared: Collection[str]) -> tuple[list[int], list[str]]:
        return check_mode.signature(signature_view(call), path_index, world, locate, compared, OP, ())

    def check_more(self, call: AllToAllvCall, path: Path, peers: Peers) -> None:
        problem = counts_problem(peers.exchange([*call.sizes, *call.recv_sizes], kind=check_mode.KIND))
        if problem is not None:
            raise PeerMismatchError(f"check mode: {OP}: {problem}")

    def compiled(self, comm: Any, tensors: Any, send_sizes: Sequence[int], recv_sizes: Sequence[int],
                 out: Any = None, algo: str = "auto") -> Any:
        single = isinstance(tensors, torch.Tensor)
        results = _all_to_allv([tensors] if single else list(tensors), list(send_sizes), list(recv_sizes), comm.key,
                               algo)
        if single:
            return into(out, results[0])
        return results if out is None else [into(o, r, f"out[{i}]") for i, (o, r) in enumerate(zip(out, results))]

    def backward(self, grad: Backward, gs: list[torch.Tensor | None]) -> dict[str, Any]:
        """The rows went out along send_sizes and arrived along recv_sizes; their gradients travel
        back the same way reversed: an all_to_allv with the two swapped. One per input that needs
        a gradient, whether or not its output was used here (zeros if not), so the ranks'
        backward collectives stay alike."""
        send, recv = grad.args["send_sizes"], grad.args["recv_sizes"]

        def returned(g: torch.Tensor | None, x: Any) -> torch.Tensor:
            def exchange() -> torch.Tensor:
                full = g.contiguous() if g is not None else torch.zeros((sum(recv), *x.shape[1:]), dtype=x.dtype,
                                                                        device=x.device)
                return _all_to_allv([full], list(recv), list(send), grad.comm_key, "auto")[0]
            return exchange()  # never pooled: its shapes are this rank's counts (gradient_pooled's rule)

        return {"xs": [returned(g, x) if x.needs_grad else None for g, x in zip(gs, grad.args["xs"])]}


def signature_view(call: AllToAllvCall) -> Call:
    """The call as check mode's signature sees it. The per-rank counts differ by design, so they
    are left out (counts_problem compares them as the matrix they form), and the size is the
    tensors' row width in bytes, which must agree."""
    return Call(OP, call.inputs, call.outputs, call.in_ptrs, call.out_ptrs, None, None,
                sum(t.element_size() * _row_numel(t) for t in call.inputs))


def counts_problem(rows: list[list[int]]) -> str | None:
    """Every rank's counts (row r: rank r's send_sizes, then its recv_sizes) as one verdict, the
    same on every rank: rank r's send_sizes[p] must be rank p's recv_sizes[r]."""
    world = len(rows)
    for r in range(world):
        for p in range(world):
            sent, got = rows[r][p], rows[p][world + r]
            if sent != got:
                return (f"rank {r} sends {sent} rows to rank {p}, but rank {p} expects {got} from rank {r} "
                        f"(send_sizes[{p}] on rank {r} must equal recv_sizes[{r}] on rank {p})")
    return None


def _row_numel(t: torch.Tensor) -> int:
    """Elements per row (dim 0), whatever the row count."""
    numel = 1
    for d in t.shape[1:]:
        numel *= d
    return numel


ALL_TO_ALLV = AllToAllv()


@library_op(f"symcomm::{OP}", ALL_TO_ALLV)
def _all_to_allv(xs: list[torch.Tensor], send_sizes: list[int], recv_sizes: list[int], comm_key: int,
                 algo: str) -> list[torch.Tensor]:
    return list(lookup(comm_key).all_to_allv(list(xs), send_sizes, recv_sizes, algo=algo))


@_all_to_allv.register_fake
def _(xs, send_sizes, recv_sizes, comm_key, algo):
    return [x.new_empty((sum(recv_sizes), *x.shape[1:])) for x in xs]
