"""``fused-flagfree``, ``fused-oneshot``, ``fused-twoshot``: all_reduce_rmsnorm paths that run the
residual add and RMSNorm (+ FP8 / NVFP4) inside one of symcomm's all-reduce kernels, in one
launch (csrc/fused_norm_ar.cu). Each gives the bits of the unfused path with the same
all-reduce kernel: csrc/rmsnorm.cuh's ``rmsnorm_row`` is the device routine both call.

Where one serves: wherever its kernel can take the call when the dispatch table has an
all_reduce_rmsnorm row (which ranks the paths) or when ``algo=`` names it; without a row, only
where the all-reduce of x alone would run on that kernel.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from .. import rmsnorm
from ..base import FLAGFREE, TWOSHOT, Setup
from ..operations.all_reduce_rmsnorm import FUSED_KERNELS, OP, all_reduce_choice
from ..peer.capture import CAPTURE_CODES
from ..peer.context import aligned
from .custom_ar import ALGO_CODES
from .peer_path import PeerPath

if TYPE_CHECKING:
    from ..operations.base import Dispatcher

# A row is held in registers: at most 4 vectors of 8 per thread of the norm's 256 (rmsnorm.cuh).
FUSED_MAX_HIDDEN = 8192
_Y_BYTES = {None: 2, "fp8": 1, "nvfp4": 0.5}  # output bytes per element


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


class FusedNormPath(PeerPath):
    ops = frozenset({OP})
    equal_offsets = ("x",)  # x is read by peers in place at this rank's offset; outputs are local

    def __init__(self, name: str, shared=None) -> None:
        self.kernel = FUSED_KERNELS[name]  # the all-reduce kernel this path fuses
        self._dispatcher: Dispatcher | None = None
        super().__init__(name, shared)

    def open(self, setup: Setup) -> str | None:
        if self.kernel not in setup.opened:
            return f"{self.kernel} is off: {setup.off.get(self.kernel, 'not among this communicator paths')}"
        self._dispatcher = setup.dispatcher
        return super().open(setup)

    def why_not(self, call: rmsnorm.NormCall) -> str | None:
        # A table that measured this op ranks the fused paths itself; otherwise they follow the
        # all-reduce's choice, as does any call that forces the all-reduce.
        if call.inner_algo != "auto" or OP not in self._dispatcher.table.rows:
            chosen = all_reduce_choice(call, self._dispatcher) if call.inner_algo == "auto" else call.inner_algo
            if chosen != self.kernel:
                return f"the all-reduce of x alone runs on {chosen}, not {self.kernel}"
        return self.limits(call)

    def limits(self, call: rmsnorm.NormCall) -> str | None:
        """None if this path's kernel can take x [tokens, hidden]."""
        tokens, hidden = call.x.shape
        if hidden % 16 or hidden > FUSED_MAX_HIDDEN:
            return (f"hidden {hidden} is not a multiple of 16 up to {FUSED_MAX_HIDDEN} (the fused kernels hold a "
                    f"row in registers)")
        context, nbytes = self._context, call.x.nbytes
        if self.kernel == FLAGFREE:
            return None if nbytes <= context.flagfree_bytes else \
                f"{nbytes} bytes exceeds the flag-free buffer of {context.flagfree_bytes} bytes"
        if nbytes > context.staging_bytes:
            return f"{nbytes} bytes exceeds the staging buffer of {context.staging_bytes} bytes"
        if self.kernel == TWOSHOT:
            scratch = _round16(nbytes) + _round16(int(tokens * hidden * _Y_BYTES[call.quant]))
            scratch += tokens * hidden // 16 if call.quant == "nvfp4" else 0
            if scratch > context.staging_bytes:
                return (f"two-shot's scratch ({context.staging_bytes} bytes) cannot hold the {scratch} bytes of h, y "
                        f"and scales of this call")
        return None

    def run(self, call: rmsnorm.NormCall) -> None:
        if not call.tokens:
            return
        context, x = self._context, aligned(call.x)
        stage, slot, offset, session = context.input_of(x.data_ptr(), x.nbytes, CAPTURE_CODES[self.name],
                                                        peers_read=self.kernel != FLAGFREE)
        args = rmsnorm.launch_args(call, call.h, call.y, call.y_scales)
        code = context.lib.symcomm_ar_rmsnorm(context.ctx, ALGO_CODES[self.kernel], x.data_ptr(), slot, offset, stage,
                                              ctypes.byref(args), context.launch_stream(session))
        if code:
            context.check(f"fused all-reduce + RMSNorm ({self.kernel}) launch", code)
