"""Residual add + RMSNorm (+ FP8 / NVFP4 output) on one rank: the local half of
Communicator.all_reduce_rmsnorm (symcomm/operations/all_reduce_rmsnorm.py), its argument
rules, its torch reference and its kernel (csrc/rmsnorm.cu) with the kernel's CPU twin.

    h = a + residual                       (the new residual; h = a without one)
    y = h * rsqrt(mean(h^2) + eps) * weight

Rounding contract (csrc/rmsnorm.cuh is the normative text, docs/rmsnorm.md the user's):

- h is rounded to a's dtype before anything uses it: one fp32 add of a (in dtype) and the
  residual, rounded once, as ``a + residual`` in dtype gives.
- The sum of squares and the normalisation run in fp32 from that rounded h, in a fixed order
  (the kernel's: ``THREADS`` partials over 16-byte vectors, a warp butterfly, warps in order)
  that does not depend on any launch grid; y is rounded to the dtype.
- Quantized outputs quantize that rounded y: NVFP4 is bitwise ``fp4.quantize(y, scale)``, FP8
  is bitwise ``(y.float() / scale).to(torch.float8_e4m3fn)`` (saturating to +-448 as torch
  2.13's cast does; every NaN is encoded 0x7F). The FP8 scale is a dequant scale:
  ``y ~= fp8.float() * scale``.
"""
from __future__ import annotations

import ctypes
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import _native, fp4, validate
from .base import Call
from .errors import ArgumentError, DtypeError, shown

OP = "all_reduce_rmsnorm"  # the operation whose arguments these are (and its dispatch table row)
DTYPES = (torch.bfloat16, torch.float16)
QUANTS = ("fp8", "nvfp4")
# The kernel's geometry, which is also the reduction order (csrc/rmsnorm.cuh): 16-byte vectors
# of VEC elements, THREADS partial sums per row, WARPS warps of 32.
VEC = 8
THREADS = 256
WARPS = THREADS // 32
MAX_HIDDEN = 32768  # the kernel's row limit
FP8_MAX = 448.0
_OUT_ALIGN = {None: 16, "fp8": 8, "nvfp4": 4}  # bytes one thread stores per vector


class NormedResult(NamedTuple):
    """What all_reduce_rmsnorm returns."""

    out: torch.Tensor  # y in x's dtype; float8_e4m3fn for quant="fp8"; uint8 NVFP4 codes [tokens, hidden/2]
    residual: torch.Tensor  # h = all_reduce(x) + residual, in x's dtype: the next layer's residual
    scales: torch.Tensor | None  # NVFP4 block scales (float8_e4m3fn, linear or swizzled), else None


class NormCall(Call):
    """A validated all_reduce_rmsnorm call (outputs as given: None means allocate). As a Call it
    is the all-reduce of x it starts with: dispatch ranks it by x's bytes."""

    __slots__ = ("x", "weight", "residual", "eps", "quant", "scale", "swizzle", "out", "scales_out",
                 "residual_out", "y", "y_scales", "h", "inner_algo")

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float,
                 quant: str | None, scale: fp4.GlobalScale | None, swizzle: bool, out: torch.Tensor | None,
                 scales_out: torch.Tensor | None, residual_out: torch.Tensor | None) -> None:
        ptr = x.data_ptr()
        super().__init__(OP, (x,), (), (ptr,), (), None, "sum", x.nbytes)
        self.x, self.weight, self.residual, self.eps = x, weight, residual, eps  # eps rounded to fp32
        self.quant, self.scale, self.swizzle = quant, scale, swizzle
        self.out, self.scales_out, self.residual_out = out, scales_out, residual_out
        # Where y, its NVFP4 block scales and h go: the caller's tensors or new ones (allocate;
        # h stays None where the all-reduce's own buffer will be h, all_reduce_out).
        self.y: torch.Tensor | None = None
        self.y_scales: torch.Tensor | None = None
        self.h: torch.Tensor | None = None
        self.inner_algo = "auto"  # the all-reduce path algo= forced

    def named_outputs(self) -> list[tuple[str, torch.Tensor]]:
        """The caller's outputs, named as the arguments are: out (a pair for NVFP4), residual_out."""
        given = (("out[0]" if self.quant == "nvfp4" else "out", self.out), ("out[1]", self.scales_out),
                 ("residual_out", self.residual_out))
        return [(name, t) for name, t in given if t is not None]

    def all_reduce_out(self) -> torch.Tensor:
        """Where the all-reduce of x lands: a new buffer of x's shape on every rank, never the
        caller's residual_out, even where it could be. Whether a rank passes residual_out, and
        whether in place (residual_out=residual), is its own business (NCCL's rule), so it must
        not decide on one rank alone which memory, pool or ordinary, the inner all-reduce
        writes: that picks its path. Where neither a residual nor residual_out is given, the
        buffer is h itself (build leaves h None). A buffer of its own also lets the kernel
        spread a row over several blocks at decode sizes (csrc/rmsnorm.cuh's row_parts)."""
        return torch.empty_like(self.x)

    @property
    def tokens(self) -> int:
        return self.x.shape[0]

    @property
    def hidden(self) -> int:
        return self.x.shape[1]


# ------------------------------------------------------------------------------ arguments
def _fp32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


def _check_eps(eps: object) -> float:
    as_float = validate.real(eps)  # an int past float's range is inf: refused below as not finite
    if as_float is None:
        raise ArgumentError(f"eps must be a float, got {type(eps).__name__}")
    value = _fp32(as_float) if math.isfinite(as_float) else as_float
    if not math.isfinite(value) or value < 0:
        raise ArgumentError(f"eps must be finite and >= 0 in float32, got {shown(eps)}")
    return value


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < a1 and b0 < b1 and a0 < b1 and b0 < a1


def _check_aligned(name: str, t: torch.Tensor | None, nbytes: int) -> None:
    if t is not None and t.numel() and t.data_ptr() % nbytes:
        raise ArgumentError(f"{name} must start on a {nbytes}-byte boundary (the kernel moves whole 16-byte vectors); "
                            f"it starts at address {t.data_ptr():#x}, e.g. a view into the middle of a row")


def two_d(x: torch.Tensor) -> tuple[int, int]:
    """(tokens, hidden) of the norm's 2-D input."""
    if x.ndim != 2:
        raise ArgumentError(f"x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    return x.shape[0], x.shape[1]


def check_args(device: torch.device, x: object, weight: object, residual: object, eps: object, out: object,
               residual_out: object, quant: object, scale: object, swizzle: object) -> NormCall:
    """Every argument rule, before any communication; ArgumentError/DtypeError name the argument."""
    x = validate.tensor("x", x, device)
    if x.dtype not in DTYPES:
        raise DtypeError(f"x must be bfloat16 or float16, got {x.dtype}")
    tokens, hidden = two_d(x)
    if quant is not None and quant not in QUANTS:
        raise ArgumentError(f"quant must be None, 'fp8' or 'nvfp4', got {quant!r}")
    multiple = fp4.BLOCK if quant == "nvfp4" else VEC
    if hidden == 0 or hidden % multiple:
        why = "NVFP4 blocks of 16 values" if quant == "nvfp4" else f"the kernel's 16-byte vectors of {VEC} values"
        raise ArgumentError(f"hidden (x.shape[1] = {hidden}) must be a positive multiple of {multiple} ({why})")
    if hidden > MAX_HIDDEN:
        raise ArgumentError(f"hidden (x.shape[1] = {hidden}) must be at most {MAX_HIDDEN} (one row per thread block)")
    weight = validate.tensor("weight", weight, device)
    if weight.dtype is not x.dtype:
        raise DtypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if weight.shape != (hidden,):
        raise ArgumentError(f"weight must have shape ({hidden},) (x's hidden size), got {tuple(weight.shape)}")
    if residual is not None:
        residual = validate.given("residual", residual, x.shape, x.dtype, device)
    eps = _check_eps(eps)
    if not isinstance(swizzle, bool):
        raise ArgumentError(f"swizzle must be a bool, got {type(swizzle).__name__}")
    if quant is None:
        if scale is not None:
            raise ArgumentError("scale was given without quant: it is the FP8 scale or the NVFP4 global scale, "
                                "so pass quant='fp8' or quant='nvfp4' with it (or drop it)")
        if swizzle:
            raise ArgumentError("swizzle=True lays out NVFP4 block scales: it needs quant='nvfp4'")
    else:
        if scale is None:
            raise ArgumentError(f"quant={quant!r} needs scale= (the FP8 dequant scale, or the NVFP4 global scale): "
                                f"a float or a 1-element float32 tensor")
        scale = fp4.check_global_scale(scale, device, name="scale")
        if swizzle and quant != "nvfp4":
            raise ArgumentError("swizzle=True lays out NVFP4 block scales: it needs quant='nvfp4'")
    if residual_out is not None:
        residual_out = validate.destination("residual_out", residual_out, x.shape, x.dtype, device)
    scales_out = None
    if out is not None:
        if quant == "nvfp4":
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise ArgumentError("out must be a (payload, scales) pair for quant='nvfp4'")
            scales_out = validate.destination("out[1]", out[1], fp4.scales_shape(tokens, hidden, swizzle),
                                              torch.float8_e4m3fn, device)
            out = validate.destination("out[0]", out[0], (tokens, hidden // 2), torch.uint8, device)
        elif quant == "fp8":
            out = validate.destination("out", out, tuple(x.shape), torch.float8_e4m3fn, device)
        else:
            out = validate.destination("out", out, tuple(x.shape), x.dtype, device)
    call = NormCall(x, weight, residual, eps, quant, scale, swizzle, out, scales_out, residual_out)
    _check_memory(call)
    return call


def _check_memory(call: NormCall) -> None:
    """Alignment, and which tensors may share memory. out must not overlap anything. The new
    residual may be the old one exactly (each element is read before it is written), but must
    not overlap x: it receives the all-reduce of x, whose kernels may read x (on peers too)
    while this rank writes."""
    _check_aligned("weight", call.weight, 16)
    _check_aligned("residual", call.residual, 16)
    _check_aligned("residual_out", call.residual_out, 16)
    scale = call.scale if isinstance(call.scale, torch.Tensor) else None  # every block reads it
    inputs = [(n, t) for n, t in (("x", call.x), ("weight", call.weight), ("residual", call.residual),
                                  ("scale", scale)) if t is not None]
    outs = call.named_outputs()
    _check_aligned("out[0]" if call.quant == "nvfp4" else "out", call.out, _OUT_ALIGN[call.quant])
    for i, (name, t) in enumerate(outs):
        for other, u in inputs + outs[i + 1:]:
            if name == "residual_out" and other == "residual" and t.data_ptr() == u.data_ptr():
                continue  # the in-place update of the residual
            if _overlap(t, u):
                raise ArgumentError(f"{name} overlaps {other}: pass non-overlapping tensors"
                                    + (" (residual_out may be residual itself, not a part of it)"
                                       if {name, other} == {"residual_out", "residual"} else ""))


# ------------------------------------------------------------------------------ reference
def _kernel_order_sumsq(hf: torch.Tensor) -> torch.Tensor:
    """Per-row sum of squares of fp32 ``hf`` [rows, hidden] in csrc/rmsnorm.cuh's order."""
    rows, hidden = hf.shape
    iters = -(-(hidden // VEC) // THREADS)
    sq = hf * hf
    # Vectors past the row's end hold zeros: adding +0 to a partial that is >= +0 changes no bit.
    sq = F.pad(sq, (0, iters * THREADS * VEC - hidden)).view(rows, iters, THREADS, VEC)
    acc = torch.zeros(rows, THREADS, dtype=torch.float32, device=hf.device)
    for i in range(iters):
        for k in range(VEC):
            acc = acc + sq[:, i, :, k]
    v = acc.view(rows, WARPS, 32)
    lanes = torch.arange(32, device=hf.device)
    for o in (16, 8, 4, 2, 1):
        v = v + v[..., lanes ^ o]
    total = v[:, 0, 0]
    for w in range(1, WARPS):
        total = total + v[:, w, 0]
    return total


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root, as the kernel's __fsqrt_rn. torch's CPU sqrt is not:
    its vectorised fp32 (and fp64) versions are off by an ulp for about one value in six. So:
    the fp64 root rounded to fp32, then moved by one ulp where the exact test says so. The
    midpoints between s and its neighbours have at most 26 significant bits, so their squares
    are exact in fp64, and x (24 bits) never equals one (no ties)."""
    s = torch.sqrt(x.double()).float()
    xd = x.double()
    up, down = torch.nextafter(s, torch.full_like(s, math.inf)), torch.nextafter(s, torch.zeros_like(s))
    hi, lo = (s.double() + up.double()) / 2, (s.double() + down.double()) / 2
    fix = torch.where(xd > hi * hi, up, torch.where(xd < lo * lo, down, s))
    return torch.where(torch.isfinite(x) & (x > 0), fix, s)


def _fp8(y: torch.Tensor, scale: fp4.GlobalScale) -> torch.Tensor:
    v = y.float() / fp4.scale_tensor(scale, y.device)
    # The clamp states the saturation rather than relying on the installed torch's cast (older
    # releases gave NaN above 464); abs() clears a NaN's sign, so every NaN encodes as 0x7F, as in
    # the kernel.
    v = torch.where(v.isnan(), v.abs(), v.clamp(-FP8_MAX, FP8_MAX))
    return v.to(torch.float8_e4m3fn)


def reference_add_rmsnorm(a: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
                          eps: float = 1e-6, *, quant: str | None = None, scale: fp4.GlobalScale | None = None,
                          swizzle: bool = False) -> NormedResult:
    """The rounding contract in plain torch (any device): residual add and RMSNorm of the already
    all-reduced ``a`` [tokens, hidden], with the reduction in the kernel's order, so
    csrc/rmsnorm.cu (kernel and host entry point) matches it bit for bit."""
    call = check_args(a.device if isinstance(a, torch.Tensor) else torch.device("cpu"), a, weight, residual, eps,
                      None, None, quant, scale, swizzle)
    a, hidden = call.x, call.hidden
    h = a if call.residual is None else (a.float() + call.residual.float()).to(a.dtype)
    hf = h.float()
    # Python scalars (eps is already fp32-exact): no host-to-device copy, so this can be captured.
    # The reciprocal goes through float64, whose correctly rounded division, rounded again to
    # fp32, is the correctly rounded fp32 quotient (53 >= 2 * 24 + 2 bits).
    sumsq = _kernel_order_sumsq(hf)
    # A tensor divisor: torch divides a CUDA tensor by a Python number as a multiply by its
    # reciprocal, an ulp off the kernel's fp32 division for some rows (fp4.scale_tensor).
    rinv = (1.0 / _sqrt_rn(sumsq / torch.full_like(sumsq, hidden) + call.eps).double()).float()
    y = ((hf * rinv.unsqueeze(1)) * call.weight.float()).to(a.dtype)
    if quant is None:
        return NormedResult(y, h, None)
    if quant == "fp8":
        return NormedResult(_fp8(y, call.scale), h, None)
    packed, scales = fp4.quantize_reference(y, call.scale, swizzle)
    return NormedResult(packed, h, scales)


# ------------------------------------------------------------------------------ the local op
def allocate(call: NormCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, scales): the caller's, or new ones (torch.empty: the caching allocator, so a call
    under CUDA-graph capture allocates from the graph's pool)."""
    x = call.x
    if call.out is not None:
        return call.out, call.scales_out
    if call.quant == "nvfp4":
        return (torch.empty((call.tokens, call.hidden // 2), dtype=torch.uint8, device=x.device),
                torch.empty(fp4.scales_shape(call.tokens, call.hidden, call.swizzle), dtype=torch.float8_e4m3fn,
                            device=x.device))
    return torch.empty(x.shape, dtype=torch.float8_e4m3fn if call.quant == "fp8" else x.dtype, device=x.device), None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def launch_args(call: NormCall, residual_out: torch.Tensor | None, out: torch.Tensor,
                scales: torch.Tensor | None) -> _native.RmsnormArgs:
    """symcomm_rmsnorm_args_t for ``call``: what the kernel and its CPU twin take after their
    input."""
    if call.scale is None:
        scale_ptr, scale_value = None, 0.0
    elif isinstance(call.scale, torch.Tensor) and call.x.device.type == "cpu":
        scale_ptr, scale_value = None, float(fp4.scale_tensor(call.scale).item())  # the twin reads the value
    else:
        scale_ptr, scale_value = fp4.launch_scale(call.scale)
    return _native.RmsnormArgs(_ptr(call.residual), call.weight.data_ptr(), _native.DTYPE_CODES[call.x.dtype],
                               call.tokens, call.hidden, call.eps, _ptr(residual_out),
                               _native.NORM_QUANT_CODES[call.quant], out.data_ptr(), _ptr(scales), scale_ptr,
                               scale_value, int(call.swizzle))


def launch_kernel(a: torch.Tensor, call: NormCall, residual_out: torch.Tensor | None, out: torch.Tensor,
                  scales: torch.Tensor | None) -> None:
    """One launch of csrc/rmsnorm.cu on the current stream; reads a, writes residual_out (h, unless
    None) and out/scales."""
    lib = fp4.native_lib()
    args = launch_args(call, residual_out, out, scales)
    with fp4.on_device(a.device):
        rc = lib.symcomm_rmsnorm(a.data_ptr(), ctypes.byref(args), fp4.current_stream(a.device))
    _native.check(lib, "symcomm_rmsnorm", rc)


def launch_reference(a: torch.Tensor, call: NormCall, residual_out: torch.Tensor | None, out: torch.Tensor,
           scales: torch.Tensor | None) -> None:
    """The same contract through reference_add_rmsnorm, copied into the outputs."""
    ref = reference_add_rmsnorm(a, call.weight, call.residual, call.eps, quant=call.quant, scale=call.scale,
                                swizzle=call.swizzle)
    if residual_out is not None:
        residual_out.copy_(ref.residual)
    out.view(torch.uint8).copy_(ref.out.view(torch.uint8))
    if scales is not None:
        scales.view(torch.uint8).copy_(ref.scales.view(torch.uint8))


def kernel_available(device: torch.device) -> str | None:
    """None if csrc/rmsnorm.cu's kernel can run on ``device``, else why not."""
    if device.type != "cuda":
        return "the standalone kernel runs on CUDA tensors (CPU tensors use the torch reference)"
    ok, why = fp4.native_available()
    return None if ok else f"csrc/rmsnorm.cu is not loaded: {why}"


def add_rmsnorm(a: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None, eps: float = 1e-6,
                out: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
                residual_out: torch.Tensor | None = None, quant: str | None = None,
                scale: fp4.GlobalScale | None = None, swizzle: bool = False, impl: str = "auto") -> NormedResult:
    """The local half of all_reduce_rmsnorm on an already all-reduced ``a``: no communication.
    ``impl``: "kernel" (csrc/rmsnorm.cu, CUDA), "torch" (the reference), or "auto" (the kernel
    where it can run). Same arguments, rules and results as all_reduce_rmsnorm."""
    call = check_args(a.device if isinstance(a, torch.Tensor) else torch.device("cpu"), a, weight, residual, eps,
                      out, residual_out, quant, scale, swizzle)
    if impl not in ("auto", "kernel", "torch"):
        raise ArgumentError(f"impl must be 'auto', 'kernel' or 'torch', got {impl!r}")
    why = kernel_available(call.x.device)
    if impl == "kernel" and why is not None:
        raise ArgumentError(f"impl='kernel': {why}")
    y, scales = allocate(call)
    h = call.residual_out
    if h is None:
        h = call.x if call.residual is None else torch.empty_like(call.x)
    (launch_reference if impl == "torch" or why is not None else launch_kernel)(call.x, call, None if h is call.x else h, y, scales)
    return NormedResult(y, h, scales)


def rmsnorm_host(a: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None, eps: float = 1e-6, *,
                 quant: str | None = None, scale: float | None = None, swizzle: bool = False) -> NormedResult:
    """csrc/rmsnorm.cu's per-row code run on the CPU (symcomm_rmsnorm_host), for CPU tensors: how CI
    checks the kernel's math without a GPU, and what GPU tests compare the kernel with."""
    call = check_args(torch.device("cpu"), a, weight, residual, eps, None, None, quant, scale, swizzle)
    y, scales = allocate(call)
    h = torch.empty_like(call.x)
    lib = fp4.host_lib()
    rc = lib.symcomm_rmsnorm_host(call.x.data_ptr(), ctypes.byref(launch_args(call, h, y, scales)))
    _native.check(lib, "symcomm_rmsnorm_host", rc)
    return NormedResult(y, h, scales)


__all__ = ["MAX_HIDDEN", "NormCall", "NormedResult", "add_rmsnorm", "check_args", "reference_add_rmsnorm",
           "rmsnorm_host"]
