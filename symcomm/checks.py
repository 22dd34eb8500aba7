"""SYMCOMM_CHECK=1: compare each call's signature across ranks before it runs.

A rank that disagrees (another size, dtype, path, or a tensor at another window offset)
would otherwise hang NCCL or read the wrong peer memory. Every rank receives the same
gathered table, so every rank raises the same PeerMismatchError: no rank is left waiting.

The exchange is itself a small collective that synchronises with the host, so check mode is
for debugging, not production; it is skipped during CUDA-graph capture when the exchange
would need the GPU.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .backends.base import OPS, Call

MAX_CHECKED_TENSORS = 8  # all_gatherv lists longer than this have their tail unchecked
_ALGOS = ("nccl", "nccl-symm", "torch")
_DTYPES = {d: i for i, d in enumerate([
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
    torch.int32, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2, torch.bool])}


def signature(call: Call, algo: str, world_size: int,
              locate: Callable[[torch.Tensor], tuple[int, int]] | None) -> tuple[list[int], list[str]]:
    """A fixed-length vector (same length on every rank) and the name of each entry."""
    values = [OPS.index(call.op), _ALGOS.index(algo), _DTYPES.get(call.dtype, len(_DTYPES)), len(call.inputs)]
    names = ["op", "path", "dtype", "number of tensors"]
    # sizes before the byte count: a disagreement there is the cause, the byte count the symptom
    values += call.sizes if call.sizes is not None else [-1] * world_size
    names += [f"sizes[{r}]" for r in range(world_size)]
    values.append(call.nbytes)
    names.append("message size in bytes")
    many = len(call.inputs) > 1
    for i in range(MAX_CHECKED_TENSORS):
        for kind, tensors in (("tensors" if call.op == "all_gatherv" else "x", call.inputs), ("out", call.outputs)):
            name = f"{kind}[{i}]" if many else kind
            region, offset = (locate(tensors[i]) if locate is not None and i < len(tensors) else (-1, -1))
            values += [region, offset]
            names += [f"window region of '{name}'", f"window offset of '{name}'"]
    return values, names


_DECODE = {"op": OPS, "path": _ALGOS, "dtype": [*map(str, _DTYPES), "other"]}


def first_mismatch(table: list[list[int]], names: list[str]) -> str | None:
    for column, name in enumerate(names):
        seen = [row[column] for row in table]
        if any(v != seen[0] for v in seen):
            shown = [_DECODE[name][v] for v in seen] if name in _DECODE else seen
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown))
            return f"ranks disagree on the {name} ({per_rank})"
    return None
