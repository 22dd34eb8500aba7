"""moe_combine as an operation (``Communicator.moe_combine``): add each token's expert output rows,
weighted by the top-k weights dispatch carried, first on each rank that holds some of them (in slot
order), then the ranks' partial sums on the rank that owns the token (in rank order):
symcomm/ep/layout.py, "Combine, by rank", the same bits on every path, eager or replayed. A token
crosses back once per rank holding its experts, not once per expert.

``expert_out`` is [capacity, H] in the dispatched rows' layout (row r is the expert output of
received row r; rows that hold no token are never used), in the dtype x had. ``quant="fp8"``
sends the partial sums as block FP8 (symcomm/ep/fp8.py), half the bytes of bf16, and adds the
dequantized values. Paths and ``algo=`` as moe_dispatch's (moe_dispatch.py); a handle from
either path works on either.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import validate
from ..base import Call
from ..ep import fp8
from ..errors import ArgumentError
from ..registry import lookup
from .autograd import ordered
from .base import CallContext, into
from .moe_dispatch import EpHandle, EpOperation, check_quant_dtype, pool_signature

OP = "moe_combine"
QUANTS = (None, "fp8")
OFFSETS_RULE = ("The peer path writes the expert outputs into the owning rank's handle.returned at this rank's pool "
                "offset: dispatch inside use_symmetric_memory with the same arguments in the same order on every "
                "rank, or with out= an earlier call's Dispatched")


class CombineCall(Call):
    """A validated combine: expert_out in, this rank's tokens out."""

    __slots__ = ("expert_out", "handle", "quant", "out", "inner_algo")

    def __init__(self, expert_out: torch.Tensor, handle: EpHandle, quant: str | None, out: torch.Tensor) -> None:
        returned = handle.returned
        super().__init__(OP, (expert_out,), (returned,), (expert_out.data_ptr(),), (returned.data_ptr(),), None, None,
                         expert_out.nbytes)
        self.expert_out, self.handle, self.quant, self.out = expert_out, handle, quant, out
        self.inner_algo = "auto"


class MoeCombine(EpOperation):
    name = OP
    skips_empty = False  # a rank with no tokens still serves its experts' rows
    bench = "symcomm.bench.moe_spec:MOE_DISPATCH_COMBINE"
    check_decode: dict[str, Callable[[int], object]] = {"quant": lambda v: ("none", "fp8")[v]}
    window_rule = OFFSETS_RULE

    def build(self, ctx: CallContext, expert_out: Any, handle: Any, quant: Any = None, out: Any = None) -> CombineCall:
        self.refuse_gradient(expert_out, out)
        device = ctx.device
        if not isinstance(handle, EpHandle):
            raise ArgumentError(f"handle must be the EpHandle a dispatch returned (Dispatched.handle), got "
                                f"{type(handle).__name__}")
        if handle.world != ctx.world_size:
            raise ArgumentError(f"handle comes from a dispatch over {handle.world} ranks, this communicator has "
                                f"{ctx.world_size}")
        if handle.recv_src.device != device:
            raise ArgumentError(f"handle's buffers are on {handle.recv_src.device}, but the call runs on {device}")
        expert_out = validate.given("expert_out", expert_out, (handle.capacity, handle.hidden), handle.dtype, device)
        if quant not in QUANTS:
            raise ArgumentError(f"quant must be None or 'fp8', got {quant!r}")
        check_quant_dtype(quant, expert_out.dtype, "expert_out")
        if quant == "fp8":
            fp8.check_rows(expert_out, "expert_out")
        shape = (handle.tokens, handle.hidden)
        out = torch.empty(shape, dtype=handle.dtype, device=device) if out is None else validate.destination(
            "out", out, shape, handle.dtype, device)
        for name, t in (("expert_out", expert_out), ("handle.returned", handle.returned)):
            if out.nbytes and t.data_ptr() < out.data_ptr() + out.nbytes and out.data_ptr() < t.data_ptr() + t.nbytes:
                raise ArgumentError(f"out overlaps {name}; pass a separate tensor")
        return CombineCall(expert_out, handle, quant, out)

    def result(self, call: CombineCall) -> torch.Tensor:
        return call.out

    def check_scalars(self, call: CombineCall) -> Sequence[tuple[str, int]]:
        h = call.handle
        return [("quant", QUANTS.index(call.quant)), ("num_experts", h.num_experts), ("max_tokens", h.max_tokens),
                ("topk", h.topk), ("align", h.align)]

    def check_signature(self, call: CombineCall, path_index: int, world: int,
                        locate: Callable[[int], tuple[int, int]] | None,
                        compared: Sequence[str]) -> tuple[list[int], list[str]]:
        return pool_signature(self.name, call, [("handle.returned", call.handle.returned)], call.expert_out.dtype,
                              self.check_scalars(call), path_index, world, locate, compared)

    def compiled(self, comm: Any, expert_out: torch.Tensor, handle: EpHandle, quant: str | None = None,
                 out: torch.Tensor | None = None, algo: str = "auto") -> torch.Tensor:
        self.refuse_gradient(expert_out, out)
        h = handle
        got = _moe_combine(expert_out, h.topk_ids, h.topk_weights, h.send_rows, h.recv_src, h.recv_group,
                           h.expert_offsets, h.table, h.returned, h.num_experts, h.max_tokens, h.align, quant, comm.key,
                           algo)
        return into(out, got)


MOE_COMBINE = MoeCombine()


# The peer path writes the expert outputs into every source rank's handle.returned (this rank's
# included): an argument it mutates.
@torch.library.custom_op(f"symcomm::{OP}", mutates_args=("returned",))
def _moe_combine(expert_out: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 send_rows: torch.Tensor, recv_src: torch.Tensor, recv_group: torch.Tensor, expert_offsets: torch.Tensor,
                 table: torch.Tensor, returned: torch.Tensor, num_experts: int, max_tokens: int, align: int,
                 quant: str | None, comm_key: int, algo: str) -> torch.Tensor:
    handle = EpHandle(send_rows, recv_src, expert_offsets, table, returned, recv_group, topk_ids, topk_weights,
                      num_experts, max_tokens, align, expert_out.dtype)
    return lookup(comm_key).moe_combine(expert_out, handle, quant=quant, algo=algo)


ordered(_moe_combine)


@_moe_combine.register_fake
def _(expert_out, topk_ids, topk_weights, send_rows, recv_src, recv_group, expert_offsets, table, returned,
      num_experts, max_tokens, align, quant, comm_key, algo):
    return expert_out.new_empty((topk_ids.shape[0], expert_out.shape[1]))
