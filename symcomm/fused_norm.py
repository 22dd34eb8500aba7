"""All-reduce + residual add + RMSNorm (+ FP8 / NVFP4 output): Communicator.all_reduce_rmsnorm.

    h = all_reduce(x) + residual          (the new residual; h = all_reduce(x) without one)
    y = h * rsqrt(mean(h^2) + eps) * weight

Rounding contract (csrc/rmsnorm.cuh is the normative text, docs/fused-norm.md the user's):

- h is rounded to x's dtype before anything uses it: one fp32 add of the all-reduced value (in
  dtype) and the residual, rounded once, as an unfused ``all_reduce`` then ``a + residual``
  in dtype gives.
- The sum of squares and the normalisation run in fp32 from that rounded h, in a fixed order
  (the kernel's: ``THREADS`` partials over 16-byte vectors, a warp butterfly, warps in order)
  that does not depend on any launch grid; y is rounded to the dtype.
- Quantized outputs quantize that rounded y: NVFP4 is bitwise ``fp4.quantize(y, scale)``, FP8
  is bitwise ``(y.float() / scale).to(torch.float8_e4m3fn)`` (saturating to +-448 as torch
  2.13's cast does; every NaN is encoded 0x7F). The FP8 scale is a dequant scale:
  ``y ~= fp8.float() * scale``.

The op picks one of ``NORM_PATHS`` per call, the way dispatch picks a collective's path: each
says whether it can serve the call (``why_not``), ``algo="auto"`` takes the first that can,
and ``select()`` explains the choice. The fused paths (``fused-flagfree``, ``fused-oneshot``,
``fused-twoshot``: csrc/fused_norm_ar.cu) run the norm inside one of symcomm's all-reduce
kernels; ``unfused`` is ``comm.all_reduce`` on whatever path its dispatch picks, then one launch
of csrc/rmsnorm.cu's kernel; ``reference`` the same with the torch reference (CPU, or CUDA
without the native library). A fused path returns the bits of ``unfused`` with the same
all-reduce kernel: csrc/rmsnorm.cuh's ``rmsnorm_row`` is the device routine both call. The
order auto tries them in is the dispatch table's ``all_reduce_rmsnorm`` row where the table
has one (measured by ``symcomm-bench tune``); without one, a fused path serves exactly where
the all-reduce of x alone would run on its kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import _native, checks, fp4, validate
from .backends import fused_norm_ar
from .backends.custom import aligned
from .base import TWOSHOT, Call
from .dispatch import NORM_KEY, Choice, choose
from .errors import ArgumentError, CommClosedError, DtypeError, PeerMismatchError, SymcommError

OP = NORM_KEY  # also the dispatch table's key for this op's row
DTYPES = (torch.bfloat16, torch.float16)
QUANTS = ("fp8", "nvfp4")
# The kernel's geometry, which is also the reduction order (csrc/rmsnorm.cuh): 16-byte vectors
# of VEC elements, THREADS partial sums per row, WARPS warps of 32.
VEC = 8
THREADS = 256
WARPS = THREADS // 32
MAX_HIDDEN = 32768
FP8_MAX = 448.0
_OUT_ALIGN = {None: 16, "fp8": 8, "nvfp4": 4}  # bytes one thread stores per vector


class NormedResult(NamedTuple):
    """What all_reduce_rmsnorm returns."""

    out: torch.Tensor  # y in x's dtype; float8_e4m3fn for quant="fp8"; uint8 NVFP4 codes [tokens, hidden/2]
    residual: torch.Tensor  # h = all_reduce(x) + residual, in x's dtype: the next layer's residual
    scales: torch.Tensor | None  # NVFP4 block scales (float8_e4m3fn, linear or swizzled), else None


@dataclass(frozen=True)
class NormChoice(Choice):
    """Choice for all_reduce_rmsnorm: the norm path, why the others were passed over, and the
    inner all-reduce's own Choice for the unfused paths (None for a fused one)."""

    all_reduce: Choice | None = None


@dataclass
class NormCall:
    """A validated all_reduce_rmsnorm call (outputs as given: None means allocate)."""

    x: torch.Tensor
    weight: torch.Tensor
    residual: torch.Tensor | None
    eps: float  # rounded to fp32
    quant: str | None
    scale: fp4.GlobalScale | None
    swizzle: bool
    out: torch.Tensor | None
    scales_out: torch.Tensor | None
    residual_out: torch.Tensor | None
    ar_choice: str | None = None  # the path x's all-reduce alone takes, once asked (_all_reduce_choice)

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
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise ArgumentError(f"eps must be a float, got {type(eps).__name__}")
    value = _fp32(float(eps)) if math.isfinite(eps) else float(eps)
    if not math.isfinite(value) or value < 0:
        raise ArgumentError(f"eps must be finite and >= 0 in float32, got {eps!r}")
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


def check_args(device: torch.device, x: object, weight: object, residual: object, eps: object, out: object,
               residual_out: object, quant: object, scale: object, swizzle: object) -> NormCall:
    """Every argument rule, before any communication; ArgumentError/DtypeError name the argument."""
    x = validate.tensor("x", x, device)
    if x.dtype not in DTYPES:
        raise DtypeError(f"x must be bfloat16 or float16, got {x.dtype}")
    if x.ndim != 2:
        raise ArgumentError(f"x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    tokens, hidden = x.shape
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
        residual_out = validate.given("residual_out", residual_out, x.shape, x.dtype, device)
    scales_out = None
    if out is not None:
        if quant == "nvfp4":
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise ArgumentError("out must be a (payload, scales) pair for quant='nvfp4'")
            scales_out = validate.given("out[1]", out[1], fp4._scales_shape(tokens, hidden, swizzle),
                                        torch.float8_e4m3fn, device)
            out = validate.given("out[0]", out[0], (tokens, hidden // 2), torch.uint8, device)
        elif quant == "fp8":
            out = validate.given("out", out, tuple(x.shape), torch.float8_e4m3fn, device)
        else:
            out = validate.given("out", out, tuple(x.shape), x.dtype, device)
    call = NormCall(x, weight, residual, eps, quant, scale, swizzle, out, scales_out, residual_out)
    _check_memory(call)
    return call


def _check_memory(call: NormCall) -> None:
    """Alignment, and which tensors may share memory. out must not overlap anything: it is written
    after the row is read, but a fused path writes it while peers still read x in place. The
    new residual may be the old one exactly (each element is read before it is written), but
    must not overlap x, which fused paths read on peers while this rank writes."""
    _check_aligned("weight", call.weight, 16)
    _check_aligned("residual", call.residual, 16)
    _check_aligned("residual_out", call.residual_out, 16)
    out_name = "out[0]" if call.quant == "nvfp4" else "out"
    inputs = [(n, t) for n, t in (("x", call.x), ("weight", call.weight), ("residual", call.residual)) if t is not None]
    outs = [(n, t) for n, t in ((out_name, call.out), ("out[1]", call.scales_out), ("residual_out", call.residual_out))
            if t is not None]
    _check_aligned(out_name, call.out, _OUT_ALIGN[call.quant])
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
    v = y.float() / fp4._gs_tensor(scale)
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
    rinv = (1.0 / _sqrt_rn(_kernel_order_sumsq(hf) / hidden + call.eps).double()).float()
    y = ((hf * rinv.unsqueeze(1)) * call.weight.float()).to(a.dtype)
    if quant is None:
        return NormedResult(y, h, None)
    if quant == "fp8":
        return NormedResult(_fp8(y, call.scale), h, None)
    packed, scales = fp4.quantize_reference(y, call.scale, swizzle)
    return NormedResult(packed, h, scales)


# ------------------------------------------------------------------------------ the local op
def _allocate(call: NormCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, scales): the caller's, or new ones (torch.empty: the caching allocator, so a call
    under CUDA-graph capture allocates from the graph's pool)."""
    x = call.x
    if call.out is not None:
        return call.out, call.scales_out
    if call.quant == "nvfp4":
        return (torch.empty((call.tokens, call.hidden // 2), dtype=torch.uint8, device=x.device),
                torch.empty(fp4._scales_shape(call.tokens, call.hidden, call.swizzle), dtype=torch.float8_e4m3fn,
                            device=x.device))
    return torch.empty(x.shape, dtype=torch.float8_e4m3fn if call.quant == "fp8" else x.dtype, device=x.device), None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _kernel(a: torch.Tensor, call: NormCall, residual_out: torch.Tensor | None, out: torch.Tensor,
            scales: torch.Tensor | None) -> None:
    """One launch of csrc/rmsnorm.cu on the current stream; reads a, writes residual_out (h, unless
    None) and out/scales."""
    lib = fp4._native_lib()
    scale_ptr, scale_value = fp4._scale_args(call.scale) if call.scale is not None else (None, 0.0)
    with fp4._on(a.device):
        rc = lib.symcomm_rmsnorm(a.data_ptr(), _ptr(call.residual), call.weight.data_ptr(),
                                 _native.DTYPE_CODES[a.dtype], call.tokens, call.hidden, call.eps,
                                 _ptr(residual_out), _native.NORM_QUANT_CODES[call.quant], out.data_ptr(),
                                 _ptr(scales), scale_ptr, scale_value, int(call.swizzle), fp4._stream(a.device))
    _native.check(lib, "symcomm_rmsnorm", rc)


def _torch(a: torch.Tensor, call: NormCall, residual_out: torch.Tensor | None, out: torch.Tensor,
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
    y, scales = _allocate(call)
    h = call.residual_out
    if h is None:
        h = call.x if call.residual is None else torch.empty_like(call.x)
    (_torch if impl == "torch" or why is not None else _kernel)(call.x, call, None if h is call.x else h, y, scales)
    return NormedResult(y, h, scales)


def rmsnorm_host(a: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None, eps: float = 1e-6, *,
                 quant: str | None = None, scale: float | None = None, swizzle: bool = False) -> NormedResult:
    """csrc/rmsnorm.cu's per-row code run on the CPU (symcomm_rmsnorm_host), for CPU tensors: how CI
    checks the kernel's math without a GPU, and what GPU tests compare the kernel with."""
    call = check_args(torch.device("cpu"), a, weight, residual, eps, None, None, quant, scale, swizzle)
    scale_value = 0.0 if call.scale is None else float(fp4._gs_tensor(call.scale).item())
    y, scales = _allocate(call)
    h = torch.empty_like(call.x)
    lib = fp4._host_lib()
    rc = lib.symcomm_rmsnorm_host(call.x.data_ptr(), _ptr(call.residual), call.weight.data_ptr(),
                                  _native.DTYPE_CODES[call.x.dtype], call.tokens, call.hidden, call.eps,
                                  h.data_ptr(), _native.NORM_QUANT_CODES[quant], y.data_ptr(), _ptr(scales),
                                  scale_value, int(swizzle))
    _native.check(lib, "symcomm_rmsnorm_host", rc)
    return NormedResult(y, h, scales)


# ------------------------------------------------------------------------------ norm paths
class NormPath:
    """One way to run all_reduce_rmsnorm. ``why_not`` is None when the path can serve the call
    (``ar_algo``: the all-reduce path the caller forced, or "auto"); ``run`` does it."""

    name: str = ""

    def why_not(self, comm, call: NormCall, ar_algo: str) -> str | None:
        raise NotImplementedError

    def run(self, comm, call: NormCall, ar_algo: str) -> NormedResult:
        raise NotImplementedError


class Unfused(NormPath):
    """comm.all_reduce on whatever path its dispatch picks, then one local normalisation: the
    csrc kernel (``unfused``) or the torch reference (``reference``)."""

    def __init__(self, name: str, local) -> None:
        self.name = name
        self._local = local

    def why_not(self, comm, call: NormCall, ar_algo: str) -> str | None:
        return kernel_available(call.x.device) if self._local is _kernel else None

    def run(self, comm, call: NormCall, ar_algo: str) -> NormedResult:
        x, residual, h = call.x, call.residual, call.residual_out
        in_place = h is not None and residual is not None and h.data_ptr() == residual.data_ptr()
        if h is None:
            h = torch.empty_like(x)
        # The all-reduce lands in the new residual itself (h = a + residual is computed over it
        # element by element), except when that is the old residual, still to be read.
        a = torch.empty_like(x) if in_place else h
        comm.all_reduce(x, out=a, algo=ar_algo)
        y, scales = _allocate(call)
        self._local(a, call, None if residual is None and a is h else h, y, scales)
        return NormedResult(y, h, scales)


class Fused(NormPath):
    """An all-reduce kernel of symcomm's with the norm in the same launch (csrc/fused_norm_ar.cu),
    giving the bits of ``unfused`` with the same all-reduce kernel. Where it serves: wherever its
    kernel can take the call when the table has an all_reduce_rmsnorm row (which ranks it) or
    when ``algo=`` names it; without a row, only where the all-reduce alone would run on that
    kernel (the table's choice for x, or ``algo=`` naming the kernel)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.kernel = fused_norm_ar.FUSED[name]

    def why_not(self, comm, call: NormCall, ar_algo: str) -> str | None:
        if self.kernel not in comm._paths:  # a dict test: this runs for every path on every call
            return f"{self.kernel} is off: {comm._off.get(self.kernel, 'not among this communicator paths')}"
        # A table that measured this op ranks the fused paths itself; otherwise they follow the
        # all-reduce's choice, as does any call that forces the all-reduce.
        if ar_algo != "auto" or not _tuned(comm):
            chosen = _all_reduce_choice(comm, call) if ar_algo == "auto" else ar_algo
            if chosen != self.kernel:
                return f"the all-reduce of x alone runs on {chosen}, not {self.kernel}"
        return fused_norm_ar.why_not(comm.path(self.kernel), call.x, call.quant)

    def run(self, comm, call: NormCall, ar_algo: str) -> NormedResult:
        custom = comm.path(self.kernel)
        comm.check_health()  # what an all-reduce call checks first: a peer gave up
        if self.kernel == TWOSHOT and comm.checking():
            _check_replicated(comm, call)
        y, scales = _allocate(call)
        h = call.residual_out if call.residual_out is not None else torch.empty_like(call.x)
        if call.tokens:
            fused_norm_ar.run(custom, aligned(call.x), call.residual, call.weight, call.eps, h, call.quant, y, scales,
                              call.scale, call.swizzle)
        return NormedResult(y, h, scales)


def _all_reduce_call(x: torch.Tensor) -> Call:
    """The all-reduce of x as the unfused path makes it (out of place), without allocating an
    output: what dispatch decides by and check mode compares."""
    ptr = x.data_ptr()
    return Call("all_reduce", (x,), (x,), (ptr,), (ptr,), None, "sum", x.nbytes, "all_reduce")


def _all_reduce_choice(comm, call: NormCall) -> str:
    """The path comm.all_reduce would take for x: the fused paths follow it. Once per call."""
    if call.ar_choice is None:
        call.ar_choice = choose(comm.table, comm._paths, comm._off, _all_reduce_call(call.x), "auto")[0].name
    return call.ar_choice


def _check_replicated(comm, call: NormCall) -> None:
    """Check mode, fused two-shot: each row is normalised on one rank, with that rank's residual
    and weight, so they must be equal on every rank (tensor parallelism keeps them so). Compares
    a digest of their bits; collective, like the check before it."""
    digest = 0
    for t in (call.residual, call.weight):
        if t is not None:
            bits = t.contiguous().view(torch.int16).reshape(-1).to(torch.int64)
            digest = digest * 1_000_003 + int((bits * torch.arange(1, bits.numel() + 1, device=bits.device)).sum())
    digest &= (1 << 63) - 1
    rows = comm.peers.exchange([digest], kind="check:replicated")
    if any(row[0] != rows[0][0] for row in rows):
        differ = [r for r, row in enumerate(rows) if row[0] != rows[0][0]]
        raise PeerMismatchError(f"SYMCOMM_CHECK: {OP}: residual or weight differs between rank 0 and rank(s) "
                                f"{differ}; fused two-shot normalises each row on one rank, so both must be the same "
                                f"on every rank")


def _tuned(comm) -> bool:
    """Whether the dispatch table has a row for this op (``symcomm-bench tune`` measures the norm
    paths against each other); the built-in table has none."""
    return OP in comm.table.rows


# Ordered by preference where the table has no row for the op: a fused path then serves only
# where its kernel is the all-reduce's choice, so at most one of them can, and it goes ahead of
# the unfused paths.
NORM_PATHS: tuple[NormPath, ...] = (*(Fused(name) for name in fused_norm_ar.FUSED), Unfused("unfused", _kernel),
                                    Unfused("reference", _torch))
_BY_NAME = {p.name: p for p in NORM_PATHS}
_NAMES = [p.name for p in NORM_PATHS]


def _preference(comm, call: NormCall) -> tuple[NormPath, ...]:
    """The order auto tries the paths in: the table's row for x's size (measured), then the
    paths it leaves out; NORM_PATHS' order without a row."""
    if not _tuned(comm):
        return NORM_PATHS
    ranked = tuple(_BY_NAME[n] for n in comm.table.preference(OP, call.x.nbytes) if n in _BY_NAME)
    return (*ranked, *(p for p in NORM_PATHS if p not in ranked))


def _choose(comm, call: NormCall, algo: object) -> tuple[NormPath, str, dict[str, str]]:
    """(path, the all-reduce algo for it, every path passed over with its reason)."""
    if not isinstance(algo, str):
        raise ArgumentError(f"algo must be a string, got {type(algo).__name__}")
    if algo in _BY_NAME:
        # Forcing a fused path forces its all-reduce kernel too (tune times each path so).
        path = _BY_NAME[algo]
        reason = path.why_not(comm, call, getattr(path, "kernel", "auto"))
        if reason is not None:
            raise ArgumentError(f"algo={algo!r} cannot serve this {OP}: {reason}")
        return path, "auto", {}
    if algo != "auto" and algo not in comm.algorithms():
        paths = comm.capabilities()["paths"]
        if algo in paths:
            raise ArgumentError(f"algo={algo!r} is unavailable: {paths[algo]['reason']}")
        raise ArgumentError(f"algo must be 'auto', a norm path ({', '.join(_BY_NAME)}) or an all-reduce path of "
                            f"this communicator ({', '.join(comm.algorithms())}), got {algo!r}")
    rejected: dict[str, str] = {}
    for path in _preference(comm, call) if algo == "auto" else NORM_PATHS:
        reason = path.why_not(comm, call, algo)
        if reason is None:
            return path, algo, rejected
        rejected[path.name] = reason
    raise ArgumentError(f"no path can serve this {OP}: " + "; ".join(f"{n}: {r}" for n, r in rejected.items()))


def _validate(comm, x, weight, residual, eps, out, residual_out, quant, scale, swizzle) -> NormCall:
    if comm.closed:
        raise CommClosedError("this Communicator is closed")
    return check_args(comm.device, x, weight, residual, eps, out, residual_out, quant, scale, swizzle)


def all_reduce_rmsnorm(comm, x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
                       eps: float = 1e-6, out: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
                       residual_out: torch.Tensor | None = None, quant: str | None = None,
                       scale: fp4.GlobalScale | None = None, swizzle: bool = False,
                       algo: str = "auto") -> NormedResult:
    """h = all_reduce(x) + residual and y = rmsnorm(h) * weight, optionally quantized.

    ``x`` [tokens, hidden] bf16/fp16 (left unchanged), hidden a multiple of 8 (16 for NVFP4),
    at most 32768; ``weight`` [hidden] of x's dtype; ``residual`` None or like x. ``quant``:
    None (y in x's dtype), "fp8" (float8_e4m3fn of y / scale, ``scale`` the per-tensor dequant
    scale) or "nvfp4" (symcomm.fp4's format with global scale ``scale``, block scales swizzled
    with ``swizzle=True``); ``scale`` is a float or a 1-element float32 tensor on x's device (read
    on the device: no host sync, capturable). ``out``: a tensor like y, or for NVFP4 a
    (payload, scales) pair; ``residual_out``: where h goes, which may be ``residual`` itself (in
    place). Neither may overlap x. ``algo``: "auto", a norm path (NORM_PATHS), or an all-reduce
    path of this communicator, which forces that all-reduce: fused with the norm where that
    kernel's fused path serves, unfused with it otherwise. ``residual`` and ``weight`` must be
    the same on every rank (fused two-shot normalises each row on one rank). Collective,
    like all_reduce; arguments are checked before any communication."""
    try:
        call = _validate(comm, x, weight, residual, eps, out, residual_out, quant, scale, swizzle)
        path, ar_algo, _ = _choose(comm, call, algo)
    except Exception as exc:
        comm.refused(exc)  # check mode: peers waiting in this op's exchange raise too
        raise
    if comm.checking():
        _verify(comm, call, path)
    return path.run(comm, call, ar_algo)


_DECODE = {"eps": checks.bits_float, "scale": checks.bits_float, "quant": lambda v: (None, *QUANTS)[v],
           "swizzle": bool, "residual": lambda v: "given" if v else "none"}


def _verify(comm, call: NormCall, path: NormPath) -> None:
    """Check mode: the all-reduce of x under this op's name, with the norm path and every scalar
    that changes a result compared. Free per rank, and not compared: ``weight`` and the
    ``residual`` values (this rank normalises its own rows with them; fused two-shot, which
    normalises each row on one rank for all, compares them in _check_replicated) and where the
    outputs sit (written locally)."""
    scale = call.scale
    scale_bits = 0 if scale is None else checks.float_bits(float(scale.item()) if isinstance(scale, torch.Tensor)
                                                            else scale)
    scalars = [("eps", checks.float_bits(call.eps)), ("quant", (None, *QUANTS).index(call.quant)),
               ("scale", scale_bits), ("swizzle", int(call.swizzle)), ("residual", int(call.residual is not None))]
    pool = comm.symmetric_pool
    # A fused kernel reads x in peers' pool regions at this rank's offset; unfused checks its own.
    locate = pool.locate if isinstance(path, Fused) and pool is not None else None
    checks.verify(comm.peers, _all_reduce_call(call.x), path.name, _NAMES, locate, ("x",), op=OP, scalars=scalars,
                  decode=_DECODE)


def select(comm, x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None, eps: float = 1e-6,
           out: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
           residual_out: torch.Tensor | None = None, quant: str | None = None,
           scale: fp4.GlobalScale | None = None, swizzle: bool = False, algo: str = "auto") -> NormChoice:
    """The norm path all_reduce_rmsnorm would take, every other one with its reason, and the inner
    all-reduce's choice. Local: nothing is communicated."""
    call = _validate(comm, x, weight, residual, eps, out, residual_out, quant, scale, swizzle)
    path, ar_algo, rejected = _choose(comm, call, algo)
    forced = algo in _BY_NAME  # a named norm path: no table or ranking was consulted
    for other in NORM_PATHS:
        if other is not path and other.name not in rejected:
            rejected[other.name] = (f"not requested (algo={algo!r})" if forced else
                                    other.why_not(comm, call, ar_algo)
                                    or f"ranked below {path.name} "
                                       + (f"by the {comm.table.source} table" if _tuned(comm) and ar_algo == "auto"
                                          else "in fused_norm.NORM_PATHS"))
    inner = None
    if isinstance(path, Unfused):
        a = torch.empty_like(call.x)
        inner = comm.select("all_reduce", call.x, out=a) if ar_algo == "auto" else Choice(ar_algo, {})
    return NormChoice(path.name, rejected, inner)


__all__ = ["MAX_HIDDEN", "NORM_PATHS", "NormChoice", "NormedResult", "OP", "add_rmsnorm", "all_reduce_rmsnorm",
           "reference_add_rmsnorm", "rmsnorm_host", "select"]
