"""all_gatherv of NVFP4-quantized rows as an operation: each rank quantizes its rows ``x``
[sizes[rank], H] with the shared global scale and every rank receives every rank's payload,
block scales and ``extra`` tensors (top-k ids, weights...), in rank order.

Its paths: ``fused-flagfree`` (symcomm/backends/fp4_flagfree.py: one launch quantizes and pushes
into the peers' flag-free receive buffers, whence each copies into its own outputs, which may sit
anywhere; no extras, world 2), ``fused-push`` (symcomm/backends/fp4_push.py: one launch quantizes
and writes into every peer's gathered outputs, which must sit in the symmetric pool at equal
offsets) and ``unfused`` (symcomm/backends/composite.py: quantize into this rank's slice of the
outputs, then one in-place all_gatherv on whatever path that op's dispatch picks). All three
write the same bytes; auto takes the first that can serve the call in the order below. ``algo=``
names any of them, or an all_gatherv path, which forces the unfused path with that gather.
``swizzle=True`` swizzles the gathered linear scales after, on every path; ``dequantize=True``
adds the decoded rows.

Offsets stay symmetric: the gathered outputs have equal shapes on every rank, but equal pool
offsets only if every earlier pool allocation was equal too; tensors sized by this rank's rows
(x, extra) belong outside use_symmetric_memory (the kernel reads them locally). Check mode
compares the outputs' offsets and the global scale, and names what differs.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .. import check_mode, fp4, validate
from ..base import Call
from ..dispatch import Choice
from ..errors import ArgumentError
from ..registry import lookup
from .autograd import Backward, library_op, no_backward
from .base import CallContext, Dispatcher, Operation, into, scale_args
from .collectives import gathered_grad, make_all_gatherv

if TYPE_CHECKING:
    from ..base import Path
    from ..dispatch import DispatchTable

OP = "all_gatherv_fp4"
FLAGFREE_FP4, FUSED, UNFUSED = "fused-flagfree", "fused-push", "unfused"
# Flag-free first wherever it serves (world 2, no extras, each rank's wire chunk within its
# receive slot): it has no barrier, where fused-push meets the peers twice. Until the flag-free
# kernel had its wider grids, fused-push led from about 400 KiB of quantized bytes a rank; on
# 2x H200 with them, equal split of hidden-7168 rows, outputs in the pool, flag-free led at every
# size it served (bench/NOTES.md, nineteenth session).
ORDER = (FLAGFREE_FP4, FUSED, UNFUSED)

OFFSETS_RULE = ("The fused path writes every peer's gathered outputs at this rank's offsets, so they must sit at "
                "equal pool offsets: allocate them (equal shapes everywhere) inside use_symmetric_memory in the "
                "same order on every rank, and tensors sized by this rank's rows (x, extra) outside it "
                "(README, 'Offsets stay symmetric')")


class Fp4Gathered(NamedTuple):
    """Every rank's rows, in rank order (``sum(sizes)`` rows)."""

    packed: torch.Tensor  # uint8 [rows, H/2]
    scales: torch.Tensor  # float8_e4m3fn [rows, H/16]; with swizzle, fp4.swizzled_shape(rows, H/16)
    extra: tuple[torch.Tensor, ...]  # each extra tensor gathered along dim 0
    values: torch.Tensor | None  # dequantized [rows, H] in x's dtype, when asked for
    global_scale: fp4.GlobalScale  # as validated: a float (fp32-rounded) or the caller's tensor


@dataclass(frozen=True)
class Fp4Choice(Choice):
    """select()'s answer for all_gatherv_fp4: the FP4 path, why the others were passed over, and
    for the unfused path the inner all_gatherv's own Choice (None for the fused one)."""

    gather: Choice | None = None


class Fp4Call(Call):
    """A validated all_gatherv_fp4 call. ``packed``, ``scales`` and ``gathered_extra`` are the
    gathered outputs it writes: the caller's ``out``, or new ones."""

    __slots__ = ("x", "gs", "extra", "packed", "scales", "gathered_extra", "dequantize", "swizzle", "values_out",
                 "inner_algo")

    def __init__(self, x: torch.Tensor, sizes: list[int], gs: fp4.GlobalScale, extra: list[torch.Tensor],
                 packed: torch.Tensor, scales: torch.Tensor, gathered_extra: list[torch.Tensor], dequantize: bool,
                 swizzle: bool, values_out: torch.Tensor | None) -> None:
        inputs, outputs = (x, x, *extra), (packed, scales, *gathered_extra)  # payload and scales both come from x
        super().__init__(OP, inputs, outputs, [t.data_ptr() for t in inputs], [t.data_ptr() for t in outputs],
                         sizes, None, sum(t.nbytes for t in outputs))
        self.x, self.gs, self.extra = x, gs, extra
        self.packed, self.scales, self.gathered_extra = packed, scales, gathered_extra
        self.dequantize, self.swizzle, self.values_out = dequantize, swizzle, values_out
        self.inner_algo = "auto"  # the all_gatherv path algo= forced, for the unfused path

    def named_outputs(self) -> list[tuple[str, torch.Tensor]]:
        return [("out.packed", self.packed), ("out.scales", self.scales),
                *((f"out.extra[{i}]", t) for i, t in enumerate(self.gathered_extra))]

    def gather_call(self, rank: int) -> Call:
        """The in-place all_gatherv the unfused path runs: this rank's slices of the outputs
        (payload and scales, quantized there first) and its extras, into the outputs."""
        first = sum(self.sizes[:rank])
        mine = slice(first, first + self.x.shape[0])
        return make_all_gatherv([self.packed[mine], self.scales[mine], *self.extra],
                                [self.packed, self.scales, *self.gathered_extra], self.sizes)


def _check_out(out: object, total: int, h: int, dtype: torch.dtype, extra: list[torch.Tensor],
               device: torch.device, dequantize: bool) -> Fp4Gathered:
    if not isinstance(out, Fp4Gathered):
        raise ArgumentError(f"out must be an Fp4Gathered, got {type(out).__name__}")
    validate.destination("out.packed", out.packed, (total, h // 2), torch.uint8, device)
    validate.destination("out.scales", out.scales, (total, h // fp4.BLOCK), torch.float8_e4m3fn, device)
    if len(out.extra) != len(extra):
        raise ArgumentError(f"out.extra has {len(out.extra)} tensors, but extra has {len(extra)}")
    for i, (o, t) in enumerate(zip(out.extra, extra)):
        validate.destination(f"out.extra[{i}]", o, (total, *t.shape[1:]), t.dtype, device)
    if dequantize and out.values is not None:
        validate.destination("out.values", out.values, (total, h), dtype, device)
    return out


def _check_apart(x: torch.Tensor, extra: list[torch.Tensor], out: Fp4Gathered, dequantize: bool, first: int) -> None:
    """The outputs given apart from each other and from the inputs: the call quantizes x while it
    writes the payload and dequantizes the payload into out.values. extra[i] may be this rank's
    slice of out.extra[i] (gathered in place), nothing else may share memory."""
    for i, (t, o) in enumerate(zip(extra, out.extra)):
        row_bytes = o.nbytes // o.shape[0] if o.shape[0] else 0
        validate.in_place(f"extra[{i}]", t.data_ptr(), t.nbytes, f"out.extra[{i}]", o.data_ptr(), o.nbytes,
                          o.data_ptr() + first * row_bytes)
    outs = [*((f"out.extra[{i}]", o) for i, o in enumerate(out.extra)), ("out.packed", out.packed),
            ("out.scales", out.scales), *((("out.values", out.values),) if dequantize and out.values is not None else ())]
    validate.apart([*((f"extra[{i}]", t) for i, t in enumerate(extra)), ("x", x)], outs, OP, len(extra))


class AllGathervFp4(Operation):
    name = OP
    skips_empty = False
    bench = "symcomm.bench.fp4_spec:ALL_GATHERV_FP4"
    check_decode: dict[str, Callable[[int], object]] = {"global_scale": check_mode.bits_float}
    window_rule = OFFSETS_RULE

    def build(self, ctx: CallContext, x: Any, sizes: Any, global_scale: Any, extra: Any = (),
              dequantize: Any = False, swizzle: Any = False, out: Any = None) -> Fp4Call:
        device = ctx.device
        n, h = fp4.check_rows(x)
        validate.tensor("x", x, device)
        sizes = validate.sizes_arg(sizes, ctx.world_size)
        if n != sizes[ctx.rank]:
            raise ArgumentError(f"x has {n} rows, but sizes[{ctx.rank}] (this rank) is {sizes[ctx.rank]}")
        total = sum(sizes)
        validate.check_extent("the gathered outputs", total, x)
        gs = fp4.check_global_scale(global_scale, device)
        if isinstance(extra, torch.Tensor) or not isinstance(extra, (list, tuple)):
            raise ArgumentError("extra must be a list or tuple of tensors (each with this rank's rows in dim 0)")
        extra = list(extra)
        for i, t in enumerate(extra):
            extra[i] = t = validate.tensor(f"extra[{i}]", t, device)
            if validate.rows(f"extra[{i}]", t) != n:
                raise ArgumentError(f"extra[{i}] has {t.shape[0]} rows, but x has {n}")
        for name, flag in (("dequantize", dequantize), ("swizzle", swizzle)):
            if not isinstance(flag, bool):
                raise ArgumentError(f"{name} must be a bool, got {type(flag).__name__}")
        if out is not None:
            out = _check_out(out, total, h, x.dtype, extra, device, dequantize)
            _check_apart(x, extra, out, dequantize, sum(sizes[:ctx.rank]))
            return Fp4Call(x, sizes, gs, extra, out.packed, out.scales, list(out.extra), dequantize, swizzle,
                           out.values)
        # Payload, scales, then the extras: the same shapes in the same order on every rank, so
        # inside use_symmetric_memory they take equal pool offsets wherever earlier ones did.
        return Fp4Call(x, sizes, gs, extra, torch.empty((total, h // 2), dtype=torch.uint8, device=device),
                       torch.empty((total, h // fp4.BLOCK), dtype=torch.float8_e4m3fn, device=device),
                       [torch.empty((total, *t.shape[1:]), dtype=t.dtype, device=device) for t in extra],
                       dequantize, swizzle, None)

    def result(self, call: Fp4Call) -> Fp4Gathered:
        values = None
        if call.dequantize:
            values = fp4.dequantize(call.packed, call.scales, call.gs, call.x.dtype, out=call.values_out)
        scales = fp4.swizzle_scales(call.scales) if call.swizzle else call.scales
        return Fp4Gathered(call.packed, scales, tuple(call.gathered_extra), values, call.gs)

    def order(self, table: DispatchTable, call: Fp4Call) -> tuple[str, ...]:
        return ORDER

    def ranking(self, table: DispatchTable, call: Fp4Call) -> str:
        return f"in all_gatherv_fp4's order ({', '.join(ORDER)})"

    def resolve(self, call: Fp4Call, algo: object, dispatcher: Dispatcher) -> str:
        algo = super().resolve(call, algo, dispatcher)
        if algo == "auto" or algo in ORDER:
            return algo
        return self.resolve_inner(call, algo, dispatcher, "all_gatherv", UNFUSED, ORDER, "an FP4 path")

    def inner_choice(self, call: Fp4Call, path: Path, dispatcher: Dispatcher) -> Choice | None:
        if path.name != UNFUSED:
            return None
        if call.inner_algo != "auto":
            return Choice(call.inner_algo, {})
        return dispatcher.explain_inner(call.gather_call(dispatcher.rank), "auto")

    def explain(self, choice: Choice, inner: Choice | None) -> Fp4Choice:
        return Fp4Choice(choice.algo, choice.rejected, inner)

    def check_scalars(self, call: Fp4Call) -> Sequence[tuple[str, int]]:
        return [("global_scale", check_mode.scale_bits(call.gs))]

    def check_signature(self, call: Fp4Call, path_index: int, world: int,
                        locate: Callable[[int], tuple[int, int]] | None,
                        compared: Sequence[str]) -> tuple[list[int], list[str]]:
        """The gather the paths make, under this op's name, with the global scale (every rank must
        quantize with the same one) and the outputs named as the caller knows them. The inputs are
        read locally and may sit anywhere; ``dequantize`` and ``swizzle`` act on this rank's copy
        only, so they may differ by rank."""
        view = Call("all_gatherv", call.inputs, call.outputs, call.in_ptrs, call.out_ptrs, call.sizes, None,
                    call.nbytes)
        values, names = check_mode.signature(view, path_index, world, locate, compared, OP, self.check_scalars(call))
        for i, (name, _) in enumerate(call.named_outputs()):
            names = [n.replace(f"'out[{i}]'", f"'{name}'") for n in names]
        return values, names

    def compiled(self, comm: Any, x: torch.Tensor, sizes: Sequence[int], global_scale: Any,
                 extra: Sequence[torch.Tensor] = (), dequantize: bool = False, swizzle: bool = False,
                 out: Fp4Gathered | None = None, algo: str = "auto") -> Fp4Gathered:
        # With out=, eager gathers the plain scales into out.scales and returns a swizzled copy:
        # the op then gathers them plain, and the copy is made here.
        got = _all_gatherv_fp4(x, list(sizes), *scale_args(global_scale), list(extra), dequantize,
                               swizzle and out is None, comm.key, algo)
        n = len(extra)
        values = got[2 + n] if dequantize else None
        if out is None:
            return Fp4Gathered(got[0], got[1], tuple(got[2:2 + n]), values, global_scale)
        into(out.packed, got[0], "out.packed")
        into(out.scales, got[1], "out.scales")
        for i, (o, r) in enumerate(zip(out.extra, got[2:2 + n])):
            into(o, r, f"out.extra[{i}]")
        if values is not None and out.values is not None:
            values = into(out.values, values, "out.values")
        return out._replace(scales=fp4.swizzle_scales(out.scales) if swizzle else out.scales, values=values,
                            global_scale=global_scale)

    def backward(self, grad: Backward, got: list[torch.Tensor | None]) -> dict[str, Any]:
        """Straight through: the dequantized rows stand for x itself, so x's gradient is the
        reduce-scatterv of ``values``' gradient (in x's dtype), as for an all_gatherv of x in bf16;
        each floating ``extra`` tensor gets the reduce-scatterv of its gathered gradient. Without
        ``dequantize`` nothing differentiable reaches x (the codes are integers). The payload and
        block scales carry no gradient: one arriving there raises."""
        args, sizes = grad.args, grad.args["sizes"]
        n = len(args["extra"] or ())
        if got[0] is not None or got[1] is not None:
            raise no_backward(f"{OP}'s packed payload and block scales", "quantization has no gradient; take "
                              "dequantize=True and differentiate through the values (straight through)")
        out: dict[str, Any] = {}
        if grad.needs("x") and args["dequantize"]:
            out["x"] = gathered_grad(grad, got[2 + n], args["x"], sizes)
        if n and any(e.needs_grad for e in args["extra"]):
            out["extra"] = [gathered_grad(grad, g, e, sizes) if e.needs_grad else None
                            for e, g in zip(args["extra"], got[2:2 + n])]
        return out


ALL_GATHERV_FP4 = AllGathervFp4()


@library_op(f"symcomm::{OP}", ALL_GATHERV_FP4)
def _all_gatherv_fp4(x: torch.Tensor, sizes: list[int], scale_value: float | None, scale: torch.Tensor | None,
                     extra: list[torch.Tensor], dequantize: bool, swizzle: bool, comm_key: int,
                     algo: str) -> list[torch.Tensor]:
    got = lookup(comm_key).all_gatherv_fp4(x, sizes, scale if scale is not None else scale_value, extra,
                                           dequantize, algo, swizzle=swizzle)
    return [got.packed, got.scales, *got.extra, *([] if got.values is None else [got.values])]


@_all_gatherv_fp4.register_fake
def _(x, sizes, scale_value, scale, extra, dequantize, swizzle, comm_key, algo):
    fp4.check_rows(x)  # eager's rule, not an IndexError
    rows, hidden = sum(sizes), x.shape[1]
    got = [x.new_empty((rows, hidden // 2), dtype=torch.uint8),
           x.new_empty(fp4.scales_shape(rows, hidden, swizzle), dtype=torch.float8_e4m3fn),
           *(e.new_empty((rows, *e.shape[1:])) for e in extra)]
    return got + ([x.new_empty((rows, hidden))] if dequantize else [])
