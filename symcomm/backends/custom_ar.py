"""symcomm's own all-reduce kernels (csrc/custom_ar.cu) as three paths: ``custom-flagfree``,
``custom-oneshot`` and ``custom-twoshot``; one-shot also serves reduce-scatter(v), flag-free
also all_gather(v) and reduce_scatter(v) of chunks up to its receive slot (the same
push-and-poll protocol over the same buffers, csrc/custom_ar.cu's flag_free_gather /
flag_free_scatter, which take every rank's chunk).

They share the communicator's PeerContext (symcomm/backends/peer_path.py), so dispatch treats each
kernel as a path of its own. docs/architecture.md has the rules; csrc/custom_ar.cu explains the
kernels and their memory ordering.
"""
from __future__ import annotations

import ctypes

import torch

from .. import _native
from ..base import FLAGFREE, ONESHOT, SCATTERING_OPS, TWOSHOT, Call
from ..peer.capture import CAPTURE_CODES, IN_REGION, SCATTER_CODE, STAGED
from ..peer.context import PeerContext
from .peer_path import PeerPath, offset_unit

ALGO_CODES = {FLAGFREE: 0, ONESHOT: 1, TWOSHOT: 2}  # symcomm_ar_algo_t
DTYPE_CODES = _native.DTYPE_CODES
# The collectives custom-flagfree serves besides all_reduce, with their capture codes.
FLAGFREE_OPS = {op: CAPTURE_CODES[f"custom-flagfree:{op}"]
                for op in ("all_gather", "reduce_scatter", "all_gatherv", "reduce_scatterv")}
# The world sizes at which those collectives have passed on real ranks. Their only world-4 run (4x H200,
# 2026-11-28) never got a clean pass: one rank's test failed a tolerance against NCCL and skipped
# a call, and since the flag-free protocol pairs calls by count alone, every later call paired
# with the wrong one (wrong sums, then a bounded wait). 4 and 8 simulated ranks pass. Until a
# world-4 run passes, they decline elsewhere.
FLAGFREE_COLLECTIVE_WORLDS = (2,)


def flagfree_chunks(call: Call, world: int) -> list[int]:
    """Every rank's chunk of a flag-free all_gather(v) / reduce_scatter(v) in bytes, in rank
    order: what one peer's receive slot holds (a gather's input, a scatter's output). The same
    list on every rank, since it follows the sizes every rank passes."""
    whole = call.inputs[0] if call.op in SCATTERING_OPS else call.outputs[0]
    if call.sizes is None:
        return [whole.nbytes // world] * world
    total = sum(call.sizes)
    row = whole.nbytes // total if total else 0
    return [n * row for n in call.sizes]


class AllReduceKernelPath(PeerPath):
    """One of the three all-reduce kernels."""

    # Peers read this rank's pool inputs at its offsets (one-shot, two-shot) or nothing of its
    # tensors (flag-free); every output is written by its own rank alone, so check mode compares
    # the inputs only. The guide's rule for outputs still stands: under auto, nccl-symm (next in
    # many rows) can take a call only if its output is in the pool.
    equal_offsets = ("x",)

    def __init__(self, name: str, shared=None) -> None:
        self._algo = ALGO_CODES[name]
        self.capacity = 0
        self._chunk_bytes = (ctypes.c_uint64 * 0)()  # the flag-free launches' per-rank chunks, refilled per call
        super().__init__(name, shared)

    def attached(self, context: PeerContext) -> None:
        self.capacity = context.flagfree_bytes if self.name == FLAGFREE else context.staging_bytes
        self._chunk_bytes = (ctypes.c_uint64 * context.world_size)()

    def why_not(self, call: Call) -> str | None:
        if call.op in SCATTERING_OPS and self.name == ONESHOT:
            return self._why_not_scatter(call)
        if call.op in FLAGFREE_OPS and self.name == FLAGFREE:
            return self._why_not_flagfree(call)
        if call.op != "all_reduce":
            return ("custom-oneshot serves reduce_scatter(v) and all_reduce only" if self.name == ONESHOT
                    else "custom-flagfree serves all_reduce, all_gather(v) and reduce_scatter(v) only"
                    if self.name == FLAGFREE
                    else "custom kernels serve all_reduce only")
        if call.redop != "sum":
            return f"custom kernels only sum (op={call.redop!r})"
        if call.dtype not in DTYPE_CODES:
            return f"dtype {call.dtype} is unsupported (float32, float16, bfloat16)"
        nbytes = call.nbytes
        if nbytes % 16:
            return f"{nbytes} bytes is not a multiple of 16 (the kernels move 16-byte vectors)"
        if (call.in_ptrs[0] | call.out_ptrs[0]) & 15:
            return "input or output is not 16-byte aligned"
        if nbytes > self.capacity and not self._unbounded(call):
            return (f"{nbytes} bytes exceeds {self.name}'s capacity of {self.capacity} bytes"
                    + (" (an input in the symmetric pool is read in place, with no limit)"
                       if self.name == ONESHOT else ""))
        return None

    def _unbounded(self, call: Call) -> bool:
        """Whether the staging buffer does not bound this call: a one-shot all-reduce of an input
        in a mapped pool region, read where it lies (an in-place one is summed into scratch and
        copied back by the kernel). Two-shot's reduced chunks pass through the scratch buffer, of
        the staging buffer's size, whatever the input. Pool membership is the same on every rank
        (the pool rule), while in place need not be: so in place must not decide
        (symcomm/dispatch.py)."""
        return self.name == ONESHOT and self._context.region_of(call.in_ptrs[0]) is not None

    def _why_not_flagfree(self, call: Call) -> str | None:
        """all_gather / reduce_scatter on the flag-free kernel. The receive buffers start filled
        with 0xFFFFFFFF words and a word is "arrived" once it differs, so only dtypes in which
        that word is a NaN can go through: there a writer swaps it for another NaN. Any other
        dtype (int32's -1, a float64 whose low word is all ones) would lose a real value."""
        op = call.op
        world = self._context.world_size
        if world not in FLAGFREE_COLLECTIVE_WORLDS:
            return (f"the flag-free {op} is proven on real ranks at world 2 only (its one world-4 run never "
                    f"passed cleanly); this world has {world} ranks")
        if op in SCATTERING_OPS and call.redop != "sum":
            return f"custom kernels only sum (op={call.redop!r})"
        if call.dtype not in DTYPE_CODES:
            return (f"dtype {call.dtype} is unsupported by the flag-free {op} (float32, float16, bfloat16: "
                    f"the dtypes in which the receive buffers' 0xFFFFFFFF sentinel word is a NaN, not a value)")
        # Alignment is this rank's own business and must not decide the path (peers would wait
        # in another one): _run_flagfree copies a misaligned input or output instead.
        if call.sizes is None:  # even: every rank's chunk is this rank's (the hot path, checked once)
            return self._chunk_problem((call.outputs[0] if op in SCATTERING_OPS else call.inputs[0]).nbytes,
                                       "one rank's chunk")
        if len(call.inputs) > 1:
            return f"the flag-free {op} moves one tensor per call, and this call has {len(call.inputs)}"
        for rank, chunk in enumerate(flagfree_chunks(call, world)):
            if chunk % 16 or chunk > self.capacity:  # worded only when there is a reason
                return self._chunk_problem(chunk, f"rank {rank}'s chunk")
        return None

    def _chunk_problem(self, chunk: int, whose: str) -> str | None:
        """Why a flag-free chunk of ``chunk`` bytes cannot go, or None."""
        if chunk % 16:
            return f"{whose} of {chunk} bytes is not whole 16-byte vectors"
        if chunk > self.capacity:
            return f"{whose} of {chunk} bytes exceeds {self.name}'s receive slot of {self.capacity} bytes"
        return None

    def _why_not_scatter(self, call: Call) -> str | None:
        if call.redop != "sum":
            return f"custom kernels only sum (op={call.redop!r})"
        if call.dtype not in DTYPE_CODES:
            return f"dtype {call.dtype} is unsupported (float32, float16, bfloat16)"
        unit = offset_unit(call, call.inputs[0], self._context.world_size)
        if unit % 16:
            what = "one rank's chunk" if call.even else "a row"
            return f"{what} of {unit} bytes is not whole 16-byte vectors"
        # Only what is equal on every rank decides. A pool input sits at one offset everywhere,
        # so its alignment is the same on every rank. An ordinary input is staged by a copy
        # (any alignment) and a misaligned output is written through an aligned buffer
        # (_run_scatter): their addresses are this rank's own business.
        in_ptr = call.in_ptrs[0]
        if in_ptr & 15 or call.nbytes > self.capacity:  # the common call looks up nothing
            in_pool = self._context.region_of(in_ptr) is not None
            if in_pool and in_ptr & 15:
                return "the input sits in the symmetric pool but not on a 16-byte boundary"
            if not in_pool and call.nbytes > self.capacity:
                return (f"{call.nbytes} bytes exceeds the staging capacity of {self.capacity} bytes "
                        f"(an input in the symmetric pool is read in place, with no limit)")
        return None

    def run(self, call: Call) -> None:
        if call.op in FLAGFREE_OPS and self.name == FLAGFREE:
            self._run_flagfree(call)
            return
        if call.op in SCATTERING_OPS:
            self._run_scatter(call)
            return
        context, ptr = self._context, call.in_ptrs[0]
        stage, slot, offset, session = context.input_of(ptr, call.nbytes, CAPTURE_CODES[self.name],
                                                        peers_read=self.name != FLAGFREE)
        # In place, one-shot writes what its peers may still be reading. An input they read where
        # it lies (a pool region's slot, or a captured input's own slot) is summed into scratch,
        # which the kernel copies back once every peer has passed its end barrier: staging it
        # instead would send this rank to the staging buffers while its peers, calling out of
        # place on the same tensor, read it where it lies. A staged input is a copy already.
        if self.name == ONESHOT and ptr == call.out_ptrs[0] and not stage:
            self._run_in_place_through(call, slot, offset, session)
            return
        self.launch(call, stage, slot, offset, session)

    def _run_in_place_through(self, call: Call, slot: int, offset: int, session) -> None:
        """An in-place one-shot of an input that peers read through ``slot``: summed into a fresh
        tensor, which the kernel copies to the input after its end barrier. A kernel that gives
        up leaves the input as it was. In a capture the tensor comes from the graph's pool and
        lives as long as the graph."""
        context = self._context
        scratch = torch.empty_like(call.outputs[0])
        code = context.lib.symcomm_ar_oneshot_in_place(context.ctx, DTYPE_CODES[call.dtype], slot, offset,
                                                       scratch.data_ptr(), call.in_ptrs[0], call.nbytes,
                                                       context.launch_stream(session))
        if code:
            context.check("custom all-reduce launch (in place, through scratch)", code)

    def launch(self, call: Call, stage: int, slot: int, offset: int = 0, session=None) -> None:
        """The all-reduce launch itself, reading the input as told (run() decides how; tests force
        a staged or slot read). ``session``: the capture session the launch is recorded in."""
        context = self._context
        code = context.lib.symcomm_ar_run(context.ctx, self._algo, DTYPE_CODES[call.dtype], call.in_ptrs[0], slot,
                                          offset, call.out_ptrs[0], call.nbytes, stage,
                                          context.launch_stream(session))
        if code:
            context.check("custom all-reduce launch", code)

    def _run_scatter(self, call: Call) -> None:
        """Uneven reduce-scatter as one-shot over this rank's rows: peers' inputs hold them at
        the same offset. A pool input is read in place, any other is staged whole; in place is
        safe here (this rank writes only its own rows, which no peer reads)."""
        context = self._context
        session = context.session()
        x = call.inputs[0]
        sizes = call.sizes or [x.shape[0] // context.world_size] * context.world_size
        row_bytes = call.nbytes // sum(sizes)
        region = context.region_of(call.in_ptrs[0])
        slot, offset = (region[1], call.in_ptrs[0] - region[0]) if region else (0, 0)
        if session is not None:
            if region:
                session.record(IN_REGION, SCATTER_CODE, call.nbytes, context.region_numbers[region[0]], offset)
            else:
                session.record(STAGED, SCATTER_CODE, call.nbytes)
        out = call.outputs[0]
        # A misaligned output is this rank's own (why_not takes it): the kernel writes an aligned copy.
        target = torch.empty_like(out) if call.out_ptrs[0] % 16 else None
        code = context.lib.symcomm_ar_reduce_scatterv(
            context.ctx, DTYPE_CODES[call.dtype], call.in_ptrs[0], slot, offset, call.nbytes,
            sum(sizes[:context.rank]) * row_bytes, call.out_ptrs[0] if target is None else target.data_ptr(),
            sizes[context.rank] * row_bytes, 0 if region else 1, context.launch_stream(session))
        if code:
            context.check("custom reduce_scatterv launch", code)
        if target is not None:
            out.copy_(target)

    def _run_flagfree(self, call: Call) -> None:
        """all_gather(v) / reduce_scatter(v) by push: each rank writes its chunks into the peers'
        receive buffers, so no peer reads this rank's tensors and the input needs no slot or
        staging, in a graph or not (recorded as read directly)."""
        context, op = self._context, call.op
        _, _, _, session = context.input_of(call.in_ptrs[0], call.nbytes, FLAGFREE_OPS[op], peers_read=False)
        chunks = self._chunk_bytes  # read by the entry point before it returns: one array serves every call
        chunks[:] = flagfree_chunks(call, context.world_size)
        fn = (context.lib.symcomm_ar_flagfree_reduce_scatterv if op in SCATTERING_OPS
              else context.lib.symcomm_ar_flagfree_all_gatherv)
        # The kernels move 16-byte vectors. A misaligned view (rank-local, so it never decided
        # the path) goes through aligned copies; an in-place call then runs out of place.
        out_ptr, out = call.out_ptrs[0], call.outputs[0]
        stream, keep, (in_ptr,) = context.launch_inputs(session, call.inputs, call.in_ptrs)  # keep: alive to the launch
        target = torch.empty_like(out) if out_ptr % 16 else None
        code = fn(context.ctx, DTYPE_CODES[call.dtype], in_ptr, out_ptr if target is None else target.data_ptr(),
                  chunks, stream)
        if code:
            context.check(f"custom-flagfree {op} launch", code)
        if target is not None:
            out.copy_(target)
