"""``peer-push``: moe_dispatch and moe_combine through peer-mapped symmetric memory, one
symcomm_ep_dispatch / symcomm_ep_combine each (csrc/ep.cu: one launch each, the counts
exchanged on the device, so nothing waits for the host and every launch can be captured).

They need CUDA, the peer runtime (world 2, 4, 6 or 8 on one host), at most 1,024 experts and a
top-k of at most 32, rows of whole 16-byte vectors (NVFP4 and FP8 read bf16 or fp16), and every
buffer peers write in a mapped symmetric pool region: the receive rows and scales, the handle's
recv_src and recv_group (dispatch) and its returned buffer (combine). The handle's table sits in the pool too
(the a2a path's all-gather writes it), though here the kernel only copies the counts into it.
Dispatch allocates them inside use_symmetric_memory, or takes them from ``out=``. Inputs (tokens,
ids, weights, expert outputs) are read locally and may sit anywhere; the weights travel with the
dispatch to the experts' ranks, where combine adds each token's rows up before they cross back.
"""
from __future__ import annotations

import ctypes

import torch

from .. import _native, fp4
from ..base import Setup
from ..ep import fp8
from ..operations.moe_combine import OP as COMBINE_OP, CombineCall
from ..operations.moe_dispatch import OP as DISPATCH_OP, PUSH, DispatchCall
from ..peer.capture import CAPTURE_CODES
from ..peer.setup import SharedContext
from .peer_path import PeerPath

_c = ctypes
_I32P = _c.POINTER(_c.c_int32)


def _i32(t: torch.Tensor) -> ctypes._Pointer:
    return _c.cast(t.data_ptr(), _I32P)


class _EpPushPath(PeerPath):
    """What both peer-push paths share: CUDA only, and the mapped-region test."""

    equal_offsets = ("out",)  # peers write this rank's pool buffers at its offsets; inputs are local

    def __init__(self, shared: SharedContext | None = None) -> None:
        super().__init__(PUSH, shared)

    def open(self, setup: Setup) -> str | None:
        if setup.device.type != "cuda":
            return f"the peer kernels run on CUDA devices, and this communicator runs on {setup.device}"
        return super().open(setup)

    def _unmapped(self, named: list[tuple[str, torch.Tensor]]) -> str | None:
        context = self._context
        if context.device_index is None:  # a context over CPU memory: only tests build one
            return "the peer kernels run on CUDA devices, and this communicator runs on cpu"
        for name, t in named:
            if context.region_of(t.data_ptr()) is None:
                problem = context.region_problem or ("call dispatch inside use_symmetric_memory, or pass out= (an "
                                                     "earlier Dispatched allocated there)")
                return f"{name} is not in a mapped symmetric pool region (peers write it in place): {problem}"
            if t.data_ptr() % 16:
                return f"{name} does not start on a 16-byte boundary"
        return None

    def _where(self, t: torch.Tensor, session, code: int) -> tuple[int, int]:
        return self._context.output_slot(t.data_ptr(), t.nbytes, session, code)


class PushDispatchPath(_EpPushPath):
    ops = frozenset({DISPATCH_OP})
    CODE = CAPTURE_CODES["ep-dispatch"]

    def why_not(self, call: DispatchCall) -> str | None:
        problem = _shape_rules(call.x.dtype, call.x.shape[1], call.quant, call.handle.topk)
        if problem is None and call.num_experts > _native.EP_MAX_EXPERTS:
            problem = f"{call.num_experts} experts exceed the kernels' {_native.EP_MAX_EXPERTS}"
        return problem or self._unmapped(call.named_outputs())

    def run(self, call: DispatchCall) -> None:
        context, h = self._context, call.handle
        session = context.session()
        stream, (x,), _ = context.launch_inputs(session, (call.x,))
        ids = call.topk_ids
        recv = self._where(call.recv, session, self.CODE)
        scales = self._where(call.recv_scales, session, self.CODE) if call.recv_scales is not None else (0, 0)
        src = self._where(h.recv_src, session, self.CODE)
        table = self._where(h.table, session, self.CODE)
        group = self._where(h.recv_group, session, self.CODE)
        weights = call.topk_weights
        gs_ptr, gs_value = fp4.launch_scale(call.gs) if call.gs is not None else (None, 0.0)
        a = _native.EpDispatchArgs(
            x=x.data_ptr(), dtype=_native.DTYPE_CODES[x.dtype], rows=x.shape[0], cols=x.shape[1],
            topk_ids=ids.data_ptr(), ids_int64=int(ids.dtype == torch.int64), weights=weights.data_ptr(),
            weights_dtype=_native.DTYPE_CODES[weights.dtype], topk=h.topk,
            num_experts=call.num_experts, max_tokens=call.max_tokens, align=call.align, capacity=call.capacity,
            quant=_native.EP_QUANT_CODES[call.quant], gs_ptr=gs_ptr, gs_value=gs_value, swizzle=int(call.swizzle),
            recv_slot=recv[0], recv_offset=recv[1], scales_slot=scales[0], scales_offset=scales[1],
            src_slot=src[0], src_offset=src[1], table_slot=table[0], table_offset=table[1],
            group_slot=group[0], group_offset=group[1],
            send_rows=_i32(h.send_rows), expert_counts=_i32(call.expert_counts),
            expert_offsets=_i32(call.expert_offsets))
        code = context.lib.symcomm_ep_dispatch(context.ctx, ctypes.byref(a), stream)
        if code:
            context.check("MoE dispatch launch", code)


class PushCombinePath(_EpPushPath):
    ops = frozenset({COMBINE_OP})
    CODE = CAPTURE_CODES["ep-combine"]

    def why_not(self, call: CombineCall) -> str | None:
        h = call.handle
        problem = _shape_rules(h.dtype, h.hidden, call.quant, h.topk)
        if problem is None and h.hidden % 8:
            problem = f"hidden {h.hidden} is not a multiple of 8 (the sum adds 8 values per thread)"
        return problem or self._unmapped([("handle.returned", h.returned)])

    def run(self, call: CombineCall) -> None:
        context, h = self._context, call.handle
        session = context.session()
        stream, (y,), _ = context.launch_inputs(session, (call.expert_out,))
        returned = self._where(h.returned, session, self.CODE)
        out = call.out if call.out.data_ptr() % 16 == 0 else torch.empty_like(call.out)
        a = _native.EpCombineArgs(
            expert_out=y.data_ptr(), dtype=_native.DTYPE_CODES[y.dtype], cols=h.hidden, capacity=h.capacity,
            quant=_native.EP_QUANT_CODES[call.quant], recv_group=_i32(h.recv_group),
            num_local=h.num_experts // h.world,
            returned_slot=returned[0], returned_offset=returned[1], max_tokens=h.max_tokens, topk=h.topk,
            rows=h.tokens, send_rows=_i32(h.send_rows), topk_ids=h.topk_ids.data_ptr(),
            ids_int64=int(h.topk_ids.dtype == torch.int64), out=out.data_ptr())
        code = context.lib.symcomm_ep_combine(context.ctx, ctypes.byref(a), stream)
        if code:
            context.check("MoE combine launch", code)
        if out is not call.out:
            call.out.copy_(out)


def _shape_rules(dtype: torch.dtype, hidden: int, quant: str | None, topk: int) -> str | None:
    """Why the kernels cannot take rows of this dtype and hidden size, or None: equal on every
    rank (they follow from the call's shapes), so every rank decides alike."""
    if topk > _native.EP_MAX_TOPK:
        return f"top-{topk} exceeds the kernels' {_native.EP_MAX_TOPK} slots"
    if quant is None and hidden * dtype.itemsize % 16:
        return f"a row of {hidden * dtype.itemsize} bytes is not whole 16-byte vectors"
    if quant == "fp8" and hidden % fp8.BLOCK:
        return f"FP8 blocks need hidden to be a multiple of {fp8.BLOCK}"
    return None
