"""The fused all-reduce + residual add + RMSNorm kernels (csrc/fused_norm_ar.cu) over the custom
kernels' state: one per all-reduce kernel, launched where the all-reduce alone would run on
that kernel, so the result has the bits of the unfused path with the same all-reduce.

This module knows the kernels' limits and how to launch them; symcomm/fused_norm.py decides
when (its ``Fused`` norm paths) and owns the arguments' validation.
"""
from __future__ import annotations

import torch

from .. import _native, fp4
from ..base import FLAGFREE, ONESHOT, TWOSHOT
from .custom import ALGO_CODES, CAPTURE_CODES, CustomPath

# norm path name -> the all-reduce kernel it fuses
FUSED = {"fused-flagfree": FLAGFREE, "fused-oneshot": ONESHOT, "fused-twoshot": TWOSHOT}
# A row is held in registers: at most 4 vectors of 8 per thread of the norm's 256 (rmsnorm.cuh).
MAX_HIDDEN = 8192
_Y_BYTES = {None: 2, "fp8": 1, "nvfp4": 0.5}  # output bytes per element


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def why_not(custom: CustomPath, x: torch.Tensor, quant: str | None) -> str | None:
    """None if the fused kernel on ``custom``'s all-reduce kernel can take x [tokens, hidden]."""
    tokens, hidden = x.shape
    if hidden % 16 or hidden > MAX_HIDDEN:
        return f"hidden {hidden} is not a multiple of 16 up to {MAX_HIDDEN} (the fused kernels hold a row in registers)"
    state, nbytes = custom.state, x.nbytes
    if custom.name == FLAGFREE:
        return None if nbytes <= state.flagfree_bytes else \
            f"{nbytes} bytes exceeds the flag-free buffer of {state.flagfree_bytes} bytes"
    if nbytes > state.staging_bytes:
        return f"{nbytes} bytes exceeds the staging buffer of {state.staging_bytes} bytes"
    if custom.name == TWOSHOT:
        scratch = _round16(nbytes) + _round16(int(tokens * hidden * _Y_BYTES[quant]))
        scratch += tokens * hidden // 16 if quant == "nvfp4" else 0
        if scratch > state.staging_bytes:
            return (f"two-shot's scratch ({state.staging_bytes} bytes) cannot hold the {scratch} bytes of h, y "
                    f"and scales of this call")
    return None


def run(custom: CustomPath, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
        h: torch.Tensor, quant: str | None, y: torch.Tensor, scales: torch.Tensor | None,
        scale: fp4.GlobalScale | None, swizzle: bool) -> None:
    """One fused launch on the current stream (arguments validated by fused_norm)."""
    state = custom.state
    fused = next(name for name, kernel in FUSED.items() if kernel == custom.name)
    stage, slot, offset, session = custom.input_of(x.data_ptr(), x.nbytes, False, CAPTURE_CODES[fused])
    scale_ptr, scale_value = fp4._scale_args(scale) if scale is not None else (None, 0.0)
    code = state.lib.symcomm_ar_rmsnorm(
        state.ctx, ALGO_CODES[custom.name], _native.DTYPE_CODES[x.dtype], x.data_ptr(), slot, offset, stage,
        None if residual is None else residual.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps,
        h.data_ptr(), _native.NORM_QUANT_CODES[quant], y.data_ptr(), None if scales is None else scales.data_ptr(),
        scale_ptr, scale_value, int(swizzle), state.launch_stream(session))
    if code:
        state.check(f"fused all-reduce + RMSNorm ({custom.name}) launch", code)
