"""NVFP4 codec: quantize rows to e2m1 codes with one e4m3 scale per 16 values, and back.

The format (``quantize_reference`` defines it; the CUDA kernels in csrc/fp4.cu match it bit for
bit, which tests check through the kernels' host entry points):

- ``x`` is [N, H] bf16, fp16 or fp32 with H a positive multiple of 16; all math is in fp32.
- ``global_scale`` is a positive finite number, rounded to fp32. It may be a Python number or a
  1-element float32 tensor on x's device; the kernels read the tensor on the device, so a
  scale computed on the GPU costs no host sync and the call can be captured in a CUDA graph.
- Per block of 16 consecutive values along H:
  ``amax = max |x|``, ``s = global_scale * amax / 6`` (fp32, multiply then divide),
  ``scale = e4m3(min(s, 448))`` (round to nearest even, subnormals kept). The clamp is part of
  the format: e4m3fn has no infinity, and torch's cast does not saturate.
- Each value becomes ``q = x * inv`` with ``inv = min(global_scale / scale, FLT_MAX)`` (one fp32
  division per block, then one multiply per value), or ``inv = 0`` when the scale is 0, so a
  block whose scale underflows encodes as zeros instead of dividing by zero.
- ``q`` is rounded to the e2m1 grid 0, .5, 1, 1.5, 2, 3, 4, 6 (codes 0..7), ties to the even
  code, magnitudes above 6 (and infinities) saturate to 6; bit 3 is the sign. A value that
  rounds to zero is code 0, never 8 (-0): one encoding per value, so payloads compare bitwise.
- Non-finite input: a block holding NaN gets a NaN scale (0x7F) and all codes 0; an infinity
  saturates its block's scale to 448 and itself to +-6.
- Packing: byte j of a row holds element 2j in its low nibble and 2j+1 in its high nibble.
  ``packed`` is uint8 [N, H/2]; ``scales`` is float8_e4m3fn [N, H/16] (linear layout), or with
  ``swizzle=True`` the 128x4 interleaved layout of block-scaled GEMMs (``swizzle_scales``).
- Dequantize: ``value(code) * (scale / global_scale)`` in fp32, rounded to nearest even in the
  output dtype. Code 8 decodes to -0.0.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import struct
from collections.abc import Sequence

import torch

from . import _native, validate
from .base import raw_stream
from .errors import ArgumentError, DtypeError, SymcommError

BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Codes 0..7; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Round-to-nearest-even on the e2m1 grid as thresholds on |q|: the midpoint between two grid
# values goes to the even code, so each threshold is strict (">") where the code below it is
# even and inclusive (">=") where the code above it is.
_E2M1_ROUNDING = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                  (5.0, False))
_FLT_MAX = torch.finfo(torch.float32).max

GlobalScale = float | torch.Tensor


# ------------------------------------------------------------------------------ arguments
def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the swizzled layout of an [rows, cols] scale matrix: rows padded to 128,
    columns to 4, as block-scaled GEMMs read whole 128x4 tiles."""
    return _round_up(rows, 128), _round_up(cols, 4)


def check_rows(x: object, name: str = "x") -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise ArgumentError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise DtypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    if x.ndim != 2:
        raise ArgumentError(f"{name} must be 2-D [rows, H], got shape {tuple(x.shape)}")
    n, h = x.shape
    if h <= 0 or h % BLOCK:
        raise ArgumentError(f"{name}.shape[1] (H = {h}) must be a positive multiple of {BLOCK}")
    if not x.is_contiguous():
        raise ArgumentError(f"{name} must be contiguous (call .contiguous() first)")
    return n, h


def _fp32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def check_global_scale(global_scale: object, device: torch.device, name: str = "global_scale") -> GlobalScale:
    """The validated global scale: a Python float (rounded to fp32), or a 1-element float32
    tensor on ``device``. A CUDA tensor's value is not checked: that would need a host sync."""
    if isinstance(global_scale, torch.Tensor):
        if global_scale.dtype != torch.float32:
            raise DtypeError(f"{name} must be a float32 tensor, got {global_scale.dtype}")
        if global_scale.numel() != 1:
            raise ArgumentError(f"{name} must have one element, got shape {tuple(global_scale.shape)}")
        if global_scale.device != device:
            raise ArgumentError(f"{name} is on {global_scale.device}, but the data is on {device}")
        if global_scale.device.type == "cpu":
            _check_value(float(global_scale.item()), name)
        return global_scale
    as_float = validate.real(global_scale)
    if as_float is None:
        raise ArgumentError(f"{name} must be a float or a 1-element float32 tensor, got {type(global_scale).__name__}")
    value = _fp32(as_float) if math.isfinite(as_float) else as_float
    _check_value(value, name)
    return value


def _check_value(value: float, name: str) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ArgumentError(f"{name} must be finite and > 0 in float32, got {value}")


def scale_tensor(gs: GlobalScale, device: torch.device | str = "cpu") -> torch.Tensor:
    """0-dim fp32 on ``device`` for the references. On the tensors' own device, not as a CPU
    scalar: torch divides a CUDA tensor by a CPU scalar as a multiply by its reciprocal, which
    is one unit in the last place off the kernels' fp32 division for some values."""
    t = gs.reshape(()) if isinstance(gs, torch.Tensor) else torch.tensor(gs, dtype=torch.float32)
    return t.to(device)


def scales_shape(n: int, h: int, swizzled: bool) -> tuple[int, int]:
    return swizzled_shape(n, h // BLOCK) if swizzled else (n, h // BLOCK)


def _check_quantized(packed: object, scales: object, swizzled: bool) -> tuple[int, int]:
    if not isinstance(packed, torch.Tensor):
        raise ArgumentError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise DtypeError(f"packed must be uint8, got {packed.dtype}")
    if packed.ndim != 2 or packed.shape[1] == 0 or packed.shape[1] % (BLOCK // 2):
        raise ArgumentError(f"packed must be 2-D [rows, H/2] with H a positive multiple of {BLOCK}, "
                            f"got shape {tuple(packed.shape)}")
    if not packed.is_contiguous():
        raise ArgumentError("packed must be contiguous")
    n, h = packed.shape[0], packed.shape[1] * 2
    if not isinstance(scales, torch.Tensor):
        raise ArgumentError(f"scales must be a torch.Tensor, got {type(scales).__name__}")
    validate.given("scales", scales, scales_shape(n, h, swizzled), torch.float8_e4m3fn, packed.device)
    return n, h


def _check_dtype(dtype: object) -> torch.dtype:
    if dtype not in FLOAT_DTYPES:
        raise DtypeError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
    return dtype


# ------------------------------------------------------------------------------ reference
def _e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    a = q.abs()
    code = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for threshold, inclusive in _E2M1_ROUNDING:
        code += (a >= threshold) if inclusive else (a > threshold)
    # Only a non-zero magnitude carries the sign: -0 and tiny negatives become code 0.
    return code | ((q < 0) & (code > 0)).to(torch.uint8) * 8


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize_reference(x: torch.Tensor, global_scale: GlobalScale,
                       swizzle: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's definition in plain torch (any device, slow): (packed, scales)."""
    n, h = check_rows(x)
    gs = scale_tensor(check_global_scale(global_scale, x.device), x.device)
    xf = x.float().reshape(n, h // BLOCK, BLOCK)
    amax = xf.abs().amax(dim=-1)  # NaN propagates
    s = (gs * amax / torch.full_like(amax, E2M1_MAX)).clamp(max=E4M3_MAX)  # a tensor divisor: see scale_tensor
    scales = s.to(torch.float8_e4m3fn)
    sf = scales.float()
    inv = torch.where(sf > 0, (gs / sf).clamp(max=_FLT_MAX), 0.0)
    codes = _e2m1_codes(xf * inv.unsqueeze(-1))
    codes = torch.where(sf.isnan().unsqueeze(-1), 0, codes).to(torch.uint8)
    packed = _pack(codes.reshape(n, h))
    return packed, swizzle_scales(scales) if swizzle else scales


def dequantize_reference(packed: torch.Tensor, scales: torch.Tensor, global_scale: GlobalScale,
                         dtype: torch.dtype = torch.bfloat16, swizzled: bool = False) -> torch.Tensor:
    """Inverse of quantize_reference, in plain torch: [rows, H] of ``dtype``."""
    n, h = _check_quantized(packed, scales, swizzled)
    dtype = _check_dtype(dtype)
    gs = scale_tensor(check_global_scale(global_scale, packed.device), packed.device)
    if swizzled:
        scales = unswizzle_scales(scales, n, h // BLOCK)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(n, h // BLOCK, BLOCK).long()
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = table[codes & 7]
    values = torch.where(codes >= 8, -values, values)
    k = scales.float() / gs
    return (values * k.unsqueeze(-1)).reshape(n, h).to(dtype)


# ------------------------------------------------------------------------------ layouts
def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """[rows, cols] linear scales -> the 128x4 interleaved layout, shape ``swizzled_shape``.

    Rows are padded with zero scales to a multiple of 128 and columns to a multiple of 4: the
    GEMMs read whole tiles of 128 rows x 4 scales (64 values of K). Tiles are laid out
    row-tile-major, 512 bytes each; inside a tile, scale (r, c) sits at byte
    ``(r % 32) * 16 + (r // 32) * 4 + c``, so one 16-byte line holds rows r, r+32, r+64, r+96.
    """
    if not isinstance(scales, torch.Tensor) or scales.ndim != 2:
        raise ArgumentError("scales must be a 2-D tensor [rows, H/16]")
    rows, cols = scales.shape
    prows, pcols = swizzled_shape(rows, cols)
    raw = scales.view(torch.uint8) if scales.dtype.itemsize == 1 else None
    if raw is None:
        raise DtypeError(f"scales must be a 1-byte dtype (float8_e4m3fn), got {scales.dtype}")
    padded = torch.zeros((prows, pcols), dtype=torch.uint8, device=scales.device)
    padded[:rows, :cols] = raw
    tiles = padded.view(prows // 128, 4, 32, pcols // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(prows, pcols).view(scales.dtype)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of swizzle_scales: the [rows, cols] linear scales, padding dropped."""
    if not isinstance(swizzled, torch.Tensor) or swizzled.dtype.itemsize != 1:
        raise ArgumentError("swizzled must be a tensor of a 1-byte dtype (float8_e4m3fn)")
    prows, pcols = swizzled_shape(rows, cols)
    if tuple(swizzled.shape) != (prows, pcols):
        raise ArgumentError(f"swizzled has shape {tuple(swizzled.shape)}, expected {(prows, pcols)} "
                            f"for {rows} x {cols} scales")
    raw = swizzled.contiguous().view(torch.uint8)
    tiles = raw.view(prows // 128, pcols // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(prows, pcols)[:rows, :cols].contiguous().view(swizzled.dtype)


# ------------------------------------------------------------------------------ global scale
def global_scale_for(x: torch.Tensor, comm=None) -> torch.Tensor:
    """``448 * 6 / amax(|x|)`` as a 1-element float32 tensor on x's device (no host sync).

    Why this value: the block holding the tensor's largest magnitude then gets scale 448, the
    top of e4m3's range, so no block scale saturates and the largest blocks keep e4m3's full
    relative precision. Blocks below amax * 2^-9 / 448 get subnormal or zero scales. An amax of
    0 or a non-finite amax gives 1.0.

    Every rank of a gather must quantize with the same global scale, or receivers would
    dequantize peers' rows with the wrong one: pass ``comm`` to take the max of amax over its
    ranks (a collective: every rank calls it, zero-row ranks too).
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        error = DtypeError("x must be a bfloat16, float16 or float32 tensor")
        if comm is not None:
            validate.communicator_key(comm)
            comm.refused(error)  # the peers wait in the all-reduce below: they learn why
        raise error
    if x.numel():
        amax = x.detach().abs().amax().float().reshape(1)
    else:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    if comm is not None:
        amax = comm.all_reduce(amax, op="max")
    gs = (E4M3_MAX * E2M1_MAX) / amax
    return torch.where(torch.isfinite(gs) & (gs > 0), gs, torch.ones_like(gs))


# ------------------------------------------------------------------------------ native
_NATIVE: list = []  # [lib or None, reason], filled once


def native_lib() -> ctypes.CDLL | None:
    if not _NATIVE:
        try:
            _NATIVE[:] = [_native.load().lib, None]
        except OSError as exc:  # not built, or built before csrc/fp4.cu existed
            _NATIVE[:] = [None, str(exc)]
    return _NATIVE[0]


def native_available() -> tuple[bool, str | None]:
    """Whether csrc/fp4.cu's kernels are loaded, and if not, why."""
    native_lib()
    return _NATIVE[0] is not None, _NATIVE[1]


def _check_rc(lib: ctypes.CDLL, what: str, rc: int) -> None:
    _native.check(lib, what, rc)


def current_stream(device: torch.device) -> int:
    if raw_stream is not None:
        return raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def on_device(device: torch.device):
    """Kernels launch on the current device: switch only when the tensor lives elsewhere."""
    return _SAME_DEVICE if device.index == torch.cuda.current_device() else torch.cuda.device(device)


_SAME_DEVICE = contextlib.nullcontext()


def launch_scale(gs: GlobalScale) -> tuple[int | None, float]:
    return (gs.data_ptr(), 0.0) if isinstance(gs, torch.Tensor) else (None, gs)


# ------------------------------------------------------------------------------ public codec
def quantize(x: torch.Tensor, global_scale: GlobalScale, swizzle: bool = False, *,
             out: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize ``x`` [N, H]: (packed uint8 [N, H/2], scales float8_e4m3fn [N, H/16]).

    With ``swizzle=True`` the scales come in the 128x4 GEMM layout (``swizzled_shape``). CUDA
    tensors run csrc/fp4.cu's kernel (one pass) on the current stream; CPU tensors, or CUDA
    ones when the native library is missing, run the torch reference. Outputs are allocated
    with torch.empty, so inside ``use_symmetric_memory`` they land in symmetric memory; or
    pass ``out=(packed, scales)``.
    """
    n, h = check_rows(x)
    s_shape = scales_shape(n, h, validate.flag("swizzle", swizzle))
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ArgumentError("out must be a (packed, scales) pair")
        packed = validate.destination("out[0]", out[0], (n, h // 2), torch.uint8, x.device)
        scales = validate.destination("out[1]", out[1], s_shape, torch.float8_e4m3fn, x.device)
    if torch.compiler.is_compiling():
        # Dynamo cannot trace a ctypes launch: the codec is a torch.library op there.
        got = _quantize_op(x, *_scale_args(global_scale), swizzle)
        return got if out is None else (packed.copy_(got[0]), scales.copy_(got[1]))
    gs = check_global_scale(global_scale, x.device)
    if out is None:
        packed = torch.empty((n, h // 2), dtype=torch.uint8, device=x.device)
        scales = torch.empty(s_shape, dtype=torch.float8_e4m3fn, device=x.device)
    else:  # eager only: a traced tensor has no address, and the traced op writes fresh outputs
        validate.apart([("x", x)], [("out[0]", packed), ("out[1]", scales)], "fp4.quantize", 0)
    lib = native_lib() if x.is_cuda else None
    if lib is None:
        ref_packed, ref_scales = quantize_reference(x, gs, swizzle)
        packed.copy_(ref_packed)
        scales.view(torch.uint8).copy_(ref_scales.view(torch.uint8))
        return packed, scales
    gs_ptr, gs_value = launch_scale(gs)
    with on_device(x.device):
        rc = lib.symcomm_fp4_quantize(x.data_ptr(), _native.DTYPE_CODES[x.dtype], n, h, gs_ptr, gs_value,
                                      packed.data_ptr(), scales.data_ptr(), int(swizzle), current_stream(x.device))
    _check_rc(lib, "symcomm_fp4_quantize", rc)
    return packed, scales


def dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: GlobalScale,
               dtype: torch.dtype = torch.bfloat16, *, swizzled: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode ``packed`` [N, H/2] with ``scales`` (linear, or ``swizzled=True``) into [N, H]."""
    n, h = _check_quantized(packed, scales, validate.flag("swizzled", swizzled))
    dtype = _check_dtype(dtype)
    if out is not None:
        out = validate.destination("out", out, (n, h), dtype, packed.device)
    if torch.compiler.is_compiling():
        decoded = _dequantize_op(packed, scales, *_scale_args(global_scale), dtype, swizzled)
        return decoded if out is None else out.copy_(decoded)
    gs = check_global_scale(global_scale, packed.device)
    if out is None:
        out = torch.empty((n, h), dtype=dtype, device=packed.device)
    else:
        validate.apart([("packed", packed), ("scales", scales)], [("out", out)], "fp4.dequantize", 0)
    lib = native_lib() if packed.is_cuda else None
    if lib is None:
        return out.copy_(dequantize_reference(packed, scales, gs, dtype, swizzled))
    gs_ptr, gs_value = launch_scale(gs)
    with on_device(packed.device):
        rc = lib.symcomm_fp4_dequantize(packed.data_ptr(), scales.data_ptr(), n, h, gs_ptr, gs_value, int(swizzled),
                                        out.data_ptr(), _native.DTYPE_CODES[dtype], current_stream(packed.device))
    _check_rc(lib, "symcomm_fp4_dequantize", rc)
    return out


def _scale_args(global_scale: GlobalScale) -> tuple[torch.Tensor | None, float]:
    """The global scale as a torch.library op takes it: a tensor, or a number."""
    if isinstance(global_scale, torch.Tensor):
        return global_scale, 0.0
    return None, float(global_scale)


# The codec under torch.compile: each op's body is the eager function (validation included).
@torch.library.custom_op("symcomm::fp4_quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, scale_tensor: torch.Tensor | None, scale_value: float,
                 swizzle: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize(x, scale_tensor if scale_tensor is not None else scale_value, swizzle)


@_quantize_op.register_fake
def _(x, scale_tensor, scale_value, swizzle):
    n, h = x.shape
    return (x.new_empty((n, h // 2), dtype=torch.uint8),
            x.new_empty(scales_shape(n, h, swizzle), dtype=torch.float8_e4m3fn))


@torch.library.custom_op("symcomm::fp4_dequantize", mutates_args=())
def _dequantize_op(packed: torch.Tensor, scales: torch.Tensor, scale_tensor: torch.Tensor | None,
                   scale_value: float, dtype: torch.dtype, swizzled: bool) -> torch.Tensor:
    return dequantize(packed, scales, scale_tensor if scale_tensor is not None else scale_value, dtype,
                      swizzled=swizzled)


@_dequantize_op.register_fake
def _(packed, scales, scale_tensor, scale_value, dtype, swizzled):
    return packed.new_empty((packed.shape[0], packed.shape[1] * 2), dtype=dtype)


# ------------------------------------------------------------------------------ host entries
def host_lib() -> ctypes.CDLL:
    lib = native_lib()
    if lib is None:
        raise SymcommError(f"csrc/fp4.cu is not loaded: {_NATIVE[1]}")
    return lib


def quantize_host(x: torch.Tensor, global_scale: float, swizzle: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """csrc/fp4.cu's per-block code run on the CPU, for CPU tensors. It exists so that machines
    without a GPU can check the kernel's math against ``quantize_reference``."""
    n, h = check_rows(x)
    if x.device.type != "cpu":
        raise ArgumentError(f"x must be on the CPU for quantize_host, got {x.device}")
    gs = check_global_scale(global_scale, x.device)
    gs = float(gs.item()) if isinstance(gs, torch.Tensor) else gs
    packed = torch.empty((n, h // 2), dtype=torch.uint8)
    scales = torch.empty(scales_shape(n, h, swizzle), dtype=torch.float8_e4m3fn)
    lib = host_lib()
    _check_rc(lib, "symcomm_fp4_quantize_host", lib.symcomm_fp4_quantize_host(
        x.data_ptr(), _native.DTYPE_CODES[x.dtype], n, h, gs, packed.data_ptr(), scales.data_ptr(), int(swizzle)))
    return packed, scales


def dequantize_host(packed: torch.Tensor, scales: torch.Tensor, global_scale: float,
                    dtype: torch.dtype = torch.bfloat16, swizzled: bool = False) -> torch.Tensor:
    """csrc/fp4.cu's decoder run on the CPU (see quantize_host)."""
    n, h = _check_quantized(packed, scales, swizzled)
    if packed.device.type != "cpu":
        raise ArgumentError(f"packed must be on the CPU for dequantize_host, got {packed.device}")
    dtype = _check_dtype(dtype)
    gs = check_global_scale(global_scale, packed.device)
    gs = float(gs.item()) if isinstance(gs, torch.Tensor) else gs
    out = torch.empty((n, h), dtype=dtype)
    lib = host_lib()
    _check_rc(lib, "symcomm_fp4_dequantize_host", lib.symcomm_fp4_dequantize_host(
        packed.data_ptr(), scales.data_ptr(), n, h, gs, int(swizzled), out.data_ptr(), _native.DTYPE_CODES[dtype]))
    return out
