"""SYMCOMM_CHECK=1: compare each call's signature across ranks before it runs.

A rank that disagrees (another size, dtype, path, or a tensor at another window offset)
would otherwise hang NCCL or read the wrong peer memory. Every rank receives the same
gathered table, so every rank raises the same PeerMismatchError: no rank is left waiting.

The exchange is itself a small collective that synchronises with the host, so check mode is
for debugging, not production; it is skipped during CUDA-graph capture when the exchange
would need the GPU.
"""
from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Callable, Collection, Sequence

import torch

from ._nccl import DTYPES
from .base import Call, capturing
from .errors import PeerMismatchError
from .peers import PeerRefusal, Peers, ints_text, text_ints
from .validate import REDOPS

MAX_CHECKED_TENSORS = 8  # tensors with columns of their own; the rest of a list shares one digest
MAX_SCALARS = 6  # an operation's own result-changing scalars (fp4's global scale, the norm's eps...)
KIND = "check"  # the exchange's kind (peers.Peers frames every exchange with one)
# Codes for the signature only: every dtype NCCL knows, then the others torch's collectives move
# (two of one width must differ: a gather of int16 against uint16 bits is no agreed call); any
# dtype not listed shares the next code.
_DTYPE_LIST = (*DTYPES, torch.bool, torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.complex64,
               torch.complex128, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_DTYPES = {d: i for i, d in enumerate(_DTYPE_LIST)}
_OP_INTS = 3  # the op's name travels as text (24 characters): any operation, no code table
# Ops that split or join a lone tensor along dim 0, so its row bytes are part of the call.
_ROW_OPS = frozenset({"all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv", "all_to_allv"})
# The reduction, where one changes the result: "none" for gathers.
_REDOPS = ("none", *REDOPS)
# A cause of a path disagreement, not a disagreement of its own: custom-twoshot-push copies a
# misaligned input of one rank's into an aligned buffer and runs with its aligned peers.
MISALIGNMENT = "16-byte misalignment of the all_reduce input/output"


def _dtype_code(dtype: torch.dtype) -> int:
    """A dtype's code in a signature: NCCL's dtypes and bool by name, any other one shared code."""
    return _DTYPES.get(dtype, len(_DTYPES))


def _dtype_name(code: int) -> str:
    return [*map(str, _DTYPE_LIST), "another dtype"][code] if 0 <= code <= len(_DTYPES) else str(code)


def float_bits(value: float) -> int:
    """A float's fp32 bits, for comparing scales and eps exactly (they reach the kernels as fp32)."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


# What scale_bits gives a device scalar during CUDA-graph capture: reading it would synchronize,
# which ends the capture (and torch then aborts at the next memory pool's teardown). Every rank of
# a graph_capture() captures alike, so the check compares everything else.
ON_DEVICE_IN_CAPTURE = 1 << 32  # no fp32 bit pattern


def scale_bits(scale: float | torch.Tensor | None) -> int:
    """float_bits of a scale given as a number or a 1-element tensor (0 for None), for checks."""
    if scale is None:
        return 0
    if isinstance(scale, torch.Tensor):
        if capturing(scale.device):
            return ON_DEVICE_IN_CAPTURE
        scale = float(scale.item())
    return float_bits(scale)


def bits_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def signature(call: Call, path: int, world_size: int, locate: Callable[[int], tuple[int, int]] | None,
              compared: Collection[str] = ("x", "out"), op: str | None = None,
              scalars: Sequence[tuple[str, int]] = ()) -> tuple[list[int], list[str]]:
    """A fixed-length vector (the same length on every rank and for every operation, so ranks in
    different operations compare op codes, not lengths) and the name of each entry. ``path``
    is the chosen path's index among the communicator's paths (the same list on every rank);
    ``locate`` maps an address to (window region, offset) for paths that need equal offsets,
    applied to the tensors named in ``compared`` ("x" inputs, "out" outputs): a path that
    reads inputs only locally (custom-push) leaves per-rank inputs free to sit anywhere.
    ``op`` overrides the call's op (a composite operation checks the collective it makes under
    its own name); ``scalars`` are the operation's own result-changing values, by name.

    Window offsets are compared where the symmetric kernels need them equal. An in-place
    gather's input is this rank's slice of the output, at an offset that differs by rank by
    design, so it is recorded as the output's offset; likewise a reduce-scatter's output that
    is a slice of its input.
    """
    if len(scalars) > MAX_SCALARS:
        raise ValueError(f"at most {MAX_SCALARS} checked scalars, got {len(scalars)}")
    # Causes before symptoms: the path follows from the op, dtype, size and alignment, so a
    # size mismatch is reported as one, not as the path disagreement it also causes.
    values = [*text_ints(op or call.op, _OP_INTS), _dtype_code(call.dtype), len(call.inputs),
              _REDOPS.index(call.redop or "none")]
    names = ["op"] * _OP_INTS + ["dtype", "number of tensors", "reduction op"]
    values += [v for _, v in scalars] + [0] * (MAX_SCALARS - len(scalars))
    names += [n for n, _ in scalars] + [f"unused scalar {i}" for i in range(len(scalars), MAX_SCALARS)]
    # sizes before the byte count: a disagreement there is the cause, the byte count the symptom
    values += call.sizes if call.sizes is not None else [-1] * world_size
    names += [f"sizes[{r}]" for r in range(world_size)]
    values.append(call.nbytes)
    names.append("message size in bytes")
    # Misalignment sends an all_reduce off the custom kernels (they move 16-byte vectors): a
    # rank whose view is misaligned alone would wait in NCCL for peers that took a kernel.
    # Other ops: in-place gathers and scatters sit at rank-dependent offsets by design.
    values.append((call.in_ptrs[0] | call.out_ptrs[0]) & 15 if call.op == "all_reduce" else 0)
    names.append(MISALIGNMENT)
    many = len(call.inputs) > 1
    # A list of tensors: the totals above can agree while its tensors do not (row widths swapped
    # between ranks), and the dtype above is the first one's. An all-reduce's tensor may take any
    # shape (it is reduced element by element), but a gather or scatter splits dim 0, so there
    # a (2, 4) against a (4, 2) is no agreed call though the bytes are equal.
    rows_matter = many or call.op in _ROW_OPS
    for i in range(MAX_CHECKED_TENSORS):
        x = call.inputs[i] if rows_matter and i < len(call.inputs) else None
        values += [-1, -1] if x is None else [x.element_size() * math.prod(x.shape[1:]), _dtype_code(x.dtype)]
        names += [f"bytes of a row of tensor {i}", f"dtype of tensor {i}"]
    # Past the columns above, one digest: a mismatch there would make gloo abort the process and
    # NCCL read past a buffer, as anywhere else in the list.
    rest = [v for x in call.inputs[MAX_CHECKED_TENSORS:] for v in (x.element_size() * math.prod(x.shape[1:]),
                                                                    _dtype_code(x.dtype))] if many else []
    values.append(zlib.crc32(struct.pack(f"<{len(rest)}q", *rest)) if rest else -1)
    names.append(f"row bytes and dtypes of tensors {MAX_CHECKED_TENSORS} and later (a digest)")
    values.append(path)
    names.append("path")
    gathers = call.op in ("all_gather", "all_gatherv")
    for i in range(MAX_CHECKED_TENSORS):
        pair = i < len(call.inputs)
        x_ptr, out_ptr = (call.in_ptrs[i], call.out_ptrs[i]) if pair else (0, 0)
        if pair and gathers and out_ptr <= x_ptr < out_ptr + call.outputs[i].nbytes:
            x_ptr = out_ptr
        elif pair and not gathers and x_ptr <= out_ptr < x_ptr + call.inputs[i].nbytes:
            out_ptr = x_ptr
        for key, kind, ptr in (("x", "tensors" if gathers and call.op == "all_gatherv" else "x", x_ptr),
                               ("out", "out", out_ptr)):
            name = f"{kind}[{i}]" if many else kind
            values += locate(ptr) if locate is not None and pair and key in compared else [-1, -1]
            names += [f"window region of '{name}'", f"window offset of '{name}'"]
    return values, names


def signature_length(world_size: int) -> int:
    """The length of every signature at ``world_size`` (signature() has one for every call),
    read off the signature of an empty all_reduce."""
    empty = torch.empty(0)
    return len(signature(Call("all_reduce", (empty,), (empty,), (0,), (0,), None, "sum", 0), 0, world_size, None)[0])


def first_mismatch(table: list[list[int]], names: list[str], path_names: Sequence[str],
                   decode: dict[str, Callable[[int], object]] | None = None) -> str | None:
    """The first entry the ranks disagree on, with every rank's value, or None. ``decode``
    shows an entry's raw value readably (by name), for an operation's own scalars."""
    readable: dict[str, Callable[[int], object]] = {
        "path": lambda v: path_names[v] if 0 <= v < len(path_names) else v,
        "dtype": _dtype_name, "reduction op": lambda v: _REDOPS[v],
        **{f"dtype of tensor {i}": _dtype_name for i in range(MAX_CHECKED_TENSORS)},
        **(decode or {})}
    ops = [ints_text(row[:_OP_INTS]) for row in table]
    if any(op != ops[0] for op in ops):
        return "ranks disagree on the op (" + ", ".join(f"rank {r}: {op}" for r, op in enumerate(ops)) + ")"
    for column, name in enumerate(names):
        seen = [row[column] for row in table]
        if name == MISALIGNMENT and "path" in names:
            paths = [row[names.index("path")] for row in table]
            if all(p == paths[0] for p in paths):
                continue  # the ranks' paths agree, so each served its own alignment
        if any(v != seen[0] for v in seen):
            show = readable.get(name, lambda v: v)
            per_rank = ", ".join(f"rank {r}: {show(v)}" for r, v in enumerate(seen))
            return f"ranks disagree on the {name} ({per_rank})"
    return None


def verify(peers: Peers, call: Call, path: str, path_names: Sequence[str],
           locate: Callable[[int], tuple[int, int]] | None, compared: Collection[str] = ("x", "out"), *,
           op: str | None = None, scalars: Sequence[tuple[str, int]] = (),
           decode: dict[str, Callable[[int], object]] | None = None) -> None:
    """Collective: compare this call's signature with every rank's; raise the same
    PeerMismatchError on every rank when they differ. A rank that refused (``refuse``) makes
    the others raise with its reason."""
    values, names = signature(call, path_names.index(path), peers.world_size, locate, compared, op, scalars)
    compare(peers, op or call.op, values, names, path_names, decode)


def compare(peers: Peers, op: str, values: list[int], names: list[str], path_names: Sequence[str],
            decode: dict[str, Callable[[int], object]] | None = None, rule: str | None = None) -> None:
    """verify's exchange and verdict, for a signature built (and its names adjusted) by the
    caller. ``rule`` replaces the default advice where the first mismatch names a window."""
    try:
        table = peers.exchange(values, kind=KIND)
    except PeerRefusal as exc:
        raise PeerMismatchError(f"check mode: {op}: rank(s) {', '.join(map(str, exc.reasons))} rejected the "
                                f"call before communicating (" + "; ".join(f"rank {r}: {why}" for r, why in
                                                                         exc.reasons.items()) + ")") from None
    except PeerMismatchError as exc:
        raise PeerMismatchError(f"check mode: {op}: {exc}") from None
    problem = first_mismatch(table, names, path_names, decode)
    if problem is not None:
        advice = (rule if rule is not None and "window" in problem else
                  "Every rank must make the same call, and symmetric tensors must be allocated in the same order and "
                  "sizes on every rank")
        raise PeerMismatchError(f"check mode: {op}: {problem}. {advice}")


def refuse(peers: Peers, reason: str) -> None:
    """A rank whose call failed before communicating still joins the exchange its peers wait
    in, so they raise too, with ``reason``, instead of waiting for it."""
    peers.refuse(KIND, reason)
