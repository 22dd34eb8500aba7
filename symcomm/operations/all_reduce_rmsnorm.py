"""all_reduce_rmsnorm as an operation: h = all_reduce(x) + residual, y = rmsnorm(h) * weight
(+ FP8 / NVFP4), with symcomm/rmsnorm.py's arguments, rounding contract and local kernel.

It runs the all-reduce of x on whatever path that op's dispatch picks (or the all-reduce path
``algo=`` names), then the residual add and RMSNorm on this rank (symcomm/backends/composite.py):
by csrc/rmsnorm.cu's kernel (``unfused``) where it can run, else by the torch reference
(``reference``). ``algo=`` takes either of those names or an all-reduce path of the
communicator.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .. import check_mode, fp4
from ..base import Call
from ..dispatch import Choice
from ..registry import lookup
from ..rmsnorm import OP, QUANTS, NormCall, NormedResult, allocate, check_args, two_d
from .autograd import Backward, library_op, no_backward
from .base import CallContext, Dispatcher, Operation, into, scale_args
from .collectives import all_reduce_op, make_all_reduce

if TYPE_CHECKING:
    from ..base import Path
    from ..dispatch import DispatchTable

UNFUSED, REFERENCE = "unfused", "reference"
# The kernel wherever it can run, the torch reference elsewhere: a table does not rank them.
ORDER = (UNFUSED, REFERENCE)


@dataclass(frozen=True)
class NormChoice(Choice):
    """select()'s answer for all_reduce_rmsnorm: the norm path, why the other was passed over,
    and the inner all-reduce's own Choice."""

    all_reduce: Choice | None = None


def all_reduce_view(x: torch.Tensor) -> Call:
    """The all-reduce of x as the op makes it (out of place), without allocating an output: what
    check mode compares."""
    ptr = x.data_ptr()
    return Call("all_reduce", (x,), (x,), (ptr,), (ptr,), None, "sum", x.nbytes)


def _decode_quant(v: int) -> str | None:
    return (None, *QUANTS)[v]


class AllReduceRmsnorm(Operation):
    name = OP
    skips_empty = False
    bench = "symcomm.bench.norm_spec:ALL_REDUCE_RMSNORM"
    check_decode: dict[str, Callable[[int], object]] = {
        "eps": check_mode.bits_float, "scale": check_mode.bits_float, "quant": _decode_quant, "swizzle": bool,
        "residual": lambda v: "given" if v else "none"}

    def build(self, ctx: CallContext, x: Any, weight: Any, residual: Any = None, eps: Any = 1e-6, out: Any = None,
              residual_out: Any = None, quant: Any = None, scale: Any = None, swizzle: Any = False) -> NormCall:
        call = check_args(ctx.device, x, weight, residual, eps, out, residual_out, quant, scale, swizzle)
        call.y, call.y_scales = allocate(call)
        if call.residual_out is not None:
            call.h = call.residual_out
        elif call.residual is not None:
            call.h = torch.empty_like(call.x)  # else h is the all-reduce's own buffer (all_reduce_out)
        return call

    def result(self, call: NormCall) -> NormedResult:
        return NormedResult(call.y, call.h, call.y_scales)

    def order(self, table: DispatchTable, call: NormCall) -> tuple[str, ...]:
        return ORDER

    def ranking(self, table: DispatchTable, call: NormCall) -> str:
        return "in all_reduce_rmsnorm's order"

    def resolve(self, call: NormCall, algo: object, dispatcher: Dispatcher) -> str:
        algo = super().resolve(call, algo, dispatcher)
        if algo == "auto" or algo in ORDER:
            return algo
        return self.resolve_inner(call, algo, dispatcher, "all_reduce", "auto", ORDER, "a norm path")

    def inner_choice(self, call: NormCall, path: Path, dispatcher: Dispatcher) -> Choice | None:
        if call.inner_algo != "auto":
            return Choice(call.inner_algo, {})
        return dispatcher.explain_inner(make_all_reduce(call.x, call.all_reduce_out()), "auto")

    def explain(self, choice: Choice, inner: Choice | None) -> NormChoice:
        return NormChoice(choice.algo, choice.rejected, inner)

    def check_scalars(self, call: NormCall) -> Sequence[tuple[str, int]]:
        return [("eps", check_mode.float_bits(call.eps)), ("quant", (None, *QUANTS).index(call.quant)),
                ("scale", check_mode.scale_bits(call.scale)), ("swizzle", int(call.swizzle)),
                ("residual", int(call.residual is not None))]

    def check_signature(self, call: NormCall, path_index: int, world: int,
                        locate: Callable[[int], tuple[int, int]] | None,
                        compared: Sequence[str]) -> tuple[list[int], list[str]]:
        """The all-reduce of x under this op's name, with the norm path and every scalar that
        changes a result compared. Free per rank, and not compared: ``weight`` and the
        ``residual`` values (this rank normalises its own rows with them) and where the outputs
        sit (written locally)."""
        return check_mode.signature(all_reduce_view(call.x), path_index, world, locate, compared, OP,
                                    self.check_scalars(call))

    def compiled(self, comm: Any, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
                 eps: float = 1e-6, out: Any = None, residual_out: torch.Tensor | None = None,
                 quant: str | None = None, scale: Any = None, swizzle: bool = False,
                 algo: str = "auto") -> NormedResult:
        got = _all_reduce_rmsnorm(x, weight, residual, float(eps), quant, *scale_args(scale), swizzle, comm.key, algo)
        y, scales = got[0], got[2] if quant == "nvfp4" else None
        if out is not None:
            y_out, scales_out = out if quant == "nvfp4" else (out, None)
            y, scales = into(y_out, y, "out[0]" if quant == "nvfp4" else "out"), into(scales_out, scales, "out[1]")
        return NormedResult(y, into(residual_out, got[1], "residual_out"), scales)

    def saved_for_backward(self, args: dict[str, Any], output: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return output[1], args["weight"]  # h and the weight: y's gradient is recomputed from them

    def backward(self, grad: Backward, got: list[torch.Tensor | None]) -> dict[str, Any]:
        """h_s = sum_r x_r + residual_s and y_s = rmsnorm(h_s) * weight_s on every rank s, so, as for
        all_reduce (sum): h's whole gradient (its own plus y's through the norm, computed in fp32
        from the saved h, rounded once to the dtype) is the residual's, and its all-reduce is x's;
        the weight's is local. A quantized y (and its scales) carries no gradient."""
        g_y, g_h = got[0], got[1]
        args = grad.args
        if args["quant"] is not None and (g_y is not None or (len(got) > 2 and got[2] is not None)):
            raise no_backward(f"{OP}(quant={args['quant']!r})", "a quantized output has no gradient; differentiate "
                              "through the residual output, or run the norm unquantized")
        h, weight = grad.saved
        out: dict[str, Any] = {}
        if g_y is not None:
            d_h, d_weight = rmsnorm_backward(h, weight, args["eps"], g_y)
            if grad.needs("weight"):
                out["weight"] = d_weight
            g_h = (d_h if g_h is None else d_h + g_h.float()).to(h.dtype)
        if g_h is None:  # neither output got one: zeros, so every rank still runs the all-reduce
            g_h = torch.zeros_like(h)
        if grad.needs("residual"):
            out["residual"] = g_h
        if grad.needs("x"):
            out["x"] = grad.pooled(lambda: all_reduce_op(g_h.contiguous(), grad.comm_key, "sum", "auto"))
        return out


def rmsnorm_backward(h: torch.Tensor, weight: torch.Tensor, eps: float,
                     g_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y = h * rsqrt(mean(h^2) + eps) * weight over the last dim: (dL/dh in fp32, dL/dweight in
    weight's dtype) for y's gradient ``g_y``, in fp32 as the forward normalises."""
    hf, gf, wf = h.float(), g_y.float(), weight.float()
    inv = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    normed = hf * inv
    d_weight = (gf * normed).reshape(-1, h.shape[-1]).sum(0).to(weight.dtype)
    d_normed = gf * wf
    d_h = inv * (d_normed - normed * (d_normed * normed).mean(-1, keepdim=True))
    return d_h, d_weight


ALL_REDUCE_RMSNORM = AllReduceRmsnorm()


# The op returns its tensors as a list (a custom op cannot return a NamedTuple or an optional);
# compiled() rebuilds what the eager method returns. A scale arrives as a float or a tensor, so
# both are parameters and one of them is None.
@library_op(f"symcomm::{OP}", ALL_REDUCE_RMSNORM)
def _all_reduce_rmsnorm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float,
                        quant: str | None, scale_value: float | None, scale: torch.Tensor | None, swizzle: bool,
                        comm_key: int, algo: str) -> list[torch.Tensor]:
    got = lookup(comm_key).all_reduce_rmsnorm(x, weight, residual=residual, eps=eps, quant=quant, swizzle=swizzle,
                                              scale=scale if scale is not None else scale_value, algo=algo)
    return [got.out, got.residual, *([] if got.scales is None else [got.scales])]


@_all_reduce_rmsnorm.register_fake
def _(x, weight, residual, eps, quant, scale_value, scale, swizzle, comm_key, algo):
    tokens, hidden = two_d(x)
    if quant == "nvfp4":
        out = [x.new_empty((tokens, hidden // 2), dtype=torch.uint8),
               x.new_empty(fp4.scales_shape(tokens, hidden, swizzle), dtype=torch.float8_e4m3fn)]
    else:
        out = [x.new_empty(x.shape, dtype=torch.float8_e4m3fn if quant == "fp8" else x.dtype)]
    return [out[0], torch.empty_like(x), *out[1:]]
