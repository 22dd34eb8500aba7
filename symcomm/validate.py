"""The argument rules operations are built from (symcomm/operations/), before any communication.

Each rule raises ArgumentError (a ValueError) or DtypeError (also a TypeError) naming the
argument and the rule. ``out=None`` allocates the output with torch.empty, so inside
use_symmetric_memory it lands in the symmetric pool like any other tensor.
"""
from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import settings
from .errors import ArgumentError, DtypeError, shown

REDOPS = ("sum", "prod", "max", "min", "avg")
REDOP_SET = frozenset(REDOPS)
UNREDUCIBLE = frozenset({torch.bool, torch.complex32, torch.complex64, torch.complex128})
_compiling = torch.compiler.is_compiling
_inference_mode = torch.is_inference_mode_enabled
_STRIDED = torch.strided
# Dtypes whose tensors take validate.tensor's slow path: complex ones may be conjugated views,
# quantized ones are refused there.
_ODD_DTYPES = frozenset({torch.complex32, torch.complex64, torch.complex128, torch.qint8, torch.quint8, torch.qint32,
                         torch.quint4x2, torch.quint2x4})

# These checks run on every eager call, whose host cost over a raw ctypes NCCL call
# (bench/eager_overhead.py) is a few microseconds, a third of it here. So the happy path reads a
# few cheap attributes (get_device() returns an int; .device would build a torch.device) and
# only the failure path builds a message.


def resolve_device(device: torch.device | str | int | None, group: dist.ProcessGroup) -> torch.device:
    """The device rule: an explicit ``device`` wins; otherwise a group with an NCCL backend runs
    on the current CUDA device and a group without one (gloo) on the CPU, whatever GPUs the
    machine has, so a gloo program behaves the same on a laptop and on a GPU node."""
    if device is None:
        has_nccl = "nccl" in str(dist.get_backend(group))
        return torch.device("cuda", torch.cuda.current_device()) if has_nccl else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:  # an int with no accelerator, a bad string
        raise ArgumentError(f"device must name a cpu or cuda device, got {device!r}: {exc}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ArgumentError(f"device={device} requested but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device.type != "cpu":
        raise ArgumentError(f"device must be cpu or cuda, got {device}")
    return torch.device("cpu")  # "cpu:0" too: CPU tensors carry no index to compare with


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


def group_bound_s(group: dist.ProcessGroup) -> float:
    """The group's own timeout, capped at settings.MAX_TIMEOUT_S (a group may wait longer than
    symcomm will): the default bound, and the one that holds before the settings are checked."""
    return min(group_timeout_s(group), settings.MAX_TIMEOUT_S)


def timeout(timeout_s: object, group: dist.ProcessGroup) -> tuple[float, str]:
    """(seconds, where they came from): the argument, else SYMCOMM_TIMEOUT_S (both under
    settings.checked_timeout's rule), else the group's own timeout, capped at
    settings.MAX_TIMEOUT_S (a group may wait longer than symcomm will)."""
    if timeout_s is not None:
        return settings.checked_timeout(timeout_s, "timeout_s"), "argument"
    from_env = settings.timeout_s(default=None)
    if from_env is not None:
        return from_env, "SYMCOMM_TIMEOUT_S"
    return group_bound_s(group), "process group"


def flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ArgumentError(f"{name} must be a bool, got {value!r}")
    return value


def integral(value: object) -> int | None:
    """``value`` as an int where it is an integer: a Python int, a NumPy integer, a 0-d integer
    tensor (whatever operator.index takes). None for anything else, bools included (Python's,
    NumPy's, torch's): True would pass as 1 by accident, as NumPy 1.x's operator.index lets it;
    and a 1-element tensor of any shape is not one number."""
    if type(value) is int:  # the common case, first: these checks run on every eager call
        return value
    if isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", None) == "b" or (
            isinstance(value, torch.Tensor) and (value.ndim or value.dtype is torch.bool)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def real(value: object) -> float | None:
    """``value`` as a float where it is a real number: a Python int or float, a NumPy scalar
    (numbers.Real); an int past float's range gives inf, for the caller's finiteness rule to
    refuse. None for anything else, bools included."""
    if type(value) is float:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf


def count(name: str, value: object, low: int, high: int) -> int:
    n = integral(value)
    if n is None or not low <= n <= high:
        raise ArgumentError(f"{name} must be an int from {low} to {high}, got {shown(value)}")
    return n


def capacity(name: str, value: object, multiple: int) -> int:
    n = integral(value)
    if n is None or n < 0 or n % multiple:
        raise ArgumentError(f"{name} must be a non-negative multiple of {multiple} bytes, got {shown(value)}")
    return n


def communicator_key(comm: object) -> int:
    """The registry key of ``comm``, for helpers that take a Communicator beside tensors; anything
    else is refused by name here rather than failing deep inside (or in backward)."""
    key = getattr(comm, "key", None)
    if type(key) is not int:
        raise ArgumentError(f"comm must be a symcomm.Communicator, got {type(comm).__name__}")
    return key


def tensor(name: str, t: object, device: torch.device) -> torch.Tensor:
    index = device.index
    # Every path moves a tensor's memory as dense bytes. Complex and quantized dtypes leave the
    # fast path on their dtype alone (one set lookup): a conjugated view's memory holds the
    # values before conjugation, a quantized tensor's holds codes. A real tensor can still carry
    # the negation bit (z.conj().imag); Dynamo cannot trace is_neg/is_conj (they return bools),
    # and a traced program has no lazy views to refuse: its inputs are resolved first.
    if isinstance(t, torch.Tensor) and t.layout is _STRIDED and t.dtype not in _ODD_DTYPES and not t.is_nested and (
            t.is_contiguous()) and (t.get_device() == index if index is not None else t.device == device) and (
            _compiling() or not t.is_neg()):
        return t
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    # torch's own answers to is_contiguous or data_ptr for these are internal errors.
    if t.is_quantized:
        raise DtypeError(f"{name} is a quantized tensor ({t.dtype}): symcomm moves plain dense tensors; pass "
                         f"{name}.int_repr() or {name}.dequantize()")
    if t.is_nested:
        raise ArgumentError(f"{name} is a nested tensor: symcomm moves plain dense tensors; pass its components "
                            f"(unbind()) or a padded tensor (to_padded_tensor)")
    if t.layout is not _STRIDED:
        raise ArgumentError(f"{name} has layout {t.layout}: symcomm moves dense strided tensors; call "
                            f"{name}.to_dense() first")
    if t.device != device:
        raise ArgumentError(f"{name} is on {t.device}, but the call runs on {device}")
    if not _compiling() and (t.is_conj() or t.is_neg()):
        raise ArgumentError(f"{name} is a lazily {'conjugated' if t.is_conj() else 'negated'} view, whose memory "
                            f"does not hold its values: call .resolve_conj() and .resolve_neg() first")
    if not t.is_contiguous():
        raise ArgumentError(f"{name} must be contiguous (call .contiguous() first)")
    return t  # a complex tensor that is neither a conjugated nor a negated view


def given(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A caller-supplied output: a contiguous tensor on ``device`` of this dtype and shape."""
    t = tensor(name, t, device)
    if t.dtype is not dtype:
        raise DtypeError(f"{name} must be {dtype}, got dtype {t.dtype}")
    if t.shape != shape:
        raise ArgumentError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def destination(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """A caller-supplied tensor the call writes into: ``given``'s rules and ``writable``'s."""
    t = given(name, t, shape, dtype, device)
    # Under torch.compile the traced program's own functionalization refuses such writes while
    # tracing, before anything runs (and Dynamo cannot trace is_inference).
    if not _compiling() and may_refuse_write(t):
        writable(name, t)
    return t


def may_refuse_write(t: torch.Tensor) -> bool:
    """Whether ``writable`` could refuse ``t``, in the order that costs least where it cannot: a
    serving loop runs under inference mode, where its inference tensors may be written (one
    call, no tensor attribute), and training tensors that need no grad fail the first test."""
    return t.requires_grad or (not _inference_mode() and t.is_inference())


def output(name: str, out: object, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    return destination(name, out, shape, like.dtype, like.device)


def writable(name: str, t: torch.Tensor) -> None:
    """A tensor the call writes into. torch refuses to write into a leaf that requires grad (or a
    view of one) while grad mode is on, and into an inference tensor outside inference mode, but
    only when the data arrives: after the collective ran, so the peers would wait for this rank
    in the next one. Refused here first, by name, before any communication. (One refusal still
    comes late: writing into a view that a multi-output op such as unbind made of a non-leaf;
    torch has no public way to tell such a view apart, nor a public view base: ``_base`` is what
    torch's own checks read.)"""
    argument = name.split("[")[0].split(".")[0]
    if t.is_inference() and not _inference_mode():
        raise ArgumentError(f"{name} was made under torch.inference_mode(), and autograd lets nothing write "
                            f"into such a tensor outside it: pass {argument}=None for a new tensor")
    if t.requires_grad and torch.is_grad_enabled():
        base = t._base if t._base is not None else t
        if base.is_leaf:
            view = "a view of " if base is not t else ""
            raise ArgumentError(f"{name} is {view}a leaf tensor that requires grad, which autograd lets nothing "
                                f"write into in place: pass {argument}=None for a new tensor, or one that does "
                                f"not require grad (or call under torch.no_grad())")


def recordable(outputs: Sequence[tuple[str, torch.Tensor]]) -> None:
    """The outputs of a call autograd records (grad mode is on), each checked by ``writable``."""
    for name, t in outputs:
        writable(name, t)


def redop(op: object, dtype: torch.dtype) -> str:
    if not isinstance(op, str) or op not in REDOP_SET:
        raise ArgumentError(f"op must be one of {', '.join(REDOPS)}, got {op!r}")
    if dtype in UNREDUCIBLE:
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


def sizes_arg(sizes: object, world_size: int, name: str = "sizes") -> list[int]:
    if not isinstance(sizes, Sequence) and hasattr(sizes, "tolist"):  # a tensor, a NumPy array
        sizes = sizes.tolist()
    if not isinstance(sizes, Sequence) or isinstance(sizes, (str, bytes)):
        raise ArgumentError(f"{name} must be a sequence of {world_size} ints, got {type(sizes).__name__}")
    entry_count(name, sizes, world_size)
    clean = []
    for i, s in enumerate(sizes):
        n = integral(s)
        if n is None:
            raise ArgumentError(f"{name}[{i}] must be an int, got {type(s).__name__}")
        s = n
        if s < 0:
            raise ArgumentError(f"{name}[{i}] must be >= 0, got {shown(s)}")
        if s > MAX_EXTENT:
            raise ArgumentError(f"{name}[{i}] = {shown(s)} rows is more than any tensor can hold (at most 2**62)")
        clean.append(s)
    if sum(clean) > MAX_EXTENT:
        raise ArgumentError(f"{name} add up to {shown(sum(clean))} rows, more than any tensor can hold (at most 2**62)")
    return clean


def entry_count(name: str, sizes: Sequence[object], world_size: int) -> None:
    """Per-rank sizes have one entry per rank."""
    if len(sizes) != world_size:
        raise ArgumentError(f"{name} must have one entry per rank ({world_size}), got {len(sizes)}")


def check_extent(name: str, rows: int, like: torch.Tensor) -> None:
    """Refuse an output of ``rows`` rows shaped like ``like`` that no allocation could hold."""
    row_bytes = like.element_size() * math.prod(like.shape[1:])
    if rows * row_bytes > MAX_EXTENT:
        raise ArgumentError(f"{name} would need {rows} rows of {row_bytes} bytes: more than any tensor can hold "
                            f"(2**62 bytes); check sizes")


def apart(ins: Sequence[tuple[str, torch.Tensor]], outs: Sequence[tuple[str, torch.Tensor]], what: str,
          paired: int) -> None:
    """The named tensors of a call with several: outs[i] for i < ``paired`` may share memory with
    ins[i] only (the call's own in-place rule, checked pair by pair), any other output with
    nothing, since the call would write it while it still reads or writes the other tensor."""
    for i, (out_name, o) in enumerate(outs):
        lo, hi = o.data_ptr(), o.data_ptr() + o.nbytes
        if lo == hi:
            continue
        others = [*outs[i + 1:], *(pair for j, pair in enumerate(ins) if j != i or i >= paired)]
        for name, t in others:
            if t.nbytes and t.data_ptr() < hi and lo < t.data_ptr() + t.nbytes:
                but = " but its own input" if i < paired else ""
                raise ArgumentError(f"{out_name} overlaps {name}: each output of {what} needs memory of its own, "
                                    f"apart from every other tensor of the call{but}")


def in_place(part: str, part_ptr: int, part_nbytes: int, whole: str, whole_ptr: int,
              whole_nbytes: int, slot_ptr: int) -> bool:
    """True if ``part`` sits exactly at this rank's slot of ``whole`` (an in-place call), False
    if the two are disjoint. Any other overlap would let NCCL overwrite what it still reads."""
    if not part_nbytes or part_ptr >= whole_ptr + whole_nbytes or whole_ptr >= part_ptr + part_nbytes:
        return False
    if part_ptr == slot_ptr:
        return True
    raise ArgumentError(f"{part} overlaps {whole} but is not this rank's slice of it: pass this "
                        f"rank's slice for an in-place call, or non-overlapping tensors")
