"""The Communicator's public operation methods: each is its operation's descriptor run the one way
(Communicator._run: validate once -> choose -> check mode -> run), or, under torch.compile and
whenever autograd records the call (a tensor argument or out= requires grad, grad mode on), the
descriptor's torch.library op, which carries its backward (symcomm/operations/autograd.py); a
recorded call is validated as an eager one first (OperationMethods._recorded). The
arguments are documented here; their rules live in the descriptors (symcomm/operations/)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import validate
from .operations import (ALL_GATHER, ALL_GATHERV, ALL_GATHERV_FP4, ALL_REDUCE, ALL_REDUCE_RMSNORM, ALL_TO_ALLV,
                         MOE_COMBINE, MOE_DISPATCH, REDUCE_SCATTER, REDUCE_SCATTERV, Operation)
from .errors import CommClosedError
from .operations.all_gatherv_fp4 import Fp4Gathered
from .operations.autograd import records
from .operations.moe_dispatch import Dispatched, EpHandle
from .rmsnorm import NormedResult

_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


class OperationMethods:
    """Mixed into Communicator, which provides ``_run``, ``router`` and ``refused``."""

    def _recorded(self, operation: Operation, args: tuple, algo: str, kwargs: dict[str, Any] | None = None) -> Any:
        """A call autograd records runs as its torch.library op, whose schema would refuse a
        non-string argument with torch's own error, whose functional ``out=`` would take any
        broadcastable shape or dtype, and whose copy into an ``out=`` that is a leaf requiring
        grad fails after the collective: _run's argument checks and that rule come first, so the
        call gets eager's errors (and check mode's refusal) before any communication. The Call
        built here is dropped (the op builds its own, without ``out=``), so ``algo`` is checked by
        name only: whether that path can serve depends on where the op's output lands, and the
        op's own eager run asks it. A recorded call is thus validated twice."""
        kwargs = kwargs or {}
        try:
            if self.closed:
                raise CommClosedError("this Communicator is closed")
            call = operation.build(self, *args, **kwargs)
            validate.recordable(call.named_outputs())
            self.router.check_algo(operation, call, algo)
        except Exception as exc:
            self.refused(exc)
            raise
        return operation.compiled(self, *args, algo=algo, **kwargs)

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None, op: str = "sum",
                   algo: str = "auto") -> torch.Tensor:
        """Reduce ``x`` over all ranks into ``out`` (a new tensor, or ``x`` itself for in place)."""
        if _is_compiling():
            return ALL_REDUCE.compiled(self, x, out, op, algo)
        if (getattr(x, "requires_grad", False) or getattr(out, "requires_grad", False)) and _grad_enabled():
            return self._recorded(ALL_REDUCE, (x, out, op), algo)
        return self._run(ALL_REDUCE, (x, out, op), algo).outputs[0]

    def all_gather(self, x: torch.Tensor, out: torch.Tensor | None = None, algo: str = "auto") -> torch.Tensor:
        """Concatenate every rank's ``x`` along dim 0, in rank order."""
        if _is_compiling():
            return ALL_GATHER.compiled(self, x, out, algo)
        if (getattr(x, "requires_grad", False) or getattr(out, "requires_grad", False)) and _grad_enabled():
            return self._recorded(ALL_GATHER, (x, out), algo)
        return self._run(ALL_GATHER, (x, out), algo).outputs[0]

    def all_gatherv(self, tensors: torch.Tensor | Sequence[torch.Tensor], sizes: Sequence[int],
                    out: torch.Tensor | Sequence[torch.Tensor] | None = None,
                    algo: str = "auto") -> torch.Tensor | list[torch.Tensor]:
        """Gather rows with per-rank counts ``sizes`` (zeros allowed); several tensors share one
        NCCL group. Returns a tensor for a tensor, a list for a list."""
        if _is_compiling():
            return ALL_GATHERV.compiled(self, tensors, sizes, out, algo)
        if records(tensors, out):
            return self._recorded(ALL_GATHERV, (tensors, sizes, out), algo)
        return ALL_GATHERV.result(self._run(ALL_GATHERV, (tensors, sizes, out), algo))

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor | None = None, op: str = "sum",
                       algo: str = "auto") -> torch.Tensor:
        """Reduce ``x`` over ranks; rank r keeps rows [r*n, (r+1)*n) with n = x.shape[0] / world."""
        if _is_compiling():
            return REDUCE_SCATTER.compiled(self, x, out, op, algo)
        if (getattr(x, "requires_grad", False) or getattr(out, "requires_grad", False)) and _grad_enabled():
            return self._recorded(REDUCE_SCATTER, (x, out, op), algo)
        return self._run(REDUCE_SCATTER, (x, out, op), algo).outputs[0]

    def reduce_scatterv(self, x: torch.Tensor, sizes: Sequence[int], out: torch.Tensor | None = None,
                        op: str = "sum", algo: str = "auto") -> torch.Tensor:
        """Reduce ``x`` (sum(sizes) rows) over ranks; rank r keeps its ``sizes[r]`` rows."""
        if _is_compiling():
            return REDUCE_SCATTERV.compiled(self, x, sizes, out, op, algo)
        if (getattr(x, "requires_grad", False) or getattr(out, "requires_grad", False)) and _grad_enabled():
            return self._recorded(REDUCE_SCATTERV, (x, sizes, out, op), algo)
        return self._run(REDUCE_SCATTERV, (x, sizes, out, op), algo).outputs[0]

    def all_gatherv_fp4(self, x: torch.Tensor, sizes: Sequence[int], global_scale: float | torch.Tensor,
                        extra: Sequence[torch.Tensor] = (), dequantize: bool = False, algo: str = "auto", *,
                        swizzle: bool = False, out: Fp4Gathered | None = None) -> Fp4Gathered:
        """NVFP4-quantize this rank's rows ``x`` [sizes[rank], H] with ``global_scale`` (the same on
        every rank: ``symcomm.fp4.global_scale_for(x, comm)``) and gather every rank's payload,
        scales and ``extra`` tensors; ``dequantize`` adds the decoded rows, ``swizzle`` the GEMM
        layout of the scales, ``out`` preallocated outputs (symcomm/operations/all_gatherv_fp4.py)."""
        if _is_compiling():
            return ALL_GATHERV_FP4.compiled(self, x, sizes, global_scale, extra, dequantize, swizzle, out, algo)
        if records(x, extra, out):
            return self._recorded(ALL_GATHERV_FP4, (x, sizes, global_scale, extra, dequantize, swizzle, out), algo)
        return ALL_GATHERV_FP4.result(self._run(ALL_GATHERV_FP4,
                                                (x, sizes, global_scale, extra, dequantize, swizzle, out), algo))

    def all_reduce_rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
                           eps: float = 1e-6, out: Any = None, residual_out: torch.Tensor | None = None,
                           quant: str | None = None, scale: float | torch.Tensor | None = None,
                           swizzle: bool = False, algo: str = "auto") -> NormedResult:
        """h = all_reduce(x) + residual and y = rmsnorm(h) * weight, optionally quantized ("fp8" or
        "nvfp4" with ``scale``): arguments and rules in symcomm/rmsnorm.py's check_args, paths
        and ``algo=`` in symcomm/operations/all_reduce_rmsnorm.py. Returns NormedResult(y, h, scales)."""
        if _is_compiling():
            return ALL_REDUCE_RMSNORM.compiled(self, x, weight, residual, eps, out, residual_out, quant, scale,
                                               swizzle, algo)
        if records(x, weight, residual, out, residual_out):
            return self._recorded(ALL_REDUCE_RMSNORM, (x, weight, residual, eps, out, residual_out, quant, scale,
                                                       swizzle), algo)
        return ALL_REDUCE_RMSNORM.result(self._run(ALL_REDUCE_RMSNORM, (x, weight, residual, eps, out, residual_out,
                                                                        quant, scale, swizzle), algo))

    def all_to_allv(self, tensors: torch.Tensor | Sequence[torch.Tensor], send_sizes: Sequence[int],
                    recv_sizes: Sequence[int], out: torch.Tensor | Sequence[torch.Tensor] | None = None,
                    algo: str = "auto") -> torch.Tensor | list[torch.Tensor]:
        """Send ``send_sizes[p]`` consecutive rows of each tensor to rank p and receive
        ``recv_sizes[p]`` from it, in rank order (zeros allowed; several tensors in one call).
        Rank r's ``send_sizes[p]`` must equal rank p's ``recv_sizes[r]``
        (symcomm/operations/all_to_allv.py)."""
        if _is_compiling():
            return ALL_TO_ALLV.compiled(self, tensors, send_sizes, recv_sizes, out, algo)
        if records(tensors, out):
            return self._recorded(ALL_TO_ALLV, (tensors, send_sizes, recv_sizes, out), algo)
        return ALL_TO_ALLV.result(self._run(ALL_TO_ALLV, (tensors, send_sizes, recv_sizes, out), algo))

    def moe_dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, *,
                 max_tokens: int | None = None, quant: str | None = None,
                 global_scale: float | torch.Tensor | None = None,
                 align: int = 1, swizzle: bool = False, out: Dispatched | None = None,
                 algo: str = "auto") -> Dispatched:
        """MoE expert-parallel dispatch: send each token of ``x`` [tokens, H] to the ranks holding its
        ``topk_ids`` experts (rank p holds experts p*E/W ..), NVFP4- or FP8-quantized on the way
        with ``quant``; the ``topk_weights`` travel with them, for moe_combine. Returns
        Dispatched(x, scales, expert_counts, expert_offsets, handle, global_scale): the received
        rows grouped by local expert, for a grouped GEMM, and the handle moe_combine() needs (it
        keeps ``topk_ids``: leave that tensor as it is until the combine). ``max_tokens`` (the most tokens any rank passes, equal everywhere)
        sizes every buffer; ``out=`` reuses an earlier result's (symcomm/operations/moe_dispatch.py)."""
        if _is_compiling():
            return MOE_DISPATCH.compiled(self, x, topk_ids, topk_weights, num_experts, max_tokens, quant, global_scale,
                                         align, swizzle, out, algo)
        return MOE_DISPATCH.result(self._run(MOE_DISPATCH, (x, topk_ids, topk_weights, num_experts, max_tokens, quant,
                                                            global_scale, align, swizzle, out), algo))

    def moe_combine(self, expert_out: torch.Tensor, handle: EpHandle, *, quant: str | None = None,
                out: torch.Tensor | None = None, algo: str = "auto") -> torch.Tensor:
        """MoE combine: each of this rank's tokens gets the sum over its top-k entries of weight x
        the expert output row (``expert_out`` [capacity, H], in dispatch's layout) that entry
        produced, with the weights dispatch read: each rank adds its entries of the token in slot
        order in fp32 and sends the sum, rounded to the dtype, once; the token's rank adds those in
        rank order. ``quant="fp8"`` sends the sums as block FP8 (symcomm/operations/moe_combine.py)."""
        if _is_compiling():
            return MOE_COMBINE.compiled(self, expert_out, handle, quant, out, algo)
        return MOE_COMBINE.result(self._run(MOE_COMBINE, (expert_out, handle, quant, out), algo))
