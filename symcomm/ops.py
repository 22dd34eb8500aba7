"""torch.library custom ops, so torch.compile(fullgraph=True) can trace the collectives.

Eager calls never come through here: a custom op's dispatch costs microseconds that eager
collectives cannot spare. Under compile, Communicator methods route here, passing the
communicator by its registry key (ops take ints, not Python objects). The ops are functional;
an ``out=`` argument is honoured by copying the result into it.
"""
from __future__ import annotations

import torch

from . import fp4
from .fp4_gather import Fp4Gathered
from .fused_norm import NormedResult
from .registry import lookup

_LIB = "symcomm"


@torch.library.custom_op(f"{_LIB}::all_reduce", mutates_args=())
def _all_reduce(x: torch.Tensor, comm_key: int, op: str, algo: str) -> torch.Tensor:
    return lookup(comm_key).all_reduce(x, op=op, algo=algo)


@_all_reduce.register_fake
def _(x, comm_key, op, algo):
    return torch.empty_like(x)


@torch.library.custom_op(f"{_LIB}::all_gather", mutates_args=())
def _all_gather(x: torch.Tensor, comm_key: int, algo: str) -> torch.Tensor:
    return lookup(comm_key).all_gather(x, algo=algo)


@_all_gather.register_fake
def _(x, comm_key, algo):
    return x.new_empty((lookup(comm_key).world_size * x.shape[0], *x.shape[1:]))


@torch.library.custom_op(f"{_LIB}::all_gatherv", mutates_args=())
def _all_gatherv(xs: list[torch.Tensor], sizes: list[int], comm_key: int, algo: str) -> list[torch.Tensor]:
    return list(lookup(comm_key).all_gatherv(list(xs), sizes, algo=algo))


@_all_gatherv.register_fake
def _(xs, sizes, comm_key, algo):
    return [x.new_empty((sum(sizes), *x.shape[1:])) for x in xs]


@torch.library.custom_op(f"{_LIB}::reduce_scatter", mutates_args=())
def _reduce_scatter(x: torch.Tensor, comm_key: int, op: str, algo: str) -> torch.Tensor:
    return lookup(comm_key).reduce_scatter(x, op=op, algo=algo)


@_reduce_scatter.register_fake
def _(x, comm_key, op, algo):
    return x.new_empty((x.shape[0] // lookup(comm_key).world_size, *x.shape[1:]))


@torch.library.custom_op(f"{_LIB}::reduce_scatterv", mutates_args=())
def _reduce_scatterv(x: torch.Tensor, sizes: list[int], comm_key: int, op: str, algo: str) -> torch.Tensor:
    return lookup(comm_key).reduce_scatterv(x, sizes, op=op, algo=algo)


@_reduce_scatterv.register_fake
def _(x, sizes, comm_key, op, algo):
    return x.new_empty((sizes[lookup(comm_key).rank], *x.shape[1:]))


# The two composite ops return their tensors as a list (a custom op cannot return a NamedTuple
# or an optional); the compiled_* wrappers below rebuild what the eager method returns. A global
# scale arrives as a float or a tensor, so both are parameters and one of them is None.
@torch.library.custom_op(f"{_LIB}::all_reduce_rmsnorm", mutates_args=())
def _all_reduce_rmsnorm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float,
                        quant: str | None, scale_value: float | None, scale: torch.Tensor | None, swizzle: bool,
                        comm_key: int, algo: str) -> list[torch.Tensor]:
    got = lookup(comm_key).all_reduce_rmsnorm(x, weight, residual=residual, eps=eps, quant=quant, swizzle=swizzle,
                                              scale=scale if scale is not None else scale_value, algo=algo)
    return [got.out, got.residual, *([] if got.scales is None else [got.scales])]


@_all_reduce_rmsnorm.register_fake
def _(x, weight, residual, eps, quant, scale_value, scale, swizzle, comm_key, algo):
    tokens, hidden = x.shape
    if quant == "nvfp4":
        out = [x.new_empty((tokens, hidden // 2), dtype=torch.uint8),
               x.new_empty(fp4._scales_shape(tokens, hidden, swizzle), dtype=torch.float8_e4m3fn)]
    else:
        out = [x.new_empty(x.shape, dtype=torch.float8_e4m3fn if quant == "fp8" else x.dtype)]
    return [out[0], torch.empty_like(x), *out[1:]]


@torch.library.custom_op(f"{_LIB}::all_gatherv_fp4", mutates_args=())
def _all_gatherv_fp4(x: torch.Tensor, sizes: list[int], scale_value: float | None, scale: torch.Tensor | None,
                     extra: list[torch.Tensor], dequantize: bool, swizzle: bool, comm_key: int,
                     algo: str) -> list[torch.Tensor]:
    got = lookup(comm_key).all_gatherv_fp4(x, sizes, scale if scale is not None else scale_value, extra,
                                           dequantize, algo, swizzle=swizzle)
    return [got.packed, got.scales, *got.extra, *([] if got.values is None else [got.values])]


@_all_gatherv_fp4.register_fake
def _(x, sizes, scale_value, scale, extra, dequantize, swizzle, comm_key, algo):
    rows, hidden = sum(sizes), x.shape[1]
    got = [x.new_empty((rows, hidden // 2), dtype=torch.uint8),
           x.new_empty(fp4._scales_shape(rows, hidden, swizzle), dtype=torch.float8_e4m3fn),
           *(e.new_empty((rows, *e.shape[1:])) for e in extra)]
    return got + ([x.new_empty((rows, hidden))] if dequantize else [])


def _into(out, result):
    if out is None:
        return result
    out.copy_(result)
    return out


def compiled_all_reduce(comm, x, out, op, algo):
    return _into(out, _all_reduce(x, comm.key, op, algo))


def compiled_all_gather(comm, x, out, algo):
    return _into(out, _all_gather(x, comm.key, algo))


def compiled_all_gatherv(comm, tensors, sizes, out, algo):
    single = isinstance(tensors, torch.Tensor)
    results = _all_gatherv([tensors] if single else list(tensors), list(sizes), comm.key, algo)
    if single:
        return _into(out, results[0])
    return results if out is None else [_into(o, r) for o, r in zip(out, results)]


def compiled_reduce_scatter(comm, x, out, op, algo):
    return _into(out, _reduce_scatter(x, comm.key, op, algo))


def compiled_reduce_scatterv(comm, x, sizes, out, op, algo):
    return _into(out, _reduce_scatterv(x, list(sizes), comm.key, op, algo))


def _scale_args(scale):
    return (None, scale) if isinstance(scale, torch.Tensor) else (None if scale is None else float(scale), None)


def compiled_all_reduce_rmsnorm(comm, x, weight, residual, eps, out, residual_out, quant, scale, swizzle, algo):
    got = _all_reduce_rmsnorm(x, weight, residual, float(eps), quant, *_scale_args(scale), swizzle, comm.key, algo)
    y, scales = got[0], got[2] if quant == "nvfp4" else None
    if out is not None:
        y_out, scales_out = out if quant == "nvfp4" else (out, None)
        y, scales = _into(y_out, y), _into(scales_out, scales)
    return NormedResult(y, _into(residual_out, got[1]), scales)


def compiled_all_gatherv_fp4(comm, x, sizes, global_scale, extra, dequantize, algo, swizzle, out):
    got = _all_gatherv_fp4(x, list(sizes), *_scale_args(global_scale), list(extra), dequantize, swizzle,
                           comm.key, algo)
    n = len(extra)
    result = Fp4Gathered(got[0], got[1], tuple(got[2:2 + n]), got[2 + n] if dequantize else None, global_scale)
    if out is None:
        return result
    _into(out.packed, result.packed)
    _into(out.scales, result.scales)
    for o, r in zip(out.extra, result.extra):
        _into(o, r)
    if out.values is not None and result.values is not None:
        _into(out.values, result.values)
    return out._replace(global_scale=global_scale)
