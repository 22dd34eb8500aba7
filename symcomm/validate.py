"""Argument checks that turn a collective's arguments into a Call, before any communication.

Each rule raises ArgumentError (a ValueError) or DtypeError (also a TypeError) naming the
argument and the rule. ``out=None`` allocates the output with torch.empty, so inside
use_symmetric_memory it lands in the symmetric pool like any other tensor.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import settings
from .base import Call
from .errors import ArgumentError, DtypeError

REDOPS = ("sum", "prod", "max", "min", "avg")
_REDOP_SET = frozenset(REDOPS)
_UNREDUCIBLE = frozenset({torch.bool, torch.complex32, torch.complex64, torch.complex128})

# These checks run on every eager call, inside the <= 3 us budget symcomm may add over a raw
# ctypes NCCL call (bench/eager_overhead.py). So the happy path reads a few cheap attributes
# (get_device() returns an int; .device would build a torch.device) and only the failure
# path builds a message.


def resolve_device(device: torch.device | str | int | None, group: dist.ProcessGroup) -> torch.device:
    """The device rule: an explicit ``device`` wins; otherwise a group with an NCCL backend runs
    on the current CUDA device and a group without one (gloo) on the CPU, whatever GPUs the
    machine has, so a gloo program behaves the same on a laptop and on a GPU node."""
    if device is None:
        has_nccl = "nccl" in str(dist.get_backend(group))
        return torch.device("cuda", torch.cuda.current_device()) if has_nccl else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ArgumentError(f"device={device} requested but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device.type != "cpu":
        raise ArgumentError(f"device must be cpu or cuda, got {device}")
    return device


def group_timeout_s(group: dist.ProcessGroup) -> float:
    """How long torch.distributed itself waits on this group (init_process_group's or
    new_group's ``timeout``; 10 minutes for NCCL, 30 for gloo by default). symcomm waits on
    peers as long: a rank that compiles or checkpoints for a minute is not a failure to NCCL,
    so it must not be one to symcomm's kernels either. The group keeps the value only in its
    backends' options, a private attribute; without it, torch's documented default applies."""
    for device_type in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device_type)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            continue
    return dist.default_pg_timeout.total_seconds()


def timeout(timeout_s: object, group: dist.ProcessGroup) -> tuple[float, str]:
    """(seconds, where they came from): the argument, else SYMCOMM_TIMEOUT_S (both under
    settings.checked_timeout's rule), else the group's own timeout, capped at
    settings.MAX_TIMEOUT_S (a group may wait longer than symcomm will)."""
    if timeout_s is not None:
        return settings.checked_timeout(timeout_s, "timeout_s"), "argument"
    from_env = settings.timeout_s(default=None)
    if from_env is not None:
        return from_env, "SYMCOMM_TIMEOUT_S"
    return min(group_timeout_s(group), settings.MAX_TIMEOUT_S), "process group"


def capacity(name: str, value: object, multiple: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value % multiple:
        raise ArgumentError(f"{name} must be a non-negative multiple of {multiple} bytes, got {value!r}")
    return value


def tensor(name: str, t: object, device: torch.device) -> torch.Tensor:
    index = device.index
    if isinstance(t, torch.Tensor) and t.is_contiguous() and (
            t.get_device() == index if index is not None else t.device == device):
        return t
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ArgumentError(f"{name} is on {t.device}, but the call runs on {device}")
    raise ArgumentError(f"{name} must be contiguous (call .contiguous() first)")


def given(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A caller-supplied output: a contiguous tensor on ``device`` of this dtype and shape."""
    t = tensor(name, t, device)
    if t.dtype is not dtype:
        raise DtypeError(f"{name} must be {dtype}, got dtype {t.dtype}")
    if t.shape != shape:
        raise ArgumentError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def output(name: str, out: object, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    return given(name, out, shape, like.dtype, like.device)


def redop(op: object, dtype: torch.dtype) -> str:
    if op not in _REDOP_SET:
        raise ArgumentError(f"op must be one of {', '.join(REDOPS)}, got {op!r}")
    if dtype in _UNREDUCIBLE:
        raise DtypeError(f"cannot reduce dtype {dtype}")
    if op == "avg" and not dtype.is_floating_point:
        raise DtypeError(f"op='avg' needs a floating-point dtype, got {dtype}")
    return op


def rows(name: str, t: torch.Tensor) -> int:
    if t.ndim == 0:
        raise ArgumentError(f"{name} must have at least one dimension (collectives split dim 0)")
    return t.shape[0]


# The most rows or bytes a size may name: beyond it no tensor can exist (torch counts in int64),
# so such a call is refused here rather than by torch.empty (RuntimeError, or TypeError past int64).
MAX_EXTENT = 1 << 62


def sizes_arg(sizes: object, world_size: int) -> list[int]:
    if isinstance(sizes, torch.Tensor):
        sizes = sizes.tolist()
    if not isinstance(sizes, Sequence) or isinstance(sizes, (str, bytes)):
        raise ArgumentError(f"sizes must be a sequence of {world_size} ints, got {type(sizes).__name__}")
    if len(sizes) != world_size:
        raise ArgumentError(f"sizes must have one entry per rank ({world_size}), got {len(sizes)}")
    clean = []
    for i, s in enumerate(sizes):
        try:
            if isinstance(s, bool):
                raise TypeError
            s = operator.index(s)  # any integral: int, a NumPy integer, a 0-d integer tensor
        except TypeError:
            raise ArgumentError(f"sizes[{i}] must be an int, got {type(s).__name__}") from None
        if s < 0:
            raise ArgumentError(f"sizes[{i}] must be >= 0, got {s}")
        if s > MAX_EXTENT:
            raise ArgumentError(f"sizes[{i}] = {s} rows is more than any tensor can hold (at most 2**62)")
        clean.append(s)
    if sum(clean) > MAX_EXTENT:
        raise ArgumentError(f"sizes add up to {sum(clean)} rows, more than any tensor can hold (at most 2**62)")
    return clean


def check_extent(name: str, rows: int, like: torch.Tensor) -> None:
    """Refuse an output of ``rows`` rows shaped like ``like`` that no allocation could hold."""
    row_bytes = like.element_size() * math.prod(like.shape[1:])
    if rows * row_bytes > MAX_EXTENT:
        raise ArgumentError(f"{name} would need {rows} rows of {row_bytes} bytes: more than any tensor can hold "
                            f"(2**62 bytes); check sizes")


def _in_place(part: str, part_ptr: int, part_nbytes: int, whole: str, whole_ptr: int,
              whole_nbytes: int, slot_ptr: int) -> bool:
    """True if ``part`` sits exactly at this rank's slot of ``whole`` (an in-place call), False
    if the two are disjoint. Any other overlap would let NCCL overwrite what it still reads."""
    if not part_nbytes or part_ptr >= whole_ptr + whole_nbytes or whole_ptr >= part_ptr + part_nbytes:
        return False
    if part_ptr == slot_ptr:
        return True
    raise ArgumentError(f"{part} overlaps {whole} but is not this rank's slice of it: pass this "
                        f"rank's slice for an in-place call, or non-overlapping tensors")


def all_reduce(x: object, out: object, op: object, device: torch.device) -> Call:
    # The hottest eager path: the common case is inlined, the helpers only raise.
    x = tensor("x", x, device)
    dtype = x.dtype
    if op not in _REDOP_SET or dtype in _UNREDUCIBLE or (op == "avg" and not dtype.is_floating_point):
        redop(op, dtype)
    x_ptr, nbytes = x.data_ptr(), x.nbytes
    if out is None:
        out = torch.empty_like(x)
        out_ptr = out.data_ptr()
    elif out is x:
        out_ptr = x_ptr
    else:
        out = tensor("out", out, device)
        if out.dtype is not dtype or out.shape != x.shape:
            output("out", out, x.shape, x)
        out_ptr = out.data_ptr()
        if out_ptr != x_ptr and out_ptr < x_ptr + nbytes and x_ptr < out_ptr + nbytes:
            _in_place("out", out_ptr, nbytes, "x", x_ptr, nbytes, x_ptr)  # raises: partial overlap
    # In place measured differently (one-shot stages an in-place input): its own table row.
    return Call("all_reduce", (x,), (out,), (x_ptr,), (out_ptr,), None, op, nbytes,
                "all_reduce:inplace" if out_ptr == x_ptr else None)


def all_gather(x: object, out: object, rank: int, world_size: int, device: torch.device) -> Call:
    x = tensor("x", x, device)
    n = rows("x", x)
    out = output("out", out, (world_size * n, *x.shape[1:]), x)
    x_ptr, out_ptr, nbytes = x.data_ptr(), out.data_ptr(), out.nbytes
    call = Call("all_gather", (x,), (out,), (x_ptr,), (out_ptr,), None, None, nbytes)
    if _in_place("x", x_ptr, x.nbytes, "out", out_ptr, nbytes, out_ptr + rank * x.nbytes):
        call.table_key = "all_gather:inplace"
    return call


def reduce_scatter(x: object, out: object, op: object, rank: int, world_size: int,
                   device: torch.device) -> Call:
    x = tensor("x", x, device)
    op = redop(op, x.dtype)
    n = rows("x", x)
    if n % world_size:
        raise ArgumentError(f"x.shape[0] ({n}) must be divisible by the world size ({world_size})")
    out = output("out", out, (n // world_size, *x.shape[1:]), x)
    x_ptr, out_ptr = x.data_ptr(), out.data_ptr()
    inplace = _in_place("out", out_ptr, out.nbytes, "x", x_ptr, x.nbytes, x_ptr + rank * out.nbytes)
    return Call("reduce_scatter", (x,), (out,), (x_ptr,), (out_ptr,), None, op, x.nbytes,
                "reduce_scatter:inplace" if inplace else None)


def all_gatherv(tensors: object, sizes: object, out: object, rank: int, world_size: int,
                device: torch.device) -> Call:
    single = isinstance(tensors, torch.Tensor)
    xs = [tensors] if single else list(tensors) if isinstance(tensors, (list, tuple)) else None
    if not xs:
        raise ArgumentError("tensors must be a tensor or a non-empty list of tensors")
    sizes = sizes_arg(sizes, world_size)
    if out is None:
        outs = [None] * len(xs)
    elif single:
        outs = [out]
    elif isinstance(out, (list, tuple)) and len(out) == len(xs):
        outs = list(out)
    else:
        raise ArgumentError(f"out must be a list of {len(xs)} tensors, matching tensors")
    total, before = sum(sizes), sum(sizes[:rank])
    for i, x in enumerate(xs):
        name, out_name = ("tensors", "out") if single else (f"tensors[{i}]", f"out[{i}]")
        xs[i] = x = tensor(name, x, device)
        if rows(name, x) != sizes[rank]:
            raise ArgumentError(f"{name} has {x.shape[0]} rows, but sizes[{rank}] (this rank) is {sizes[rank]}")
        check_extent(out_name, total, x)
        outs[i] = o = output(out_name, outs[i], (total, *x.shape[1:]), x)
        row_bytes = o.nbytes // total if total else 0
        _in_place(name, x.data_ptr(), x.nbytes, out_name, o.data_ptr(), o.nbytes, o.data_ptr() + before * row_bytes)
    in_ptrs, out_ptrs = [x.data_ptr() for x in xs], [o.data_ptr() for o in outs]
    return Call("all_gatherv", xs, outs, in_ptrs, out_ptrs, sizes, None, sum(o.nbytes for o in outs))


def reduce_scatterv(x: object, sizes: object, out: object, op: object, rank: int, world_size: int,
                    device: torch.device) -> Call:
    x = tensor("x", x, device)
    op = redop(op, x.dtype)
    sizes = sizes_arg(sizes, world_size)
    total = sum(sizes)
    if rows("x", x) != total:
        raise ArgumentError(f"x has {x.shape[0]} rows, but sizes add up to {total}")
    out = output("out", out, (sizes[rank], *x.shape[1:]), x)
    x_ptr, out_ptr = x.data_ptr(), out.data_ptr()
    row_bytes = x.nbytes // total if total else 0
    _in_place("out", out_ptr, out.nbytes, "x", x_ptr, x.nbytes, x_ptr + sum(sizes[:rank]) * row_bytes)
    return Call("reduce_scatterv", (x,), (out,), (x_ptr,), (out_ptr,), sizes, op, x.nbytes)


# op -> builder(comm, x, out, sizes, reduce_op), for Communicator.select(), which names the op
# as a string; the collectives call their own builder directly.
BUILDERS = {
    "all_reduce": lambda c, x, out, sizes, redop: all_reduce(x, out, redop, c.device),
    "all_gather": lambda c, x, out, sizes, redop: all_gather(x, out, c.rank, c.world_size, c.device),
    "all_gatherv": lambda c, x, out, sizes, redop: all_gatherv(x, sizes, out, c.rank, c.world_size, c.device),
    "reduce_scatter": lambda c, x, out, sizes, redop: reduce_scatter(x, out, redop, c.rank, c.world_size, c.device),
    "reduce_scatterv": lambda c, x, out, sizes, redop: reduce_scatterv(x, sizes, out, redop, c.rank, c.world_size,
                                                                       c.device),
}
