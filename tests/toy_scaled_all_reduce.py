"""A toy operation, as an extension would add one: ``scaled_all_reduce`` (the sum over ranks,
times a constant). One module, with its descriptor and two paths; one table row prefers the
peer-memory path. tests/test_new_operation.py uses it with a Communicator and with
symcomm-bench (``--with toy_scaled_all_reduce``), touching nothing in symcomm.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from symcomm import check_mode
from symcomm.backends.custom_ar import AllReduceKernelPath
from symcomm.base import Call, Path, Setup
from symcomm.errors import ArgumentError
from symcomm.operations.base import CallContext, Operation, into
from symcomm.operations.collectives import all_reduce_call
from symcomm.registry import lookup

NAME = "scaled_all_reduce"
BUILDS: list[int] = []  # one entry per build(): what the validation-count test reads


class ScaledCall(Call):
    __slots__ = ("scale",)


class ScaledAllReduce(Operation):
    name = NAME
    bench = "toy_scaled_all_reduce:BENCH_SPEC"
    check_decode = {"scale": check_mode.bits_float}

    def build(self, ctx: CallContext, x: Any, scale: Any, out: Any = None) -> ScaledCall:
        BUILDS.append(1)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ArgumentError(f"scale must be a number, got {type(scale).__name__}")
        plain = all_reduce_call(x, out, "sum", ctx.device)  # the all-reduce's own rules
        call = ScaledCall(NAME, plain.inputs, plain.outputs, plain.in_ptrs, plain.out_ptrs, None, "sum", plain.nbytes)
        call.scale = float(scale)
        return call

    def check_scalars(self, call: ScaledCall):
        return [("scale", check_mode.float_bits(call.scale))]

    def compiled(self, comm: Any, x: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                 algo: str = "auto") -> torch.Tensor:
        return into(out, _scaled(x, float(scale), comm.key, algo))


SCALED_ALL_REDUCE = ScaledAllReduce()


class TorchScaledPath(Path):
    """torch.distributed's all_reduce, then the scale: any device."""

    name = "torch"
    ops = frozenset({NAME})

    def open(self, setup: Setup) -> str | None:
        self._group = setup.peers.group
        return None

    def close(self) -> None:
        self._group = None

    def why_not(self, call: ScaledCall) -> str | None:
        return None if call.dtype.is_floating_point else f"scales floating-point tensors, not {call.dtype}"

    def run(self, call: ScaledCall) -> None:
        x, out = call.inputs[0], call.outputs[0]
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        dist.all_reduce(out, group=self._group)
        out.mul_(call.scale)


class PeerScaledPath(AllReduceKernelPath):
    """symcomm's one-shot kernel over peer memory, then the scale: it opens where that kernel
    opens (CUDA, one host), and serves what the kernel would serve."""

    ops = frozenset({NAME})

    def __init__(self) -> None:
        super().__init__("custom-oneshot")
        self.name = "custom-scaled"

    def why_not(self, call: ScaledCall) -> str | None:
        return super().why_not(_as_all_reduce(call))

    def run(self, call: ScaledCall) -> None:
        super().run(_as_all_reduce(call))
        call.outputs[0].mul_(call.scale)


def _as_all_reduce(call: ScaledCall) -> Call:
    return Call("all_reduce", call.inputs, call.outputs, call.in_ptrs, call.out_ptrs, None, "sum", call.nbytes)


@torch.library.custom_op("symcomm_toy::scaled_all_reduce", mutates_args=())
def _scaled(x: torch.Tensor, scale: float, comm_key: int, algo: str) -> torch.Tensor:
    return lookup(comm_key).run(NAME, x, scale, algo=algo)


@_scaled.register_fake
def _(x, scale, comm_key, algo):
    return torch.empty_like(x)


def _bench_spec():
    from symcomm.bench.collectives import AllReduce

    def launch(comm, x, out, rows, redop, algo):
        return lambda: comm.run(NAME, x, 2.0, out=out, algo=algo)

    class ScaledSpec(AllReduce):
        """Timed and checked like all_reduce: the expected output is the sum times 2."""

        def expected(self, lay, redop, dtype, rank, world, gen):
            return super().expected(lay, redop, dtype, rank, world, lambda p: gen(p) * 2)

    return ScaledSpec(NAME, launch)


BENCH_SPEC = _bench_spec()
OPERATIONS = (SCALED_ALL_REDUCE,)
PATHS = (TorchScaledPath, PeerScaledPath)

__all__ = ["BENCH_SPEC", "OPERATIONS", "PATHS", "SCALED_ALL_REDUCE"]
