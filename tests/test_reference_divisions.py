"""The plain-torch references (the norm, FP4, the MoE FP8 blocks and the combine's sum) promise
the kernels' bits on any device. On CUDA, torch divides a tensor by a Python number as a
multiply by the number's reciprocal, which is not the correctly rounded division the kernels do
unless the number is a power of two (its reciprocal is then exact). The CPU divides correctly
either way, so CPU CI cannot see the difference in the results: this test watches how the
references divide instead, and refuses a Python-number divisor that is not a power of two.
(The norm's reference once divided by ``hidden`` this way: one element of 64 x 7168 was an ulp
off the kernel on two H200s.)
"""
from __future__ import annotations

import math
import numbers

import pytest
import torch
from torch.overrides import TorchFunctionMode

from symcomm import fp4
from symcomm import rmsnorm as fn
from symcomm.ep import fp8, layout

# Every spelling of a true division: a / b, a /= b, torch.div(a, b), a.div(b), torch.true_divide.
DIVIDES = {torch.Tensor.__truediv__, torch.Tensor.__itruediv__, torch.Tensor.div, torch.Tensor.div_,
           torch.div, torch.true_divide, torch.Tensor.true_divide}


def _exact_reciprocal(value: numbers.Real) -> bool:
    mantissa, _ = math.frexp(float(value))
    return abs(mantissa) == 0.5  # a power of two (frexp's mantissa is in [0.5, 1))


class _DivisionWatch(TorchFunctionMode):
    """Records every tensor division by a Python number whose reciprocal is not exact, and
    every Python number divided by a tensor (torch's reciprocal-then-multiply) other than 1."""

    def __init__(self) -> None:
        super().__init__()
        self.inexact: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in DIVIDES and len(args) >= 2 and isinstance(args[1], numbers.Real) \
                and not isinstance(args[1], bool) and not _exact_reciprocal(args[1]):
            self.inexact.append(f"tensor / {args[1]!r}")
        if func is torch.Tensor.__rtruediv__ and isinstance(args[1], numbers.Real) and float(args[1]) != 1.0:
            self.inexact.append(f"{args[1]!r} / tensor")
        return func(*args, **kwargs)


def _rows(n: int, h: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return ((torch.rand(n, h, generator=g) + 0.25) * (torch.randint(0, 2, (n, h), generator=g) * 2 - 1)).to(dtype)


def _norm(quant: str | None) -> None:
    a, r, w = _rows(4, 7168, 1), _rows(4, 7168, 2), _rows(1, 7168, 3)[0]
    scale = {None: None, "fp8": 0.37, "nvfp4": 448 * 6 / 9.0}[quant]
    fn.reference_add_rmsnorm(a, w, r, 1e-6, quant=quant, scale=scale)


def _fp4() -> None:
    x = _rows(3, 7168, 4)
    packed, scales = fp4.quantize_reference(x, 300.0)
    fp4.dequantize_reference(packed, scales, 300.0)


def _fp8() -> None:
    codes, scales = fp8.quantize(_rows(3, 7168, 5))
    fp8.dequantize(codes, scales)


def _combine() -> None:
    values = _rows(6, 3 * 7168, 6, torch.float32).view(6, 3, 7168)
    weights = torch.rand(6, 3, generator=torch.Generator().manual_seed(7))
    ranks = torch.tensor([[0, 1, 0]] * 6)
    for quant in (None, "fp8"):
        layout.combine_by_rank(values, weights, torch.ones(6, 3, dtype=torch.bool), ranks, 2, torch.bfloat16, quant)


REFERENCES = {"norm": lambda: _norm(None), "norm fp8": lambda: _norm("fp8"), "norm nvfp4": lambda: _norm("nvfp4"),
              "fp4": _fp4, "moe fp8": _fp8, "combine": _combine}


@pytest.mark.parametrize("name", REFERENCES)
def test_references_divide_as_the_kernels_do_on_any_device(name):
    with _DivisionWatch() as watch:
        REFERENCES[name]()
    assert not watch.inexact, f"{name}: divides by a Python number through a reciprocal on CUDA: {watch.inexact}"


def test_the_watch_sees_the_division_it_guards_against():
    """The control: the norm's reference as it was (a division by hidden) is caught, and an exact
    one (by two) is not."""
    with _DivisionWatch() as watch:
        t = torch.ones(3)
        _ = t / 7168
        _ = t / 2
        _ = 1.0 / t
    assert watch.inexact == ["tensor / 7168"], watch.inexact
