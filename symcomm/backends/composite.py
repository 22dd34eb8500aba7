"""Composite paths: an operation made of another operation's call and local work, on any device.

- ``unfused`` / ``reference`` (all_reduce_rmsnorm): the all-reduce of x on whatever path that
  op's dispatch picks (or the one ``algo=`` forced), then the residual add and RMSNorm on this
  rank, by the standalone kernel (csrc/rmsnorm.cu) or the torch reference.
- ``unfused`` (all_gatherv_fp4): fp4.quantize into this rank's slice of the gathered outputs,
  then one in-place all_gatherv of payload, scales and extras.

The inner call is built from tensors the operation already validated and goes through the
Communicator's Dispatcher: chosen and run with no second validation and no second check-mode
exchange (the composite's own check covers it, comparing the offsets the inner path needs).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import fp4, rmsnorm
from ..base import Call, Path, Setup
from ..operations.all_gatherv_fp4 import OP as FP4_OP, UNFUSED as FP4_UNFUSED, Fp4Call
from ..operations.all_reduce_rmsnorm import OP as NORM_OP, REFERENCE, UNFUSED, all_reduce_view
from ..operations.collectives import make_all_reduce

if TYPE_CHECKING:
    from ..operations.base import Dispatcher


class CompositePath(Path):
    """A path whose run makes an inner call through the Communicator's Dispatcher."""

    def __init__(self) -> None:
        self._dispatcher: Dispatcher | None = None

    def open(self, setup: Setup) -> str | None:
        self._dispatcher = setup.dispatcher
        return None

    def close(self) -> None:
        self._dispatcher = None

    def _inner_offsets(self, inner: Call, algo: str, keep: str) -> tuple[str, ...]:
        """What check mode compares for this call: ``keep`` ("x" or "out") where the inner call's
        path reads or writes it at this rank's pool offset, else nothing."""
        path = self._dispatcher.choose_inner(inner, algo)
        return (keep,) if path.needs_equal_offsets and keep in path.equal_offsets else ()

    def _run_inner(self, inner: Call, algo: str) -> None:
        self._dispatcher.run_inner(inner, algo)


class UnfusedNormPath(CompositePath):
    ops = frozenset({NORM_OP})

    def __init__(self, name: str, local: Callable[..., None], needs_kernel: bool) -> None:
        super().__init__()
        self.name, self._local, self._needs_kernel = name, local, needs_kernel

    def why_not(self, call: rmsnorm.NormCall) -> str | None:
        return rmsnorm.kernel_available(call.x.device) if self._needs_kernel else None

    def compared_offsets(self, call: rmsnorm.NormCall) -> tuple[str, ...]:
        return self._inner_offsets(all_reduce_view(call.x), call.inner_algo, "x")

    def run(self, call: rmsnorm.NormCall) -> None:
        a = call.all_reduce_out()
        self._run_inner(make_all_reduce(call.x, a), call.inner_algo)
        h = call.h  # None: no residual and no residual_out, so the all-reduce's buffer becomes h
        if h is None:
            call.h = a
        self._local(a, call, h, call.y, call.y_scales)


class UnfusedFp4Path(CompositePath):
    ops = frozenset({FP4_OP})
    name = FP4_UNFUSED

    def why_not(self, call: Fp4Call) -> str | None:
        return None

    def compared_offsets(self, call: Fp4Call) -> tuple[str, ...]:
        return self._inner_offsets(call.gather_call(self._dispatcher.rank), call.inner_algo, "out")

    def run(self, call: Fp4Call) -> None:
        inner = call.gather_call(self._dispatcher.rank)
        fp4.quantize(call.x, call.gs, out=(inner.inputs[0], inner.inputs[1]))
        self._run_inner(inner, call.inner_algo)


def unfused_norm() -> UnfusedNormPath:
    return UnfusedNormPath(UNFUSED, rmsnorm.launch_kernel, needs_kernel=True)


def reference_norm() -> UnfusedNormPath:
    return UnfusedNormPath(REFERENCE, rmsnorm.launch_reference, needs_kernel=False)
