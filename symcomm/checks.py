"""SYMCOMM_CHECK=1: compare each call's signature across ranks before it runs.

A rank that disagrees (another size, dtype, path, or a tensor at another window offset)
would otherwise hang NCCL or read the wrong peer memory. Every rank receives the same
gathered table, so every rank raises the same PeerMismatchError: no rank is left waiting.

The exchange is itself a small collective that synchronises with the host, so check mode is
for debugging, not production; it is skipped during CUDA-graph capture when the exchange
would need the GPU.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from ._nccl import DTYPES
from .base import OPS, Call, Peers
from .errors import PeerMismatchError

MAX_CHECKED_TENSORS = 8  # all_gatherv lists longer than this have their tail unchecked
# Codes for the signature only: every dtype NCCL knows, then bool; any other shares the next.
_DTYPE_LIST = (*DTYPES, torch.bool)
_DTYPES = {d: i for i, d in enumerate(_DTYPE_LIST)}


REFUSED = -1  # first entry of a rank that rejected the call before communicating


def signature(call: Call, path: int, world_size: int, locate: Callable[[int], tuple[int, int]] | None,
              compared: Collection[str] = ("x", "out")) -> tuple[list[int], list[str]]:
    """A fixed-length vector (same length on every rank) and the name of each entry. ``path``
    is the chosen path's index among the communicator's paths (the same list on every rank);
    ``locate`` maps an address to (window region, offset) for paths that need equal offsets,
    applied to the tensors named in ``compared`` ("x" inputs, "out" outputs): a path that
    reads inputs only locally (custom-push) leaves per-rank inputs free to sit anywhere.

    Window offsets are compared where the symmetric kernels need them equal. An in-place
    gather's input is this rank's slice of the output, at an offset that differs by rank by
    design, so it is recorded as the output's offset; likewise a reduce-scatter's output that
    is a slice of its input.
    """
    # Causes before symptoms: the path follows from the op, dtype, size and alignment, so a
    # size mismatch is reported as one, not as the path disagreement it also causes.
    values = [OPS.index(call.op), _DTYPES.get(call.dtype, len(_DTYPES)), len(call.inputs)]
    names = ["op", "dtype", "number of tensors"]
    # sizes before the byte count: a disagreement there is the cause, the byte count the symptom
    values += call.sizes if call.sizes is not None else [-1] * world_size
    names += [f"sizes[{r}]" for r in range(world_size)]
    values.append(call.nbytes)
    names.append("message size in bytes")
    # Misalignment sends an all_reduce off the custom kernels (they move 16-byte vectors): a
    # rank whose view is misaligned alone would wait in NCCL for peers that took a kernel.
    # Other ops: in-place gathers and scatters sit at rank-dependent offsets by design.
    values.append((call.in_ptrs[0] | call.out_ptrs[0]) & 15 if call.op == "all_reduce" else 0)
    names.append("16-byte misalignment of the all_reduce input/output")
    values.append(path)
    names.append("path")
    many = len(call.inputs) > 1
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


def refusal(world_size: int) -> list[int]:
    """What a rank that rejected the call sends instead of its signature (same length)."""
    return [REFUSED] * (6 + world_size + 4 * MAX_CHECKED_TENSORS)


def first_mismatch(table: list[list[int]], names: list[str], path_names: Sequence[str]) -> str | None:
    refused = [r for r, row in enumerate(table) if row[0] == REFUSED]
    if refused:
        return (f"rank(s) {', '.join(map(str, refused))} rejected the call before communicating "
                f"(their own error names the argument)")
    for column, name in enumerate(names):
        seen = [row[column] for row in table]
        if any(v != seen[0] for v in seen):
            decode = {"op": OPS, "path": path_names, "dtype": [*map(str, _DTYPE_LIST), "other"]}.get(name)
            shown = [decode[v] for v in seen] if decode is not None else seen
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown))
            return f"ranks disagree on the {name} ({per_rank})"
    return None


def verify(peers: Peers, call: Call, path: str, path_names: Sequence[str],
           locate: Callable[[int], tuple[int, int]] | None, compared: Collection[str] = ("x", "out")) -> None:
    """Collective: compare this call's signature with every rank's; raise the same
    PeerMismatchError on every rank when they differ."""
    values, names = signature(call, path_names.index(path), peers.world_size, locate, compared)
    problem = first_mismatch(peers.exchange(values), names, path_names)
    if problem is not None:
        raise PeerMismatchError(f"SYMCOMM_CHECK: {call.op}: {problem}. Every rank must make the same call, "
                                f"and symmetric tensors must be allocated in the same order and sizes on every rank")


def refuse(peers: Peers) -> None:
    """A rank whose call failed its own checks still joins the exchange its peers wait in, so
    they raise too instead of waiting for it."""
    peers.exchange(refusal(peers.world_size))
