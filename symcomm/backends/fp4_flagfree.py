"""``fused-flagfree``, an all_gatherv_fp4 path: one launch of csrc/peer_gather.cu's
flag_free_gather_fp4.

Each rank quantizes its rows (the codec of ``fp4.quantize``, bit for bit) and pushes payload and
block scales into its peers' flag-free receive buffers, the ones the flag-free all-reduce and
all-gather use; each peer copies them out into its own outputs as they land. No barrier, and no
peer touches the outputs, so they may sit anywhere. The codec never writes a word that reads as
the buffers' sentinel (csrc/peer_gather.cu says why), which is what lets FP4 bytes go flag-free
where arbitrary bytes cannot; the ``extra`` tensors are arbitrary bytes, so a call with extras
is left to ``fused-push``.
"""
from __future__ import annotations

import ctypes

from .. import _native, fp4
from ..base import Setup
from ..operations.all_gatherv_fp4 import FLAGFREE_FP4, OP, Fp4Call
from ..peer.capture import CAPTURE_CODES
from ..peer.context import PeerContext
from ..peer.setup import SharedContext
from .custom_ar import FLAGFREE_COLLECTIVE_WORLDS
from .fp4_push import FUSED_DTYPES
from .peer_path import PeerPath

CAPTURE_CODE = CAPTURE_CODES[FLAGFREE_FP4]


def wire_bytes(rows: int, cols: int) -> int:
    """Bytes of one rank's chunk on the wire: its payload (two 16-value blocks a 16-byte vector)
    and then its block scales (16 a vector), each padded to whole vectors."""
    blocks = rows * (cols // fp4.BLOCK)
    return 16 * ((blocks + 1) // 2 + (blocks + 15) // 16)


class FlagFreeFp4Path(PeerPath):
    ops = frozenset({OP})
    needs_equal_offsets = False  # inputs are read and outputs written by this rank alone

    def __init__(self, shared: SharedContext | None = None) -> None:
        self.capacity = 0
        self._rows = (ctypes.c_int64 * 0)()  # every rank's row count, refilled per call
        super().__init__(FLAGFREE_FP4, shared)

    def attached(self, context: PeerContext) -> None:
        self.capacity = context.flagfree_bytes
        self._rows = (ctypes.c_int64 * context.world_size)()

    def open(self, setup: Setup) -> str | None:
        if setup.device.type != "cuda":
            return f"the flag-free kernel runs on CUDA devices, and this communicator runs on {setup.device}"
        return super().open(setup)

    def why_not(self, call: Fp4Call) -> str | None:
        context = self._context
        if context.device_index is None:  # a context over CPU memory: only tests build one
            return "the flag-free kernel runs on CUDA devices, and this communicator runs on cpu"
        if context.world_size not in FLAGFREE_COLLECTIVE_WORLDS:
            return (f"the flag-free collectives are proven on real ranks at world 2 only; this world has "
                    f"{context.world_size} ranks")
        if call.x.dtype not in FUSED_DTYPES:
            return f"x is {call.x.dtype}: the flag-free kernel quantizes bfloat16 and float16 rows"
        if call.extra:
            return ("extra tensors are arbitrary bytes, which could read as the receive buffers' sentinel; "
                    "fused-push carries them")
        # The largest chunk decides (the same sizes, so the same answer, on every rank).
        rows = max(call.sizes)
        chunk = wire_bytes(rows, call.x.shape[1])
        if chunk > self.capacity:
            return (f"rank {call.sizes.index(rows)}'s {rows} rows take {chunk} bytes on the wire, more than the "
                    f"flag-free receive slot of {self.capacity} bytes")
        return None

    def run(self, call: Fp4Call) -> None:
        if not sum(call.sizes):
            return  # every rank knows: no rank launches
        context = self._context
        # Recorded with the gathered bytes, which every rank's capture must agree on (x's are its own).
        _, _, _, session = context.input_of(call.x.data_ptr(), call.packed.nbytes + call.scales.nbytes,
                                            CAPTURE_CODE, peers_read=False)
        stream, (x,), _ = context.launch_inputs(session, (call.x,))  # x is rank-local: a misaligned view is copied
        self._rows[:] = call.sizes
        gs_ptr, gs_value = fp4.launch_scale(call.gs)
        args = _native.FlagFreeFp4Args(x.data_ptr(), _native.DTYPE_CODES[x.dtype], x.shape[1], self._rows, gs_ptr,
                                       gs_value, call.packed.data_ptr(), call.scales.data_ptr())
        code = context.lib.symcomm_ar_flagfree_gatherv_fp4(context.ctx, ctypes.byref(args), stream)
        if code:
            context.check("flag-free FP4 gather launch", code)
