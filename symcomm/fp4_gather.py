"""all_gatherv of NVFP4-quantized rows: Communicator.all_gatherv_fp4 delegates here.

Two paths, chosen per call the way dispatch chooses a collective's path (``FP4_PATHS``: each
says whether it can serve the call, ``algo="auto"`` takes the first that can, ``select()``
says why the others were passed over):

- ``fused-push``: one launch of csrc/peer_gather.cu's ``gather_fp4_push``. Each rank quantizes
  its rows (the codec of ``fp4.quantize``, bit for bit) and writes payload, block scales and
  the ``extra`` tensors straight into every peer's gathered outputs, then the ranks meet at
  two bounded barriers. It needs CUDA, symcomm's custom kernels open, bf16/fp16 rows, at most
  8 tensors, 16-byte aligned rows of the extras, and every gathered output in a mapped
  symmetric pool region: allocate them inside ``use_symmetric_memory`` (``out=None`` does so
  when called inside it), or pass them as ``out`` (an ``Fp4Gathered`` allocated there).
- ``unfused``: each rank quantizes its rows straight into its own slice of the gathered
  outputs, then one in-place ``comm.all_gatherv`` moves payload, scales and extras (one NCCL
  group, or whatever path its dispatch picks). Any device, dtype and memory.

Both write the same bytes. ``swizzle=True`` swizzles the gathered linear scales afterwards,
on either path.

Offsets stay symmetric: the fused kernel writes at this rank's offsets into every peer's
region, so the gathered outputs must sit at equal pool offsets on every rank. Their shapes are
equal everywhere, but their offsets are only equal if every earlier pool allocation was equal
too; tensors whose size differs by rank (x, the extras: this rank's rows) belong outside
``use_symmetric_memory`` (the kernel reads them locally, from any memory). Check mode
(SYMCOMM_CHECK=1) compares the outputs' pool offsets and names the one that differs.

Every rank must use the same global scale: receivers decode every peer's rows with their own
copy of it. ``fp4.global_scale_for(x, comm)`` computes a shared one; check mode compares it
across ranks.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import _native, checks, fp4, validate
from .backends.custom import CAPTURE_CODES, aligned
from .backends.peer_gather import MAX_TENSORS
from .base import PUSH, Call
from .dispatch import Choice
from .errors import ArgumentError, CommClosedError

OP = "all_gatherv_fp4"
FUSED, UNFUSED = "fused-push", "unfused"
FUSED_DTYPES = (torch.bfloat16, torch.float16)
CAPTURE_CODE = CAPTURE_CODES[FUSED]
_c = ctypes


class Fp4Gathered(NamedTuple):
    """Every rank's rows, in rank order (``sum(sizes)`` rows)."""

    packed: torch.Tensor  # uint8 [rows, H/2]
    scales: torch.Tensor  # float8_e4m3fn [rows, H/16]; with swizzle, fp4.swizzled_shape(rows, H/16)
    extra: tuple[torch.Tensor, ...]  # each extra tensor gathered along dim 0
    values: torch.Tensor | None  # dequantized [rows, H] in x's dtype, when asked for
    global_scale: fp4.GlobalScale  # as validated: a float (fp32-rounded) or the caller's tensor


class _Args(NamedTuple):
    x: torch.Tensor
    sizes: list[int]
    gs: fp4.GlobalScale
    extra: list[torch.Tensor]
    out: Fp4Gathered | None


def _validate(comm, x: object, sizes: object, global_scale: object, extra: object, out: object,
              dequantize: bool) -> _Args:
    if comm.closed:
        raise CommClosedError("this Communicator is closed")
    device = comm.device
    n, h = fp4._check_x(x)
    validate.tensor("x", x, device)
    sizes = validate.sizes_arg(sizes, comm.world_size)
    if n != sizes[comm.rank]:
        raise ArgumentError(f"x has {n} rows, but sizes[{comm.rank}] (this rank) is {sizes[comm.rank]}")
    validate.check_extent("the gathered outputs", sum(sizes), x)
    gs = fp4.check_global_scale(global_scale, device)
    if isinstance(extra, torch.Tensor) or not isinstance(extra, (list, tuple)):
        raise ArgumentError("extra must be a list or tuple of tensors (each with this rank's rows in dim 0)")
    extra = list(extra)
    for i, t in enumerate(extra):
        t = validate.tensor(f"extra[{i}]", t, device)
        if validate.rows(f"extra[{i}]", t) != n:
            raise ArgumentError(f"extra[{i}] has {t.shape[0]} rows, but x has {n}")
    if out is not None:
        _check_out(out, sum(sizes), h, x.dtype, extra, device, dequantize)
    return _Args(x, sizes, gs, extra, out)


def _check_out(out: object, total: int, h: int, dtype: torch.dtype, extra: list[torch.Tensor],
               device: torch.device, dequantize: bool) -> None:
    if not isinstance(out, Fp4Gathered):
        raise ArgumentError(f"out must be an Fp4Gathered, got {type(out).__name__}")
    validate.given("out.packed", out.packed, (total, h // 2), torch.uint8, device)
    validate.given("out.scales", out.scales, (total, h // fp4.BLOCK), torch.float8_e4m3fn, device)
    if len(out.extra) != len(extra):
        raise ArgumentError(f"out.extra has {len(out.extra)} tensors, but extra has {len(extra)}")
    for i, (o, t) in enumerate(zip(out.extra, extra)):
        validate.given(f"out.extra[{i}]", o, (total, *t.shape[1:]), t.dtype, device)
    if dequantize and out.values is not None:
        validate.given("out.values", out.values, (total, h), dtype, device)


class _Outs(NamedTuple):
    """The gathered outputs a call writes: the caller's ``out``, or new ones."""

    packed: torch.Tensor
    scales: torch.Tensor
    extra: list[torch.Tensor]

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [("out.packed", self.packed), ("out.scales", self.scales),
                *((f"out.extra[{i}]", t) for i, t in enumerate(self.extra))]


def _outputs(a: _Args) -> _Outs:
    """The caller's outputs, or new ones allocated here: payload, scales, then the extras, the
    same shapes in the same order on every rank, so inside use_symmetric_memory they take equal
    pool offsets wherever the earlier allocations were equal."""
    if a.out is not None:
        return _Outs(a.out.packed, a.out.scales, list(a.out.extra))
    total, h, device = sum(a.sizes), a.x.shape[1], a.x.device
    return _Outs(torch.empty((total, h // 2), dtype=torch.uint8, device=device),
                 torch.empty((total, h // fp4.BLOCK), dtype=torch.float8_e4m3fn, device=device),
                 [torch.empty((total, *t.shape[1:]), dtype=t.dtype, device=device) for t in a.extra])


def _row_bytes(t: torch.Tensor) -> int:
    return t[0].nbytes if t.shape[0] else t.element_size() * int(torch.Size(t.shape[1:]).numel())


# ------------------------------------------------------------------------------ paths
class Fp4Path:
    """One way to run all_gatherv_fp4. ``why_not`` is None when the path can serve the call;
    ``run`` writes the gathered outputs (``gather_algo``: the all_gatherv path the caller
    forced for the unfused path, or "auto")."""

    name = ""

    def why_not(self, comm, a: _Args, outs: _Outs) -> str | None:
        raise NotImplementedError

    def run(self, comm, a: _Args, outs: _Outs, gather_algo: str) -> None:
        raise NotImplementedError


def _push_state(comm):
    """(custom-push's kernel state, None), or (None, why custom-push is off): the fused kernel
    runs on the context, mapped regions and stream order the custom kernels share."""
    state = getattr(comm._paths.get(PUSH), "_state", None)
    return (state, None) if state is not None else (None, comm._off.get(PUSH, "not opened"))


class FusedPush(Fp4Path):
    """csrc/peer_gather.cu's gather_fp4_push: quantize and write into every peer's outputs."""

    name = FUSED

    def why_not(self, comm, a: _Args, outs: _Outs) -> str | None:
        if comm.device.type != "cuda":
            return f"the fused kernel runs on CUDA devices, and this communicator runs on {comm.device}"
        if a.x.dtype not in FUSED_DTYPES:
            return f"x is {a.x.dtype}: the fused kernel quantizes bfloat16 and float16 rows"
        count = 2 + len(a.extra)
        if count > MAX_TENSORS:
            return (f"{count} tensors (payload, scales and {len(a.extra)} extra) exceed the {MAX_TENSORS} "
                    f"one launch writes")
        state, off = _push_state(comm)
        if state is None:
            return f"symcomm's peer kernels are off here ({PUSH}: {off})"
        for name, t in outs.named():
            if state.region_of(t.data_ptr()) is None:
                problem = state.region_problem or ("allocate the outputs inside use_symmetric_memory, or pass "
                                                   "out= (an Fp4Gathered allocated there)")
                return (f"{name} is not in a mapped symmetric pool region (the fused kernel writes every peer's "
                        f"copy in place): {problem}")
        # Only what is the same on every rank decides (outputs sit at equal offsets, rows are
        # equal): a rank-local reason, such as a misaligned input, would send the ranks down
        # different paths to wait for each other. Misaligned inputs are copied in run() instead.
        if outs.packed.data_ptr() % 16:
            return "out.packed does not start on a 16-byte boundary"
        for i, o in enumerate(outs.extra):
            row = _row_bytes(o)
            if row % 16 or o.data_ptr() % 16:
                return (f"out.extra[{i}]: rows of {row} bytes, or its address, are not whole 16-byte vectors "
                        f"(the kernel copies extras as 16-byte vectors)")
        return None

    def run(self, comm, a: _Args, outs: _Outs, gather_algo: str) -> None:
        comm.check_health()  # comm's own collectives check this first; this launch bypasses them
        total = sum(a.sizes)
        if not total:
            return  # every rank knows: no rank launches
        state, _ = _push_state(comm)
        session = state.session()
        x, extra = aligned(a.x), [aligned(t) for t in a.extra]
        n, h = x.shape
        where = [state.output_slot(t.data_ptr(), t.nbytes, session, CAPTURE_CODE) for _, t in outs.named()]
        k = len(extra)
        srcs = (_c.c_uint64 * k)(*(t.data_ptr() for t in extra))
        slots = (_c.c_int * k)(*(slot for slot, _ in where[2:]))
        offsets = (_c.c_uint64 * k)(*(offset for _, offset in where[2:]))
        row_bytes = (_c.c_uint64 * k)(*(_row_bytes(o) for o in outs.extra))
        gs_ptr, gs_value = fp4._scale_args(a.gs)
        code = state.lib.symcomm_ar_gatherv_fp4(
            state.ctx, x.data_ptr(), _native.DTYPE_CODES[x.dtype], n, h, sum(a.sizes[:comm.rank]), total, gs_ptr,
            gs_value, where[0][0], where[0][1], where[1][0], where[1][1], k, srcs, slots, offsets, row_bytes,
            state.launch_stream(session))
        if code:
            state.check("fused FP4 dispatch launch", code)


class Unfused(Fp4Path):
    """fp4.quantize into this rank's slice of the outputs, then an in-place comm.all_gatherv."""

    name = UNFUSED

    def why_not(self, comm, a: _Args, outs: _Outs) -> str | None:
        return None

    @staticmethod
    def _gather_args(comm, a: _Args, outs: _Outs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        first = sum(a.sizes[:comm.rank])
        mine = slice(first, first + a.x.shape[0])
        return [outs.packed[mine], outs.scales[mine], *a.extra], [outs.packed, outs.scales, *outs.extra]

    def run(self, comm, a: _Args, outs: _Outs, gather_algo: str) -> None:
        inputs, outputs = self._gather_args(comm, a, outs)
        fp4.quantize(a.x, a.gs, out=(inputs[0], inputs[1]))
        comm.all_gatherv(inputs, a.sizes, out=outputs, algo=gather_algo)

    def gather_choice(self, comm, a: _Args, outs: _Outs, gather_algo: str) -> Choice:
        if gather_algo != "auto":
            return Choice(gather_algo, {})
        inputs, outputs = self._gather_args(comm, a, outs)
        return comm.select("all_gatherv", inputs, out=outputs, sizes=a.sizes)


# Ordered by preference.
FP4_PATHS: tuple[Fp4Path, ...] = (FusedPush(), Unfused())
_BY_NAME = {p.name: p for p in FP4_PATHS}
_NAMES = [p.name for p in FP4_PATHS]


@dataclass(frozen=True)
class Fp4Choice(Choice):
    """Choice for all_gatherv_fp4: the FP4 path, why the others were passed over, and for the
    unfused path the inner all_gatherv's own Choice (None for the fused one)."""

    gather: Choice | None = None


def _choose(comm, a: _Args, outs: _Outs, algo: object) -> tuple[Fp4Path, str, dict[str, str]]:
    """(path, the all_gatherv algo for it, every path passed over with its reason)."""
    if not isinstance(algo, str):
        raise ArgumentError(f"algo must be a string, got {type(algo).__name__}")
    if algo in _BY_NAME:
        path = _BY_NAME[algo]
        reason = path.why_not(comm, a, outs)
        if reason is not None:
            raise ArgumentError(f"algo={algo!r} cannot serve this {OP}: {reason}")
        return path, "auto", {}
    if algo != "auto":
        if algo not in comm.algorithms():
            paths = comm.capabilities()["paths"]
            if algo in paths:
                raise ArgumentError(f"algo={algo!r} is unavailable: {paths[algo]['reason']}")
            raise ArgumentError(f"algo must be 'auto', an FP4 path ({', '.join(_BY_NAME)}) or a gather path of "
                                f"this communicator ({', '.join(comm.algorithms())}), got {algo!r}")
        return _BY_NAME[UNFUSED], algo, {FUSED: f"algo={algo!r} forces the unfused path with that gather"}
    rejected: dict[str, str] = {}
    for path in FP4_PATHS:
        reason = path.why_not(comm, a, outs)
        if reason is None:
            return path, "auto", rejected
        rejected[path.name] = reason
    raise ArgumentError(f"no path can serve this {OP}: " + "; ".join(f"{n}: {r}" for n, r in rejected.items()))


# ------------------------------------------------------------------------------ check mode
_OFFSETS_RULE = ("The fused path writes every peer's gathered outputs at this rank's offsets, so they must sit at "
                 "equal pool offsets: allocate them (equal shapes everywhere) inside use_symmetric_memory in the "
                 "same order on every rank, and tensors sized by this rank's rows (x, extra) outside it "
                 "(README, 'Offsets stay symmetric')")


def signature(comm, a: _Args, outs: _Outs, path: Fp4Path) -> tuple[list[int], list[str]]:
    """Check mode's vector for one call and each entry's name: checks.signature of the gather
    the path makes, under this op's name, with the global scale as its own scalar (every rank
    must quantize with the same one). For the fused path the outputs' pool regions and offsets
    are compared (peers write at them); the inputs are read locally and may sit anywhere. The
    unfused path's gather checks its own offsets. ``dequantize`` and ``swizzle`` act on this
    rank's copy only: they may differ by rank."""
    outputs = [t for _, t in outs.named()]
    inputs = [a.x, a.x, *a.extra]  # the payload and the scales both come from x
    call = Call("all_gatherv", inputs, outputs, [t.data_ptr() for t in inputs], [t.data_ptr() for t in outputs],
                a.sizes, None, sum(t.nbytes for t in outputs))
    pool = comm.symmetric_pool
    locate = pool.locate if path.name == FUSED and pool is not None else None
    scale = float(a.gs.item()) if isinstance(a.gs, torch.Tensor) else a.gs
    values, names = checks.signature(call, _NAMES.index(path.name), comm.world_size, locate, ("out",), OP,
                                     [("global_scale", checks.float_bits(scale))])
    for i, (name, _) in enumerate(outs.named()):
        names = [n.replace(f"'out[{i}]'", f"'{name}'") for n in names]
    return values, names


def verify(comm, a: _Args, outs: _Outs, path: Fp4Path) -> None:
    """Check mode, collective: this call's signature against every rank's."""
    values, names = signature(comm, a, outs, path)
    checks.compare(comm.peers, OP, values, names, _NAMES, {"global_scale": checks.bits_float}, _OFFSETS_RULE)


# ------------------------------------------------------------------------------ entry points
def all_gatherv_fp4(comm, x: torch.Tensor, sizes: Sequence[int], global_scale: fp4.GlobalScale,
                    extra: Sequence[torch.Tensor] = (), dequantize: bool = False, algo: str = "auto", *,
                    swizzle: bool = False, out: Fp4Gathered | None = None) -> Fp4Gathered:
    """Communicator.all_gatherv_fp4: NVFP4-quantize this rank's rows ``x`` [sizes[rank], H] and
    gather every rank's payload, scales and ``extra`` tensors (dim 0 = this rank's rows), in
    rank order, on the fused path where it can serve the call (see the module docstring).

    ``global_scale`` must be the same on every rank (``symcomm.fp4.global_scale_for(x, comm)``).
    ``dequantize=True`` adds the decoded rows; ``swizzle=True`` returns the scales in the 128x4
    GEMM layout; ``out`` (an Fp4Gathered) supplies preallocated gathered buffers: allocate them
    inside ``use_symmetric_memory`` for the fused path. ``algo``: "auto", an FP4 path
    (``fused-push``, ``unfused``), or an all_gatherv path of this communicator, which forces the
    unfused path with that gather. ``select(comm, ...)`` (or ``comm.select("all_gatherv_fp4",
    ...)``) explains the choice.
    """
    try:
        a = _validate(comm, x, sizes, global_scale, extra, out, dequantize)
        outs = _outputs(a)
        path, gather_algo, _ = _choose(comm, a, outs, algo)
    except Exception as exc:
        comm.refused(exc)  # check mode: peers waiting in this op's exchange raise too
        raise
    if comm.checking():
        verify(comm, a, outs, path)
    path.run(comm, a, outs, gather_algo)
    values = None
    if dequantize:
        values = fp4.dequantize(outs.packed, outs.scales, a.gs, a.x.dtype, out=None if out is None else out.values)
    scales = fp4.swizzle_scales(outs.scales) if swizzle else outs.scales
    return Fp4Gathered(outs.packed, scales, tuple(outs.extra), values, a.gs)


def select(comm, x: torch.Tensor, sizes: Sequence[int], global_scale: fp4.GlobalScale,
           extra: Sequence[torch.Tensor] = (), *, out: Fp4Gathered | None = None, swizzle: bool = False,
           algo: str = "auto") -> Fp4Choice:
    """The FP4 path all_gatherv_fp4 would take for these arguments, every other one with its
    reason, and the inner all_gatherv's choice for the unfused path. Local: nothing is
    communicated. With ``out=None`` it allocates the outputs as the call would (so inside
    use_symmetric_memory they land in the pool). ``swizzle`` does not change the choice: both
    paths swizzle the gathered scales afterwards."""
    del swizzle
    a = _validate(comm, x, sizes, global_scale, extra, out, False)
    outs = _outputs(a)
    path, gather_algo, rejected = _choose(comm, a, outs, algo)
    for other in FP4_PATHS:
        if other is not path and other.name not in rejected:
            rejected[other.name] = other.why_not(comm, a, outs) or f"ranked below {path.name} in fp4_gather.FP4_PATHS"
    inner = path.gather_choice(comm, a, outs, gather_algo) if isinstance(path, Unfused) else None
    return Fp4Choice(path.name, rejected, inner)


def fused_rows_host(x: torch.Tensor, global_scale: float, row_offset: int, packed: torch.Tensor,
                    scales: torch.Tensor) -> None:
    """The fused kernel's encoding and addressing run on the CPU (symcomm_ar_gatherv_fp4_host):
    writes x's rows (one rank's) into the gathered host buffers ``packed`` [total, H/2] and
    ``scales`` [total, H/16] (linear) at ``row_offset``, exactly where the kernel writes them on
    every rank. It exists so that CI without a GPU checks the kernel's bytes against the codec."""
    n, h = fp4._check_x(x)
    if x.device.type != "cpu" or x.dtype not in FUSED_DTYPES:
        raise ArgumentError(f"x must be a bfloat16 or float16 CPU tensor, got {x.dtype} on {x.device}")
    total = packed.shape[0] if isinstance(packed, torch.Tensor) else -1
    cpu = torch.device("cpu")
    validate.given("packed", packed, (total, h // 2), torch.uint8, cpu)
    validate.given("scales", scales, (total, h // fp4.BLOCK), torch.float8_e4m3fn, cpu)
    if isinstance(row_offset, bool) or not isinstance(row_offset, int) or not 0 <= row_offset <= total - n:
        raise ArgumentError(f"row_offset must be an int in [0, {total - n}], got {row_offset!r}")
    gs = fp4.check_global_scale(global_scale, cpu)
    gs = float(gs.item()) if isinstance(gs, torch.Tensor) else gs
    lib = fp4._host_lib()
    _native.check(lib, "symcomm_ar_gatherv_fp4_host", lib.symcomm_ar_gatherv_fp4_host(
        x.data_ptr(), _native.DTYPE_CODES[x.dtype], n, h, row_offset, total, gs, packed.data_ptr(),
        scales.data_ptr()))
