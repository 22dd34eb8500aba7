"""The five collectives as operations: all_reduce, all_gather, all_gatherv, reduce_scatter,
reduce_scatterv. Each builds its Call from the public method's arguments (the rules of
symcomm/validate.py), is chosen by its row of the dispatch table, and under torch.compile (or
when autograd records it) runs as a torch.library op of its own (functional: an ``out=``
receives a copy), which carries its backward: all_gather(v) and reduce_scatter(v) are each
other's, all_reduce its own.

``*_call`` builds a call from arguments; ``make_*`` builds one from tensors a composite
operation already validated (no rules run), for the collective it runs inside.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import validate
from ..base import Call
from ..errors import ArgumentError
from ..registry import lookup
from .autograd import Backward, Given, library_op, no_backward
from .base import CallContext, Operation, into

# Reductions with a gradient: the sum's is the sum of the outputs' gradients, the average's their
# average; max, min and prod have none that a collective can give (it depends on every rank's values).
DIFFERENTIABLE_REDOPS = ("sum", "avg")
_inference_mode = torch.is_inference_mode_enabled


def all_reduce_call(x: object, out: object, op: object, device: torch.device) -> Call:
    # The hottest eager path: the common case is inlined, the helpers only raise.
    x = validate.tensor("x", x, device)
    dtype = x.dtype
    if (type(op) is not str or op not in validate.REDOP_SET or dtype in validate.UNREDUCIBLE
            or (op == "avg" and not dtype.is_floating_point)):
        validate.redop(op, dtype)
    x_ptr, nbytes = x.data_ptr(), x.nbytes
    if out is None:
        out = torch.empty_like(x)
        out_ptr = out.data_ptr()
    elif out is x:
        if x.requires_grad or (not _inference_mode() and x.is_inference()):  # validate.may_refuse_write, inline
            validate.writable("out", x)
        out_ptr = x_ptr
    else:
        out = validate.tensor("out", out, device)
        if out.dtype is not dtype or out.shape != x.shape:
            validate.output("out", out, x.shape, x)
        elif out.requires_grad or (not _inference_mode() and out.is_inference()):  # the same, inline
            validate.writable("out", out)
        out_ptr = out.data_ptr()
        if out_ptr != x_ptr and out_ptr < x_ptr + nbytes and x_ptr < out_ptr + nbytes:
            validate.in_place("out", out_ptr, nbytes, "x", x_ptr, nbytes, x_ptr)  # raises: partial overlap
    return Call("all_reduce", (x,), (out,), (x_ptr,), (out_ptr,), None, op, nbytes)


def all_gather_call(x: object, out: object, rank: int, world_size: int, device: torch.device) -> Call:
    x = validate.tensor("x", x, device)
    n = validate.rows("x", x)
    out = validate.output("out", out, (world_size * n, *x.shape[1:]), x)
    x_ptr, out_ptr, nbytes = x.data_ptr(), out.data_ptr(), out.nbytes
    validate.in_place("x", x_ptr, x.nbytes, "out", out_ptr, nbytes, out_ptr + rank * x.nbytes)
    return Call("all_gather", (x,), (out,), (x_ptr,), (out_ptr,), None, None, nbytes)


def reduce_scatter_call(x: object, out: object, op: object, rank: int, world_size: int,
                   device: torch.device) -> Call:
    x = validate.tensor("x", x, device)
    op = validate.redop(op, x.dtype)
    n = validate.rows("x", x)
    if n % world_size:
        raise ArgumentError(f"x.shape[0] ({n}) must be divisible by the world size ({world_size})")
    out = validate.output("out", out, (n // world_size, *x.shape[1:]), x)
    x_ptr, out_ptr = x.data_ptr(), out.data_ptr()
    validate.in_place("out", out_ptr, out.nbytes, "x", x_ptr, x.nbytes, x_ptr + rank * out.nbytes)
    return Call("reduce_scatter", (x,), (out,), (x_ptr,), (out_ptr,), None, op, x.nbytes)


def tensor_lists(tensors: object, out: object) -> tuple[bool, list, list]:
    """(given one tensor?, the tensors, their outputs or Nones) of a call that takes a tensor or
    a list of them, and ``out`` to match."""
    single = isinstance(tensors, torch.Tensor)
    xs = [tensors] if single else list(tensors) if isinstance(tensors, (list, tuple)) else None
    if not xs:
        raise ArgumentError("tensors must be a tensor or a non-empty list of tensors")
    if out is None:
        return single, xs, [None] * len(xs)
    if single:
        return single, xs, [out]
    if isinstance(out, (list, tuple)) and len(out) == len(xs):
        return single, xs, list(out)
    raise ArgumentError(f"out must be a list of {len(xs)} tensors, matching tensors")


def all_gatherv_call(tensors: object, sizes: object, out: object, rank: int, world_size: int,
                device: torch.device) -> Call:
    single, xs, outs = tensor_lists(tensors, out)
    sizes = validate.sizes_arg(sizes, world_size)
    total, before = sum(sizes), sum(sizes[:rank])
    for i, x in enumerate(xs):
        name, out_name = ("tensors", "out") if single else (f"tensors[{i}]", f"out[{i}]")
        xs[i] = x = validate.tensor(name, x, device)
        if validate.rows(name, x) != sizes[rank]:
            raise ArgumentError(f"{name} has {x.shape[0]} rows, but sizes[{rank}] (this rank) is {sizes[rank]}")
        validate.check_extent(out_name, total, x)
        outs[i] = o = validate.output(out_name, outs[i], (total, *x.shape[1:]), x)
        row_bytes = o.nbytes // total if total else 0
        validate.in_place(name, x.data_ptr(), x.nbytes, out_name, o.data_ptr(), o.nbytes, o.data_ptr() + before * row_bytes)
    if len(xs) > 1:
        validate.apart([(f"tensors[{i}]", x) for i, x in enumerate(xs)],
                       [(f"out[{i}]", o) for i, o in enumerate(outs)], "all_gatherv", len(outs))
    in_ptrs, out_ptrs = [x.data_ptr() for x in xs], [o.data_ptr() for o in outs]
    return Call("all_gatherv", xs, outs, in_ptrs, out_ptrs, sizes, None, sum(o.nbytes for o in outs))


def reduce_scatterv_call(x: object, sizes: object, out: object, op: object, rank: int, world_size: int,
                    device: torch.device) -> Call:
    x = validate.tensor("x", x, device)
    op = validate.redop(op, x.dtype)
    sizes = validate.sizes_arg(sizes, world_size)
    total = sum(sizes)
    if validate.rows("x", x) != total:
        raise ArgumentError(f"x has {x.shape[0]} rows, but sizes add up to {total}")
    out = validate.output("out", out, (sizes[rank], *x.shape[1:]), x)
    x_ptr, out_ptr = x.data_ptr(), out.data_ptr()
    row_bytes = x.nbytes // total if total else 0
    validate.in_place("out", out_ptr, out.nbytes, "x", x_ptr, x.nbytes, x_ptr + sum(sizes[:rank]) * row_bytes)
    return Call("reduce_scatterv", (x,), (out,), (x_ptr,), (out_ptr,), sizes, op, x.nbytes)


def make_all_reduce(x: torch.Tensor, out: torch.Tensor) -> Call:
    """The sum all-reduce of ``x`` into ``out`` (already valid: same shape and dtype, contiguous,
    on the communicator's device, not partly overlapping), as a composite op runs it."""
    x_ptr, out_ptr = x.data_ptr(), out.data_ptr()
    return Call("all_reduce", (x,), (out,), (x_ptr,), (out_ptr,), None, "sum", x.nbytes)


def make_all_gather(x: torch.Tensor, out: torch.Tensor) -> Call:
    """The all_gather of ``x`` into ``out`` (already valid, not overlapping), as a composite op runs it."""
    x_ptr, out_ptr = x.data_ptr(), out.data_ptr()
    return Call("all_gather", (x,), (out,), (x_ptr,), (out_ptr,), None, None, out.nbytes)


def make_all_gatherv(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], sizes: list[int]) -> Call:
    """The all_gatherv of already-valid tensors (a composite op's own slices and outputs)."""
    return Call("all_gatherv", inputs, outputs, [t.data_ptr() for t in inputs], [t.data_ptr() for t in outputs],
                sizes, None, sum(t.nbytes for t in outputs))


class AllReduce(Operation):
    name = "all_reduce"
    bench = "symcomm.bench.collectives:ALL_REDUCE"

    def build(self, ctx: CallContext, x: Any, out: Any = None, op: Any = "sum") -> Call:
        return all_reduce_call(x, out, op, ctx.device)

    def compiled(self, comm: Any, x: torch.Tensor, out: torch.Tensor | None = None, op: str = "sum",
                 algo: str = "auto") -> torch.Tensor:
        return into(out, all_reduce_op(x, comm.key, op, algo))

    def backward(self, grad: Backward, g: torch.Tensor | None) -> dict[str, Any]:
        """out_s = sum_r x_r on every rank s, so d/dx_r = sum_s g_s: the all-reduce of the gradients
        (their average for avg)."""
        op = _differentiable_op(self.name, grad)
        g = _grad_or_zeros(g, grad.args["x"], tuple(grad.args["x"].shape))
        return {"x": grad.pooled(lambda: all_reduce_op(g.contiguous(), grad.comm_key, op, "auto"))}


class AllGather(Operation):
    name = "all_gather"
    bench = "symcomm.bench.collectives:ALL_GATHER"

    def build(self, ctx: CallContext, x: Any, out: Any = None) -> Call:
        return all_gather_call(x, out, ctx.rank, ctx.world_size, ctx.device)

    def compiled(self, comm: Any, x: torch.Tensor, out: torch.Tensor | None = None, algo: str = "auto") -> torch.Tensor:
        return into(out, all_gather_op(x, comm.key, algo))

    def backward(self, grad: Backward, g: torch.Tensor | None) -> dict[str, Any]:
        """Every rank's output holds x_r at rows r: its gradient is the sum over ranks of those
        rows of the outputs' gradients, a reduce-scatter."""
        x = grad.args["x"]
        g = _grad_or_zeros(g, x, (lookup(grad.comm_key).world_size * x.shape[0], *x.shape[1:]))
        return {"x": grad.pooled(lambda: reduce_scatter_op(g.contiguous(), grad.comm_key, "sum", "auto"))}


class AllGatherv(Operation):
    name = "all_gatherv"
    bench = "symcomm.bench.collectives:ALL_GATHERV"

    def build(self, ctx: CallContext, tensors: Any, sizes: Any, out: Any = None) -> Call:
        call = all_gatherv_call(tensors, sizes, out, ctx.rank, ctx.world_size, ctx.device)
        call.single = isinstance(tensors, torch.Tensor)
        return call

    def result(self, call: Call) -> torch.Tensor | list[torch.Tensor]:
        return call.outputs[0] if call.single else list(call.outputs)

    def compiled(self, comm: Any, tensors: Any, sizes: Sequence[int], out: Any = None, algo: str = "auto") -> Any:
        single = isinstance(tensors, torch.Tensor)
        results = all_gatherv_op([tensors] if single else list(tensors), list(sizes), comm.key, algo)
        if single:
            return into(out, results[0])
        return results if out is None else [into(o, r, f"out[{i}]") for i, (o, r) in enumerate(zip(out, results))]

    def backward(self, grad: Backward, gs: list[torch.Tensor | None]) -> dict[str, Any]:
        """A reduce-scatterv of each gathered tensor's gradient, with the forward's sizes. One
        per input that needs a gradient, whether or not its output was used here (zeros if not),
        so the ranks' backward collectives stay alike."""
        sizes = grad.args["sizes"]
        grads = [gathered_grad(grad, g, x, sizes) if x.needs_grad else None for g, x in zip(gs, grad.args["xs"])]
        return {"xs": grads}


class ReduceScatter(Operation):
    name = "reduce_scatter"
    bench = "symcomm.bench.collectives:REDUCE_SCATTER"

    def build(self, ctx: CallContext, x: Any, out: Any = None, op: Any = "sum") -> Call:
        return reduce_scatter_call(x, out, op, ctx.rank, ctx.world_size, ctx.device)

    def compiled(self, comm: Any, x: torch.Tensor, out: torch.Tensor | None = None, op: str = "sum",
                 algo: str = "auto") -> torch.Tensor:
        return into(out, reduce_scatter_op(x, comm.key, op, algo))

    def backward(self, grad: Backward, g: torch.Tensor | None) -> dict[str, Any]:
        """Rank s's output is the sum over ranks of their rows s: each x_r's gradient is every
        rank's output gradient in rank order, an all-gather (divided by the world for avg)."""
        op = _differentiable_op(self.name, grad)
        x = grad.args["x"]
        g = _grad_or_zeros(g, x, (x.shape[0] // lookup(grad.comm_key).world_size, *x.shape[1:]))
        got = grad.pooled(lambda: all_gather_op(g.contiguous(), grad.comm_key, "auto"))
        return {"x": got.div_(lookup(grad.comm_key).world_size) if op == "avg" else got}


class ReduceScatterv(Operation):
    name = "reduce_scatterv"
    bench = "symcomm.bench.collectives:REDUCE_SCATTERV"

    def build(self, ctx: CallContext, x: Any, sizes: Any, out: Any = None, op: Any = "sum") -> Call:
        return reduce_scatterv_call(x, sizes, out, op, ctx.rank, ctx.world_size, ctx.device)

    def compiled(self, comm: Any, x: torch.Tensor, sizes: Sequence[int], out: torch.Tensor | None = None,
                 op: str = "sum", algo: str = "auto") -> torch.Tensor:
        return into(out, reduce_scatterv_op(x, list(sizes), comm.key, op, algo))

    def backward(self, grad: Backward, g: torch.Tensor | None) -> dict[str, Any]:
        """As reduce_scatter's, with the forward's sizes: an all-gatherv."""
        op = _differentiable_op(self.name, grad)
        x, sizes = grad.args["x"], grad.args["sizes"]
        g = _grad_or_zeros(g, x, (sizes[lookup(grad.comm_key).rank], *x.shape[1:]))
        g = g.contiguous()  # this rank's rows: made outside the pool, whose shapes must be alike
        got = grad.pooled(lambda: all_gatherv_op([g], sizes, grad.comm_key, "auto")[0])
        return {"x": got.div_(lookup(grad.comm_key).world_size) if op == "avg" else got}


def gathered_grad(grad: Backward, g: torch.Tensor | None, x: Given, sizes: list[int]) -> torch.Tensor:
    """The gradient of an input gathered with per-rank ``sizes``: the reduce-scatterv of its
    gathered output's gradient ``g`` (zeros where this rank did not use that output, so every
    rank still runs the collective)."""
    def scatter() -> torch.Tensor:
        full = g.contiguous() if g is not None else torch.zeros((sum(sizes), *x.shape[1:]), dtype=x.dtype,
                                                                device=x.device)
        return reduce_scatterv_op(full, sizes, grad.comm_key, "sum", "auto")
    # Its output has this rank's rows: with uneven sizes, shapes that differ between ranks,
    # which the pool's equal offsets cannot take (gradient_pooled's rule). Asked only where the
    # pool is in play: under torch.compile the sizes may be symbolic, and are never hashed.
    even = grad.symmetric and all(s == sizes[0] for s in sizes)
    return grad.pooled(scatter) if even else scatter()


def _grad_or_zeros(g: torch.Tensor | None, x: Given, shape: tuple[int, ...]) -> torch.Tensor:
    """An output's gradient, or zeros of its ``shape`` where nothing downstream gave one (a
    custom Function may return None): every rank still runs the backward's collective, so a rank
    that got None stays in step with one that did not."""
    return g if g is not None else torch.zeros(shape, dtype=x.dtype, device=x.device)


def _differentiable_op(name: str, grad: Backward) -> str:
    op = grad.args["op"]
    if op not in DIFFERENTIABLE_REDOPS:
        raise no_backward(f"{name}(op={op!r})", f"only {' and '.join(DIFFERENTIABLE_REDOPS)} reductions have a "
                                               f"gradient symcomm can compute with a collective")
    return op


ALL_REDUCE, ALL_GATHER, ALL_GATHERV = AllReduce(), AllGather(), AllGatherv()
REDUCE_SCATTER, REDUCE_SCATTERV = ReduceScatter(), ReduceScatterv()
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, ALL_GATHERV, REDUCE_SCATTER, REDUCE_SCATTERV)


# ------------------------------------------------- torch.library ops: torch.compile and autograd
# Eager calls that autograd does not record never come through here (a custom op's dispatch costs
# microseconds): under compile, or when a tensor argument requires grad, the Communicator's
# methods route to these, passing the communicator by its registry key (ops take ints, not
# Python objects). Each carries its descriptor's backward (library_op).
@library_op("symcomm::all_reduce", ALL_REDUCE)
def all_reduce_op(x: torch.Tensor, comm_key: int, op: str, algo: str) -> torch.Tensor:
    return lookup(comm_key).all_reduce(x, op=op, algo=algo)


@all_reduce_op.register_fake
def _(x, comm_key, op, algo):
    return torch.empty_like(x)


@library_op("symcomm::all_gather", ALL_GATHER)
def all_gather_op(x: torch.Tensor, comm_key: int, algo: str) -> torch.Tensor:
    return lookup(comm_key).all_gather(x, algo=algo)


@all_gather_op.register_fake
def _(x, comm_key, algo):
    return x.new_empty((lookup(comm_key).world_size * validate.rows("x", x), *x.shape[1:]))


@library_op("symcomm::all_gatherv", ALL_GATHERV)
def all_gatherv_op(xs: list[torch.Tensor], sizes: list[int], comm_key: int, algo: str) -> list[torch.Tensor]:
    return list(lookup(comm_key).all_gatherv(list(xs), sizes, algo=algo))


@all_gatherv_op.register_fake
def _(xs, sizes, comm_key, algo):
    return [x.new_empty((sum(sizes), *x.shape[1:])) for x in xs]


@library_op("symcomm::reduce_scatter", REDUCE_SCATTER)
def reduce_scatter_op(x: torch.Tensor, comm_key: int, op: str, algo: str) -> torch.Tensor:
    return lookup(comm_key).reduce_scatter(x, op=op, algo=algo)


@reduce_scatter_op.register_fake
def _(x, comm_key, op, algo):
    return x.new_empty((validate.rows("x", x) // lookup(comm_key).world_size, *x.shape[1:]))


@library_op("symcomm::reduce_scatterv", REDUCE_SCATTERV)
def reduce_scatterv_op(x: torch.Tensor, sizes: list[int], comm_key: int, op: str, algo: str) -> torch.Tensor:
    return lookup(comm_key).reduce_scatterv(x, sizes, op=op, algo=algo)


@reduce_scatterv_op.register_fake
def _(x, sizes, comm_key, op, algo):
    comm = lookup(comm_key)
    validate.entry_count("sizes", sizes, comm.world_size)  # the eager rule, before indexing by rank
    return x.new_empty((sizes[comm.rank], *x.shape[1:]))
