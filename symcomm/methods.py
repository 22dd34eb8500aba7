"""The Communicator's public operation methods: each is its operation's descriptor run the one way
(Communicator._run: validate once -> choose -> check mode -> run), or, under torch.compile and
whenever autograd records the call (a tensor argument requires grad, grad mode on), the
descriptor's torch.library op, which carries its backward (symcomm/operations/autograd.py). The
arguments are documented here; their rules live in the descriptors (symcomm/operations/)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .operations import (ALL_GATHER, ALL_GATHERV, ALL_GATHERV_FP4, ALL_REDUCE, ALL_REDUCE_RMSNORM, REDUCE_SCATTER,
                         REDUCE_SCATTERV)
from .operations.all_gatherv_fp4 import Fp4Gathered
from .operations.autograd import records
from .rmsnorm import NormedResult

_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


class OperationMethods:
    """Mixed into Communicator, which provides ``_run``."""

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None, op: str = "sum",
                   algo: str = "auto") -> torch.Tensor:
        """Reduce ``x`` over all ranks into ``out`` (a new tensor, or ``x`` itself for in place)."""
        if _is_compiling() or (getattr(x, "requires_grad", False) and _grad_enabled()):  # records(x), inline
            return ALL_REDUCE.compiled(self, x, out, op, algo)
        return self._run(ALL_REDUCE, (x, out, op), algo).outputs[0]

    def all_gather(self, x: torch.Tensor, out: torch.Tensor | None = None, algo: str = "auto") -> torch.Tensor:
        """Concatenate every rank's ``x`` along dim 0, in rank order."""
        if _is_compiling() or (getattr(x, "requires_grad", False) and _grad_enabled()):  # records(x), inline
            return ALL_GATHER.compiled(self, x, out, algo)
        return self._run(ALL_GATHER, (x, out), algo).outputs[0]

    def all_gatherv(self, tensors: torch.Tensor | Sequence[torch.Tensor], sizes: Sequence[int],
                    out: torch.Tensor | Sequence[torch.Tensor] | None = None,
                    algo: str = "auto") -> torch.Tensor | list[torch.Tensor]:
        """Gather rows with per-rank counts ``sizes`` (zeros allowed); several tensors share one
        NCCL group. Returns a tensor for a tensor, a list for a list."""
        if _is_compiling() or records(tensors):
            return ALL_GATHERV.compiled(self, tensors, sizes, out, algo)
        return ALL_GATHERV.result(self._run(ALL_GATHERV, (tensors, sizes, out), algo))

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor | None = None, op: str = "sum",
                       algo: str = "auto") -> torch.Tensor:
        """Reduce ``x`` over ranks; rank r keeps rows [r*n, (r+1)*n) with n = x.shape[0] / world."""
        if _is_compiling() or (getattr(x, "requires_grad", False) and _grad_enabled()):  # records(x), inline
            return REDUCE_SCATTER.compiled(self, x, out, op, algo)
        return self._run(REDUCE_SCATTER, (x, out, op), algo).outputs[0]

    def reduce_scatterv(self, x: torch.Tensor, sizes: Sequence[int], out: torch.Tensor | None = None,
                        op: str = "sum", algo: str = "auto") -> torch.Tensor:
        """Reduce ``x`` (sum(sizes) rows) over ranks; rank r keeps its ``sizes[r]`` rows."""
        if _is_compiling() or (getattr(x, "requires_grad", False) and _grad_enabled()):  # records(x), inline
            return REDUCE_SCATTERV.compiled(self, x, sizes, out, op, algo)
        return self._run(REDUCE_SCATTERV, (x, sizes, out, op), algo).outputs[0]

    def all_gatherv_fp4(self, x: torch.Tensor, sizes: Sequence[int], global_scale: float | torch.Tensor,
                        extra: Sequence[torch.Tensor] = (), dequantize: bool = False, algo: str = "auto", *,
                        swizzle: bool = False, out: Fp4Gathered | None = None) -> Fp4Gathered:
        """NVFP4-quantize this rank's rows ``x`` [sizes[rank], H] with ``global_scale`` (the same on
        every rank: ``symcomm.fp4.global_scale_for(x, comm)``) and gather every rank's payload,
        scales and ``extra`` tensors; ``dequantize`` adds the decoded rows, ``swizzle`` the GEMM
        layout of the scales, ``out`` preallocated outputs (symcomm/operations/all_gatherv_fp4.py)."""
        if _is_compiling() or records(x, extra):
            return ALL_GATHERV_FP4.compiled(self, x, sizes, global_scale, extra, dequantize, swizzle, out, algo)
        return ALL_GATHERV_FP4.result(self._run(ALL_GATHERV_FP4,
                                                (x, sizes, global_scale, extra, dequantize, swizzle, out), algo))

    def all_reduce_rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
                           eps: float = 1e-6, out: Any = None, residual_out: torch.Tensor | None = None,
                           quant: str | None = None, scale: float | torch.Tensor | None = None,
                           swizzle: bool = False, algo: str = "auto") -> NormedResult:
        """h = all_reduce(x) + residual and y = rmsnorm(h) * weight, optionally quantized ("fp8" or
        "nvfp4" with ``scale``): arguments and rules in symcomm/rmsnorm.py's check_args, paths
        and ``algo=`` in symcomm/operations/all_reduce_rmsnorm.py. Returns NormedResult(y, h, scales)."""
        if _is_compiling() or records(x, weight, residual):
            return ALL_REDUCE_RMSNORM.compiled(self, x, weight, residual, eps, out, residual_out, quant, scale,
                                               swizzle, algo)
        return ALL_REDUCE_RMSNORM.result(self._run(ALL_REDUCE_RMSNORM, (x, weight, residual, eps, out, residual_out,
                                                                        quant, scale, swizzle), algo))
