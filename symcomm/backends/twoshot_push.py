"""``custom-twoshot-push``: all_reduce (sum) by remote stores into every peer's output.

Two-shot's two phases with every NVLink transfer a store (csrc/custom_ar.cu, two_shot_push):
each rank stores chunk p of its input into rank p's memory, rank p sums its chunk in rank order
and stores the sum into every rank's output. Stores move more of the link than the loads that
one-shot and two-shot issue, so past the flag-free kernel's 4 MiB receive slot this is symcomm's
fastest all-reduce at world 2 (docs/benchmarks.md). The output must lie in the symmetric pool, at the same offset on every
rank (the pool rule), since peers write it; the input is read locally and may sit anywhere. At
world 2 no scratch is used, so any size goes; at a larger world W-2 of each chunk's terms pass
through the scratch buffer, which bounds the size. It has run on real ranks at world 2 only
(4 and 8 simulated ranks pass), so elsewhere it declines.

It shares the peer context with the other kernel paths, so it opens, captures and closes as a
PeerPath.
"""
from __future__ import annotations

import torch

from ..base import TWOSHOT_PUSH, Call
from ..peer.capture import CAPTURE_CODES
from ..peer.context import PeerContext
from ..peer.setup import SharedContext
from .custom_ar import DTYPE_CODES
from .peer_path import PeerPath

CAPTURE_CODE = CAPTURE_CODES[TWOSHOT_PUSH]
# The world sizes at which it has passed on real ranks.
REAL_WORLDS = (2,)


class TwoShotPushPath(PeerPath):
    needs_equal_offsets = True
    # Peers write at this rank's output offset; the input is read locally. Check mode compares
    # the input's offset too (the pool rule asks it of every tensor of a call): a composite
    # operation checks its inner all-reduce on the input before it allocates the output, and
    # the path that serves the output it then allocates may be one that reads the input at
    # this rank's offset (all_reduce_rmsnorm's unfused path, custom-oneshot).
    equal_offsets = ("x", "out")

    def __init__(self, shared: SharedContext | None = None) -> None:
        self.scratch_bytes = 0
        super().__init__(TWOSHOT_PUSH, shared)

    def attached(self, context: PeerContext) -> None:
        self.scratch_bytes = context.staging_bytes  # the scratch buffer has the staging buffer's size

    def chunk_bytes(self, nbytes: int) -> int:
        """One rank's chunk: whole vectors, the last rank's possibly shorter."""
        return -(-nbytes // 16 // self._context.world_size) * 16

    def why_not(self, call: Call) -> str | None:
        if call.op != "all_reduce":
            return "custom-twoshot-push serves all_reduce only"
        if call.redop != "sum":
            return f"custom kernels only sum (op={call.redop!r})"
        if call.dtype not in DTYPE_CODES:
            return f"dtype {call.dtype} is unsupported (float32, float16, bfloat16)"
        if not call.nbytes:
            return None  # nothing moves: the communicator skips the launch
        context = self._context
        world = context.world_size
        if world not in REAL_WORLDS:
            return (f"custom-twoshot-push has run on real ranks at world 2 only (4 and 8 simulated ranks "
                    f"pass); this world has {world} ranks")
        if call.nbytes % 16:
            return f"{call.nbytes} bytes is not a multiple of 16 (the kernels move 16-byte vectors)"
        out_ptr = call.out_ptrs[0]
        if context.region_of(out_ptr) is None:
            problem = context.region_problem or "allocate it inside use_symmetric_memory"
            return f"the output is not in a mapped symmetric pool region (peers write it in place): {problem}"
        # A pool output sits at one offset on every rank, so its alignment is the same everywhere;
        # a misaligned input is this rank's own and is copied in run() instead.
        if out_ptr & 15:
            return "the output sits in the symmetric pool but not on a 16-byte boundary"
        if (world - 2) * self.chunk_bytes(call.nbytes) > self.scratch_bytes:
            return (f"{call.nbytes} bytes exceeds custom-twoshot-push's capacity at world {world}: {world - 2} "
                    f"of its chunks pass through the scratch buffer of {self.scratch_bytes} bytes")
        return None

    def run(self, call: Call) -> None:
        """The input is read locally only, so it needs no slot or staging, in a graph or not;
        the capture records the output's region and offset, which peers write. In place, a peer
        overwrites this rank's chunk of the output, which is also its input, so that chunk is
        copied first, on the launch's stream. Out of place the chunk's address is arithmetic:
        no tensor views on the hot path (about 3 us of them per call)."""
        context = self._context
        session = context.session()
        in_ptr, out_ptr, nbytes = call.in_ptrs[0], call.out_ptrs[0], call.nbytes
        slot, out_offset = context.output_slot(out_ptr, nbytes, session, CAPTURE_CODE)
        chunk = self.chunk_bytes(nbytes)
        lo = min(context.rank * chunk, nbytes)
        keep = None  # a copy, alive until the launch is enqueued
        if in_ptr == out_ptr:
            # The stream first, as launch_inputs takes it: the clone reads the input, which may be
            # the output of symcomm's previous launch on another stream.
            stream = context.launch_stream(session)
            if lo < nbytes:
                keep = call.inputs[0].reshape(-1).view(torch.uint8)[lo:lo + chunk].clone()
            own_ptr = keep.data_ptr() if keep is not None else in_ptr
        else:
            # A misaligned input is this rank's own business (why_not): an aligned copy, not a refusal.
            stream, keep, (in_ptr,) = context.launch_inputs(session, call.inputs, call.in_ptrs)
            own_ptr = in_ptr + lo
        code = context.lib.symcomm_ar_twoshot_push(context.ctx, DTYPE_CODES[call.dtype], in_ptr, own_ptr, slot,
                                                   out_offset, out_ptr, nbytes, stream)
        if code:
            context.check("custom-twoshot-push launch", code)
