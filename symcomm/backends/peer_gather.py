"""``custom-push``: all_gather and uneven all_gatherv by writing into every peer's output.

When the output lies in the symmetric pool, it sits at the same offset of a region that every
rank has mapped (custom.map_regions), so each rank can write its own rows straight into every
peer's copy, all tensors of the call (payload, scales, top-k ids, weights) in one launch, and
meet the peers at two bounded barriers (csrc/custom_ar.cu, gather_push). NCCL's symmetric
kernels cannot serve uneven counts, and its send/receive schedule pays a latency per peer; a
push pays one launch. Inputs may be anywhere (the push reads local memory); outputs outside
the pool are NCCL's.

It shares the custom kernels' state (buffers, epochs, mapped regions, stream order, alarm)
with the three all-reduce paths, so it opens, captures and closes through CustomPath.
"""
from __future__ import annotations

import ctypes

from ..base import PUSH, Call
from .custom import CAPTURE_CODES, CustomPath, Kernels, aligned

_c = ctypes
MAX_TENSORS = 8  # symcomm.h's SYMCOMM_AR_MAX_PIECES
CAPTURE_CODE = CAPTURE_CODES[PUSH]


class PushPath(CustomPath):
    needs_equal_offsets = True  # peers write at this rank's output offset...
    equal_offsets = ("out",)  # ...while inputs are read locally and may sit anywhere

    def __init__(self, kernels: Kernels | None = None) -> None:
        super().__init__(PUSH, kernels)

    def why_not(self, call: Call) -> str | None:
        if call.op not in ("all_gather", "all_gatherv"):
            return "custom-push serves all_gather and all_gatherv only"
        if len(call.outputs) > MAX_TENSORS:
            return f"{len(call.outputs)} tensors exceed the {MAX_TENSORS} one launch moves"
        state = self._state
        for i, (out, ptr) in enumerate(zip(call.outputs, call.out_ptrs)):
            if state.region_of(ptr) is None:
                problem = state.region_problem or "allocate it inside use_symmetric_memory"
                return (f"output {i} is not in a mapped symmetric pool region (the push writes every peer's "
                        f"output in place): {problem}")
            row_bytes = out.nbytes // out.shape[0] if out.shape[0] else 0
            # Only what is equal on every rank decides: a misaligned input (rank-local) is
            # copied in run() rather than sending this rank down another path than its peers.
            if row_bytes % 16 or ptr & 15:
                return f"out {i}: rows of {row_bytes} bytes or its address are not whole 16-byte vectors"
        return None

    def run(self, call: Call) -> None:
        state = self._state
        session = state.session()
        world, rank = state.world_size, state.rank
        sizes = call.sizes or [call.inputs[0].shape[0]] * world
        total_rows, before = sum(sizes), sum(sizes[:rank])
        n = len(call.outputs)
        srcs, slots = (_c.c_uint64 * n)(), (_c.c_int * n)()
        offsets, nbytes = (_c.c_uint64 * n)(), (_c.c_uint64 * n)()
        keep = [aligned(x) for x in call.inputs]
        for i, (out, x, dst) in enumerate(zip(call.outputs, keep, call.out_ptrs)):
            slot, offset = state.output_slot(dst, out.nbytes, session, CAPTURE_CODE)
            row_bytes = out.nbytes // total_rows
            srcs[i], slots[i] = x.data_ptr(), slot
            offsets[i], nbytes[i] = offset + before * row_bytes, sizes[rank] * row_bytes
        code = state.lib.symcomm_ar_gatherv(state.ctx, n, srcs, slots, offsets, nbytes, call.nbytes,
                                            state.launch_stream(session))
        if code:
            state.check("custom all_gatherv launch", code)
