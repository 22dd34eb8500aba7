"""all_gatherv of NVFP4-quantized rows: Communicator.all_gatherv_fp4 delegates here.

Each rank quantizes its rows straight into its own slice of the gathered outputs, then one
in-place ``comm.all_gatherv`` moves payload, scales and any ``extra`` tensors (top-k ids,
weights) in one NCCL group. Writing into the output slice means no local staging buffer, and
when the outputs come from symmetric memory (allocated inside ``use_symmetric_memory``, or
passed as ``out``) the payload is symmetric too, so with equal sizes the dispatch can take
the zero-copy ``nccl-symm`` path on its own.

Every rank must use the same global scale: receivers decode every peer's rows with their own
copy of it. ``fp4.global_scale_for(x, comm)`` computes a shared one; check mode
(SYMCOMM_CHECK=1) compares it across ranks.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import torch

from . import fp4, validate
from .checks import REFUSED
from .errors import ArgumentError, CommClosedError, PeerMismatchError, SymcommError


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


def _capturing(comm) -> bool:
    return comm.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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


def _scale_bits(gs: fp4.GlobalScale) -> int:
    value = float(gs.item()) if isinstance(gs, torch.Tensor) else gs
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _agree_on_scale(comm, gs: fp4.GlobalScale | None) -> None:
    """Check mode: every rank sends (status, global scale bits). A rank whose own checks failed
    sends REFUSED and raises its own error; the others raise here instead of waiting for it."""
    table = comm.peers.exchange([REFUSED, 0] if gs is None else [0, _scale_bits(gs)])
    if gs is None:
        return
    refused = [r for r, (status, _) in enumerate(table) if status == REFUSED]
    if refused:
        raise PeerMismatchError(f"SYMCOMM_CHECK: all_gatherv_fp4: rank(s) {', '.join(map(str, refused))} "
                                f"rejected the call before communicating (their own error names the argument)")
    values = [struct.unpack("<f", struct.pack("<I", bits))[0] for _, bits in table]
    if any(v != values[0] for v in values):
        per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
        raise PeerMismatchError(f"SYMCOMM_CHECK: all_gatherv_fp4: ranks disagree on global_scale ({per_rank}); "
                                f"every rank must quantize with the same one (see fp4.global_scale_for)")


def all_gatherv_fp4(comm, x: torch.Tensor, sizes: Sequence[int], global_scale: fp4.GlobalScale,
                    extra: Sequence[torch.Tensor] = (), dequantize: bool = False, algo: str = "auto", *,
                    swizzle: bool = False, out: Fp4Gathered | None = None) -> Fp4Gathered:
    """Communicator.all_gatherv_fp4: NVFP4-quantize this rank's rows ``x`` [sizes[rank], H] and
    gather every rank's payload, scales and ``extra`` tensors (dim 0 = this rank's rows) in one
    NCCL group, in rank order.

    ``global_scale`` must be the same on every rank (``symcomm.fp4.global_scale_for(x, comm)``).
    ``dequantize=True`` adds the decoded rows; ``swizzle=True`` returns the scales in the 128x4
    GEMM layout; ``out`` (an Fp4Gathered) supplies preallocated gathered buffers.
    """
    checking = comm.check and not _capturing(comm)
    try:
        args = _validate(comm, x, sizes, global_scale, extra, out, dequantize)
    except SymcommError:
        if checking:
            _agree_on_scale(comm, None)
        else:
            comm.refused()  # during capture the Communicator may still check over a gloo group
        raise
    if checking:
        _agree_on_scale(comm, args.gs)
    x, sizes, gs = args.x, args.sizes, args.gs
    n, h = x.shape
    total, first = sum(sizes), sum(sizes[: comm.rank])
    if out is None:
        packed = torch.empty((total, h // 2), dtype=torch.uint8, device=x.device)
        scales = torch.empty((total, h // fp4.BLOCK), dtype=torch.float8_e4m3fn, device=x.device)
        extra_out = [None] * len(args.extra)
    else:
        packed, scales, extra_out = out.packed, out.scales, list(out.extra)
    mine = slice(first, first + n)
    fp4.quantize(x, gs, out=(packed[mine], scales[mine]))
    gathered = comm.all_gatherv([packed[mine], scales[mine], *args.extra], sizes,
                                out=[packed, scales, *extra_out], algo=algo)
    values = None
    if dequantize:
        values = fp4.dequantize(packed, scales, gs, x.dtype, out=None if out is None else out.values)
    if swizzle:
        scales = fp4.swizzle_scales(scales)
    return Fp4Gathered(packed, scales, tuple(gathered[2:]), values, gs)
