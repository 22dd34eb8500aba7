"""Correctness data: seeded inputs every rank can regenerate, float64 expectations, tolerances.

Each rank's input comes from a generator seeded by (seed, rank, size), so any rank can rebuild
any other rank's input and compute the expected result locally, with no extra communication.
Which ranks' elements make up an output is the op's spec's to say (collectives.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

_MASK64 = (1 << 64) - 1
# Largest integer input magnitude where values combine (sum, avg, prod).
_INT_CAP = 16

# Relative tolerance per rank for reductions that round (sum, avg, prod): one rounding per
# partial result, each within half an ulp, so world * eps bounds the accumulated error.
_EPS_PER_RANK: dict[torch.dtype, float] = {
    torch.bfloat16: 2.0**-7,
    torch.float16: 2.0**-10,
    torch.float8_e4m3fn: 2.0**-3,
    torch.float8_e5m2: 2.0**-2,
}
_FLAT_TOL: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float64: 1e-12}


def seed_for(seed: int, rank: int, nbytes: int) -> int:
    """Mixes the three keys into one 63-bit seed (splitmix64 finaliser), stable across runs."""
    x = (seed * 0x9E3779B97F4A7C15 + rank * 0xBF58476D1CE4E5B9 + nbytes) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def int_magnitude(dtype: torch.dtype, redop: str, world: int) -> int:
    """Largest |value| for integer inputs such that the reduction cannot overflow."""
    top = torch.iinfo(dtype).max
    if redop in ("sum", "avg"):
        limit = top // world
    elif redop == "prod":
        # Counting past the cap below changes nothing and, at world 1, would count to top.
        limit = 1
        while limit < _INT_CAP and (limit + 1) ** world <= top:
            limit += 1
    else:  # max, min, gathers: wide values make a misplaced element visible
        limit = top
    return max(1, min(limit, 1 << 20 if redop in ("none", "max", "min") else _INT_CAP))


def make_input(n: int, dtype: torch.dtype, device: torch.device, seed: int, rank: int,
               nbytes: int, redop: str, world: int) -> torch.Tensor:
    """Non-zero random values: floats with |x| in [0.5, 1.5), ints in [1, limit], random sign
    where the dtype has one."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed_for(seed, rank, nbytes))
    signed = is_float(dtype) or torch.iinfo(dtype).min < 0
    if is_float(dtype):
        values = torch.rand(n, generator=gen, device=device, dtype=torch.float32) + 0.5
    else:
        top = int_magnitude(dtype, redop, world)
        values = torch.randint(1, top + 1, (n,), generator=gen, device=device, dtype=torch.int64)
    if signed:
        sign = torch.randint(0, 2, (n,), generator=gen, device=device, dtype=torch.int8) * 2 - 1
        values = values * sign
    return values.to(dtype)


def poison_value(dtype: torch.dtype) -> float | int:
    """A value no correct result can hold: NaN, or an integer outside the input range."""
    if is_float(dtype):
        return math.nan
    info = torch.iinfo(dtype)
    return info.min if info.min < 0 else 0  # unsigned inputs are >= 1


def poison_fill(t: torch.Tensor) -> None:
    if t.numel():
        t.fill_(poison_value(t.dtype))


def corrupt(t: torch.Tensor) -> None:
    """Test hook: turn one output element into a wrong value."""
    if t.numel():
        t.reshape(-1)[0] = poison_value(t.dtype)


@dataclass
class Expected:
    value: torch.Tensor                 # float64, this rank's whole output
    bound: torch.Tensor | float         # allowed |got - value|, per element or scalar
    int_avg: bool = False               # integer avg truncates: |got - value| < 1 is right


def concatenation(parts: Iterable[torch.Tensor]) -> Expected:
    """A gather's output: every rank's part in rank order, bit for bit."""
    return Expected(torch.cat([p.to(torch.float64) for p in parts]), 0.0)


def reduction(slices: Iterable[torch.Tensor], redop: str, dtype: torch.dtype, world: int) -> Expected:
    """The reduction of every rank's slice (rank order, each in ``dtype``), with the error a
    path that rounds in ``dtype`` may make."""
    acc = scale = None
    for s in slices:
        x = s.to(torch.float64)
        if acc is None:
            acc, scale = x.clone(), x.abs()
        elif redop in ("sum", "avg"):
            acc += x
            scale += x.abs()
        elif redop == "prod":
            acc *= x
        elif redop == "max":
            acc = torch.maximum(acc, x)
        elif redop == "min":
            acc = torch.minimum(acc, x)
        else:
            raise ValueError(f"unknown redop {redop!r}")
    if redop == "avg":
        acc /= world
        scale /= world
    if redop == "prod":
        scale = acc.abs()

    if not is_float(dtype):
        return Expected(acc, 0.0, int_avg=redop == "avg")
    if redop in ("max", "min"):
        return Expected(acc, 0.0)  # selection never rounds
    if dtype in _EPS_PER_RANK:
        rel = _EPS_PER_RANK[dtype] * world
    else:
        rel = _FLAT_TOL.get(dtype, 1e-5)
    return Expected(acc, rel * scale)


def count_wrong(out: torch.Tensor, exp: Expected) -> int:
    got = out.reshape(-1).to(torch.float64)
    diff = (got - exp.value).abs()
    ok = diff < 1.0 if exp.int_avg else diff <= exp.bound  # NaN compares false: counted wrong
    return int((~ok).sum().item())
