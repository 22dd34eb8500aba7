"""torch.library custom ops, so torch.compile(fullgraph=True) can trace the collectives.

Eager calls never come through here: a custom op's dispatch costs microseconds that eager
collectives cannot spare. Under compile, Communicator methods route here, passing the
communicator by its registry key (ops take ints, not Python objects). The ops are functional;
an ``out=`` argument is honoured by copying the result into it.
"""
from __future__ import annotations

import torch

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
