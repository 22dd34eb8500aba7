"""Block FP8 for expert parallelism: what dispatch(quant="fp8") sends and combine(quant="fp8")
returns, defined here in plain torch (csrc/ep.cuh's fp8_scale, fp8_codes8 and fp8_values8, through
csrc/fp8.cuh, match it bit for bit).

- Rows [N, H] of bf16, fp16 or fp32, H a multiple of 128; all math in fp32.
- Per block of 128 consecutive values along H: ``amax = max |x|`` (a NaN wins),
  ``s = amax / 448`` (fp32 division), or ``s = 1`` where that is not > 0 (an all-zero block,
  a NaN block).
- Each value becomes ``e4m3(x / s)``: one fp32 division, saturated to +-448, rounded to
  nearest even; every NaN is encoded 0x7F.
- ``codes`` is float8_e4m3fn [N, H]; ``scales`` float32 [N, H/128], the dequant scales:
  ``x ~= codes.float() * scales`` (one fp32 multiply per value).

One fp32 scale per 128 values is the block size the FP8 MoE GEMMs of DeepSeek-V3-style models
take (1x128 activation blocks), and it keeps the traffic at 1.03 bytes per value.
"""
from __future__ import annotations

import torch

from ..errors import ArgumentError, DtypeError

BLOCK = 128
FP8_MAX = 448.0
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_rows(x: object, name: str = "x") -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise ArgumentError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise DtypeError(f"{name} must be bfloat16, float16 or float32 for FP8, got {x.dtype}")
    if x.ndim != 2 or x.shape[1] % BLOCK or x.shape[1] == 0:
        raise ArgumentError(f"{name} must be 2-D [rows, H] with H a positive multiple of {BLOCK} for FP8 blocks, "
                            f"got shape {tuple(x.shape)}")
    return x.shape[0], x.shape[1]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes float8_e4m3fn [N, H], scales float32 [N, H/128]) of rows ``x``, any device."""
    n, h = check_rows(x)
    xf = x.float().reshape(n, h // BLOCK, BLOCK)
    amax = xf.abs().amax(dim=-1)  # NaN propagates
    # The divisor is a tensor on x's device: torch divides a CUDA tensor by a Python number as a
    # multiply by its reciprocal, one unit in the last place off fp32 division for some amax.
    s = amax / torch.full_like(amax, FP8_MAX)
    s = torch.where(s > 0, s, torch.ones_like(s))
    v = xf / s.unsqueeze(-1)
    # The clamp states the saturation rather than relying on the installed torch's cast (older
    # releases gave NaN above 464); abs() clears a NaN's sign, so every NaN encodes as 0x7F.
    v = torch.where(v.isnan(), v.abs(), v.clamp(-FP8_MAX, FP8_MAX))
    return v.to(torch.float8_e4m3fn).reshape(n, h), s


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``codes.float() * scales`` per block, rounded once to ``dtype``: [N, H]."""
    if codes.dtype != torch.float8_e4m3fn or codes.ndim != 2 or codes.shape[1] % BLOCK:
        raise ArgumentError(f"codes must be float8_e4m3fn [N, H] with H a multiple of {BLOCK}")
    n, h = codes.shape
    if scales.dtype != torch.float32 or tuple(scales.shape) != (n, h // BLOCK):
        raise ArgumentError(f"scales must be float32 [{n}, {h // BLOCK}], got {scales.dtype} {tuple(scales.shape)}")
    return dequantize_float(codes, scales).to(dtype)


def dequantize_float(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values the combine adds: one multiply per value, no rounding to a dtype."""
    n, h = codes.shape
    return (codes.float().reshape(n, h // BLOCK, BLOCK) * scales.unsqueeze(-1)).reshape(n, h)
