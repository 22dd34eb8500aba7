"""``custom-push``: all_gather and uneven all_gatherv by writing into every peer's output.

When the output lies in the symmetric pool, it sits at the same offset of a region that every
rank has mapped (symcomm/peer/setup.py, map_regions), so each rank can write its own rows straight into every
peer's copy, all tensors of the call (payload, scales, top-k ids, weights) in one launch, and
meet the peers at two bounded barriers (csrc/peer_gather.cu, gather_push). NCCL's symmetric
kernels cannot serve uneven counts, and its send/receive schedule pays a latency per peer; a
push pays one launch. Inputs may be anywhere (the push reads local memory); outputs outside
the pool are NCCL's.

It shares the peer context (buffers, epochs, mapped regions, stream order, alarm) with the
all-reduce kernels' paths, so it opens, captures and closes as a PeerPath.
"""
from __future__ import annotations

import ctypes

from ..base import PUSH, Call
from ..peer.capture import CAPTURE_CODES
from ..peer.setup import SharedContext
from .peer_path import PeerPath, offset_unit

_c = ctypes
MAX_TENSORS = 8  # symcomm.h's SYMCOMM_AR_MAX_PIECES
CAPTURE_CODE = CAPTURE_CODES[PUSH]


class PushPath(PeerPath):
    needs_equal_offsets = True  # peers write at this rank's output offset...
    equal_offsets = ("out",)  # ...while inputs are read locally and may sit anywhere

    def __init__(self, shared: SharedContext | None = None) -> None:
        super().__init__(PUSH, shared)

    def why_not(self, call: Call) -> str | None:
        if call.op not in ("all_gather", "all_gatherv"):
            return "custom-push serves all_gather and all_gatherv only"
        if len(call.outputs) > MAX_TENSORS:
            return f"{len(call.outputs)} tensors exceed the {MAX_TENSORS} one launch moves"
        context = self._context
        for i, (out, ptr) in enumerate(zip(call.outputs, call.out_ptrs)):
            if context.region_of(ptr) is None:
                problem = context.region_problem or "allocate it inside use_symmetric_memory"
                return (f"output {i} is not in a mapped symmetric pool region (the push writes every peer's "
                        f"output in place): {problem}")
            unit = offset_unit(call, out, context.world_size)
            # Only what is equal on every rank decides: a misaligned input (rank-local) is
            # copied in run() rather than sending this rank down another path than its peers.
            if unit % 16 or ptr & 15:
                what = "one rank's chunk" if call.even else "a row"
                return f"out {i}: {what} of {unit} bytes, or its address, is not whole 16-byte vectors"
        return None

    def run(self, call: Call) -> None:
        context = self._context
        session = context.session()
        world, rank = context.world_size, context.rank
        sizes = call.sizes or [call.inputs[0].shape[0]] * world
        total_rows, before = sum(sizes), sum(sizes[:rank])
        n = len(call.outputs)
        srcs, slots = (_c.c_uint64 * n)(), (_c.c_int * n)()
        offsets, nbytes = (_c.c_uint64 * n)(), (_c.c_uint64 * n)()
        stream, keep, src_ptrs = context.launch_inputs(session, call.inputs, call.in_ptrs)
        for i, (out, src, dst) in enumerate(zip(call.outputs, src_ptrs, call.out_ptrs)):
            slot, offset = context.output_slot(dst, out.nbytes, session, CAPTURE_CODE)
            row_bytes = out.nbytes // total_rows
            srcs[i], slots[i] = src, slot
            offsets[i], nbytes[i] = offset + before * row_bytes, sizes[rank] * row_bytes
        code = context.lib.symcomm_ar_gatherv(context.ctx, n, srcs, slots, offsets, nbytes, call.nbytes, stream)
        if code:
            context.check("custom all_gatherv launch", code)
