"""PeerContext: one rank's kernel context on the peer runtime (csrc/custom_ar.cu's symcomm_ar_t).

It holds this rank's mapped buffers, the pool regions mapped from every peer, the device slots
of buffers captured in graphs, the stream order of its launches, and the alarm its kernels raise
when they give up on a peer. Every peer-memory path (symcomm's all-reduce kernels, the push
gather and the FP4 dispatch) launches through the one context of its
communicator. symcomm/peer/setup.py builds it by vote; symcomm/peer/capture.py records what
a graph captured.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
import warnings

import torch

from .. import settings
from ..base import Alarm, capturing, raw_stream
from ..errors import ArgumentError, CudaError
from ..fd_channel import FdChannel
from ..pool import GRANULE_SHIFT
from .capture import DIRECT, IN_REGION, STAGED, CaptureSession

_c = ctypes
HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
# Staging (and the two-shot scratch, as large) bounds one-shot/two-shot: 16 MiB covers the
# range where the kernels can beat NCCL (docs/measuring.md: NCCL reaches its bandwidth from
# about 16 MiB).
DEFAULT_STAGING_BYTES = 16 << 20
# Per rank and per receive buffer (three of them, so 3 x world x this in all) for the flag-free
# kernels: the all-reduce's whole message, and one rank's chunk of all_gather/reduce_scatter.
# The slot, not the kernels, has ended them at every size tried so far: at 512 KiB (2x H200, still
# 0.64x NCCL at their last size, bench/results/2026-11-28_nvidia-h200-x4_w2_baseline), then at
# 2 MiB, where on the wide grid they still led one-shot and push by 17-26%
# (bench/results/2026-11-30_nvidia-h200-x2_w2_flagfree_grid). World 2, the only world whose
# gathers and scatters run them, gets 4 MiB (24 MiB of buffers); larger worlds keep 2 MiB (48 MiB
# at world 8), where only the all-reduce runs them and no table names them past 512 KiB.
FLAGFREE_BYTES_AT_WORLD_2 = 4 << 20
FLAGFREE_BYTES_ELSEWHERE = 2 << 20


def default_flagfree_bytes(world_size: int) -> int:
    """The flag-free receive slot a communicator of ``world_size`` ranks gets (per rank, per buffer)."""
    return FLAGFREE_BYTES_AT_WORLD_2 if world_size == 2 else FLAGFREE_BYTES_ELSEWHERE


# Device-side pointer tables for buffers recorded during graph capture (64 bytes each).
DEFAULT_GRAPH_SLOTS = 4096
# symcomm.h's SYMCOMM_AR_ABORT_* kinds and phases, for the alarm's message.
ABORT_TIMEOUT, ABORT_UNREGISTERED, ABORT_CLOSED, ABORT_MISMATCH = 1, 2, 3, 4
ABORT_PHASES = ("start barrier", "middle barrier (a MoE dispatch: the counts exchange)", "end barrier",
                "wait for its data", "wait for its own blocks (perhaps one could not start: too few SMs free)")


def handle_ints(raw: bytes) -> list[int]:
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def ints_handle(ints: list[int]) -> bytes:
    return b"".join(v.to_bytes(8, "little", signed=True) for v in ints)



class PeerContext:
    """This rank's mapped buffers and kernel context. symcomm/peer/setup.py's open_context builds it."""

    def __init__(self, lib: ctypes.CDLL, ctx: int, rank: int, world_size: int, device: torch.device,
                 staging_bytes: int, flagfree_bytes: int, graph_slots: int,
                 granules: dict[int, int] | None, timeout_s: float = 0.0) -> None:
        self.lib = lib
        self.ctx = ctx
        self.rank = rank
        self.world_size = world_size
        self.device_index = device.index
        self.staging_bytes = staging_bytes
        self.flagfree_bytes = flagfree_bytes
        self.graph_slots = graph_slots
        self.timeout_s = timeout_s
        self.next_slot = 1  # slot 0 is the staging buffer
        self.free_slots: list[int] = []  # slots of destroyed graphs, ready for reuse
        # Capture token -> the slots that graph reads, until CUDA reports the graph destroyed
        # (symcomm_ar_guard_capture); then collect_released frees them.
        self.graph_slots_of: dict[int, list[int]] = {}
        self.stream: int | None = None  # the stream of the latest eager launch (follow)
        self.alarm: Alarm | None = None  # set once the context exists (watch)
        # The pool's granule map, to recognise symmetric inputs. Pool memory is cuMem (from
        # ncclMemAlloc), which has no CUDA IPC handle: such inputs are read through
        # region_slots when their region is mapped, and staged otherwise, never recorded.
        self.granules = granules
        # Symmetric-pool regions mapped from every peer (region base -> slot): inputs there are
        # read in place, with no copy and no registration. See map_regions.
        self.region_slots: dict[int, int] = {}
        # The same regions by the order they were mapped in, equal on every rank (slot numbers
        # are local and may differ): what captured calls are compared by.
        self.region_numbers: dict[int, int] = {}
        self.region_problem: str | None = None
        self.channel: FdChannel | None = None  # passes pool-region descriptors to peers
        self.capture: CaptureSession | None = None
        # Whether captured inputs can be mapped (open_context makes it every rank's answer).
        self.can_register = allocator_has_ipc_handles()

    def check(self, what: str, code: int) -> None:
        if code:
            raise CudaError(what, code, self.lib.symcomm_cuda_error_string(code).decode())

    def watch(self) -> None:
        """Read the kernels' alarm word from here on (see Alarm)."""
        word = _c.POINTER(_c.c_uint64)()
        self.check("symcomm_ar_alarm", self.lib.symcomm_ar_alarm(self.ctx, _c.byref(word)))
        self.alarm = Alarm(word.contents, self.describe_abort)

    def set_overlap(self, enabled: bool) -> None:
        """Launch later kernels as programmatic dependent launches (csrc/launch.cuh), or not. On
        from the start; only measurements of what the overlap gains turn it off."""
        self.check("symcomm_ar_set_overlap", self.lib.symcomm_ar_set_overlap(self.ctx, int(enabled)))

    def set_ep_dedup_from(self, entries: int | None) -> None:
        """From how many valid entries per rank (the world's average) EP dispatch sends a token
        once to each peer rank rather than once per entry; None for the built-in threshold.
        For tests and measurements: every rank of the world must set the same value."""
        if entries is not None and int(entries) < 0:
            raise ValueError(f"entries must be None or >= 0, got {entries}")
        value = -1 if entries is None else int(entries)
        self.check("symcomm_ep_debug_dedup_from", self.lib.symcomm_ep_debug_dedup_from(self.ctx, value))

    def describe_abort(self, code: int) -> str:
        kind, phase, peer = code >> 32, (code >> 16) & 0xFFFF, code & 0xFFFF
        if kind == ABORT_TIMEOUT:
            what = (f"rank {self.rank}'s custom all-reduce waited {self.timeout_s:g} s for rank {peer} at its "
                    f"{ABORT_PHASES[min(phase, len(ABORT_PHASES) - 1)]} and gave up (raise the timeout where a rank may be that late)")
        elif kind == ABORT_UNREGISTERED:
            what = (f"rank {self.rank} replayed a captured custom all-reduce whose buffers were never registered "
                    f"(its slot has no address for rank {peer}): a graph from a graph_capture() that raised")
        elif kind == ABORT_MISMATCH and phase == ABORT_PHASES.index("end barrier"):
            what = (f"rank {self.rank}'s MoE combine found that rank {peer} passed another quant or dtype, or the "
                    f"handle of another dispatch, and summed nothing (SYMCOMM_CHECK=1 names the difference)")
        elif kind == ABORT_MISMATCH:
            what = (f"rank {self.rank}'s MoE dispatch found that rank {peer} passed other sizes (max_tokens, "
                    f"num_experts, top-k, align, hidden, dtype or quant) and moved no row (SYMCOMM_CHECK=1 names "
                    f"them)")
        else:
            what = f"rank {self.rank}'s custom all-reduce stopped (code {code:#x})"
        return (f"{what}. That call's output and every later one's were not written; this communicator is "
                f"broken and every call raises: close() it and build a new one (the CUDA context is intact)")

    def session(self) -> CaptureSession | None:
        """The graph_capture() session the current launch is captured in, or None: eager, or a
        capture outside graph_capture(), which records nothing (one flag test in the eager case)."""
        session = self.capture
        return session if session is not None and capturing() else None

    def output_slot(self, ptr: int, nbytes: int, session: CaptureSession | None, code: int) -> tuple[int, int]:
        """(slot, offset) of an output in a mapped region, which a push kernel writes in every
        rank's copy; recorded, as kernel ``code``, for the ranks' capture comparison."""
        base, slot = self.region_of(ptr)
        if session is not None:
            session.record(IN_REGION, code, nbytes, self.region_numbers[base], ptr - base)
        return slot, ptr - base

    def launch_stream(self, session: CaptureSession | None) -> int:
        """The current stream, once this launch is ordered after the previous one (follow). A
        captured launch also ties its session to the graph (guard): every captured kernel reads
        this context's buffers, so the graph counts as alive at close() whether or not it took
        a slot."""
        stream = raw_stream(self.device_index)
        if stream != self.stream:
            self.follow(stream, session)
        if session is not None and session.token is None:
            self.guard(session)
        return stream

    def launch_inputs(self, session: CaptureSession | None, tensors: Sequence[torch.Tensor],
                      ptrs: Sequence[int] | None = None) -> tuple[int, Sequence[torch.Tensor], Sequence[int]]:
        """launch_stream, then each tensor or its 16-byte-aligned copy (the kernels' vector
        loads need one; alignment is one rank's own business, so it never decides a path: a
        misaligned view is copied, not declined), and their addresses. In this order because a
        copy reads the input, which may be the output of symcomm's previous launch on another
        stream: launch_stream is what orders this stream after that launch. ``ptrs``: the
        tensors' addresses where the call has them, which spares the aligned case any tensor
        work (0.2 us an eager call). Keep the tensors returned alive until the launch is enqueued."""
        stream = self.launch_stream(session)
        ptrs = [t.data_ptr() for t in tensors] if ptrs is None else ptrs
        for ptr in ptrs:
            if ptr & 15:
                kept = [aligned(t) for t in tensors]
                return stream, kept, [t.data_ptr() for t in kept]
        return stream, tensors, ptrs

    def region_of(self, ptr: int) -> tuple[int, int] | None:
        """(region base, slot) of the mapped symmetric region holding ptr, or None."""
        if not self.region_slots:
            return None
        base = self.granules.get(ptr >> GRANULE_SHIFT)
        slot = self.region_slots.get(base) if base is not None else None
        return None if slot is None else (base, slot)

    def follow(self, stream: int, session: CaptureSession | None) -> None:
        """Keep this rank's launches in call order across streams. Each rank's n-th launch meets
        its peers' n-th, and the three kernels share staging, epochs and receive buffers, so a
        launch must not overtake an earlier one from another stream: that pairs the wrong
        inputs and returns a wrong sum with no error. Eager, the new stream waits for the old
        one, once per switch (nothing is added per call on one stream). A capture cannot wait
        for an eager stream, so the calls captured inside graph_capture() must share one stream."""
        if session is not None:
            if session.stream is None:
                session.stream = stream
            elif session.stream != stream:
                raise ArgumentError("a custom all-reduce was captured on a second stream inside one "
                                    "graph_capture(); capture every collective of a graph on one stream "
                                    "(their order across streams would be undefined at replay)")
            return
        if capturing():
            return  # captured outside graph_capture(): its order at replay is the graph's
        if self.stream is not None:
            self.check("ordering custom all-reduces across streams",
                       self.lib.symcomm_ar_order_streams(self.ctx, self.stream, stream))
        self.stream = stream

    def next_free_slot(self) -> int:
        """A device slot for a captured buffer or a pool region, or 0 when none is left. Slots of
        destroyed graphs come back through collect_released, which runs before each capture
        (not here: releasing touches device memory, which a capture in progress forbids)."""
        if self.free_slots:
            return self.free_slots.pop()
        if self.next_slot >= self.graph_slots:
            return 0
        self.next_slot += 1
        return self.next_slot - 1

    def guard(self, session: CaptureSession) -> int:
        """The token that ties this capture's slots to the graph being captured (0 if CUDA
        refused one; the caller then stages instead of taking slots)."""
        if session.token is None:
            token = _c.c_uint64()
            code = self.lib.symcomm_ar_guard_capture(self.ctx, raw_stream(self.device_index), _c.byref(token))
            session.token = 0 if code else token.value
            if session.token:
                self.graph_slots_of[session.token] = []
        return session.token

    def collect_released(self) -> None:
        """Free the slots, and unmap the peer buffers, of graphs CUDA reports destroyed."""
        tokens, count = (_c.c_uint64 * 64)(), _c.c_int()
        while True:
            self.check("symcomm_ar_take_released", self.lib.symcomm_ar_take_released(self.ctx, tokens, 64,
                                                                                      _c.byref(count)))
            for token in tokens[:count.value]:
                for slot in self.graph_slots_of.pop(token, ()):
                    self.check("symcomm_ar_release_slot", self.lib.symcomm_ar_release_slot(self.ctx, slot))
                    self.free_slots.append(slot)
            if count.value < 64:
                return

    def graphs_alive(self) -> int:
        self.collect_released()
        return len(self.graph_slots_of)

    def input_of(self, ptr: int, nbytes: int, code: int, *,
                 peers_read: bool) -> tuple[int, int, int, CaptureSession | None]:
        """How a launch reads its input at ptr: (stage, slot, offset, the capture session or
        None). ``peers_read``: peers load this input from this rank's memory (one-shot,
        two-shot); a kernel that pushes its own input (flag-free) reads it directly, whatever it
        is. A read-by-peers input in a mapped pool region is read in place; inside
        graph_capture() one with an IPC handle gets a slot of its own; any other is staged.
        Inside graph_capture() the call is recorded, as kernel ``code``, for the ranks'
        comparison. A launch that overwrites its input while peers read it is the caller's
        business: the read is the same either way, so ranks that differ only in calling in
        place record the same call."""
        state = self
        session = state.session()
        if peers_read:
            region = state.region_of(ptr)  # None also for a region map_regions could not map
            if region is not None:
                base, slot = region
                if session is not None:
                    session.record(IN_REGION, code, nbytes, state.region_numbers[base], ptr - base)
                return 0, slot, ptr - base, session
        if session is None:
            return 1, 0, 0, None
        slot = self._record(session, ptr) if peers_read else 0
        session.record(session.order[ptr] if slot else STAGED if peers_read else DIRECT, code, nbytes)
        return (0 if slot else 1), slot, 0, session

    def _record(self, session: CaptureSession, ptr: int) -> int:
        """The slot for this captured input, or 0 to stage it instead (still correct, one copy
        slower): symmetric-pool and expandable-segment memory has no IPC handle."""
        state = self
        if not state.can_register:
            return 0
        if state.granules is not None and (ptr >> GRANULE_SHIFT) in state.granules:
            return 0
        slot = session.slots.get(ptr)
        if slot is None:
            token = state.guard(session)
            if not token:
                return 0
            slot = state.next_free_slot()
            if not slot:
                session.out_of_slots = True
                return 0
            state.graph_slots_of[token].append(slot)
            session.order[ptr] = len(session.slots)
            session.slots[ptr] = slot
        return slot

    def destroy(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if not self.ctx:
            return
        alive = self.graphs_alive()
        ctx, self.ctx, self.alarm = self.ctx, 0, None
        if alive:
            # Their replays would read this memory: keep it, marked closed, so they return at once.
            warnings.warn(f"Communicator closed while {alive} CUDA graph(s) captured in graph_capture() still "
                          f"exist: symcomm keeps its kernels' buffers until the process exits, and replays of "
                          f"those graphs return without writing their outputs. Destroy graphs before close().",
                          ResourceWarning, stacklevel=2)
            self.check("symcomm_ar_retire", self.lib.symcomm_ar_retire(ctx))
        else:
            self.check("symcomm_ar_destroy", self.lib.symcomm_ar_destroy(ctx))


def allocator_has_ipc_handles() -> bool:
    """Only cudaMalloc'd memory has CUDA IPC handles: torch's expandable segments (cuMem) and its
    cudaMallocAsync backend do not, so captured inputs there are staged instead."""
    conf = settings.torch_allocator_conf()
    return "expandable_segments:true" not in conf and "backend:cudamallocasync" not in conf


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a 16-byte-aligned copy of it. Paths copy through PeerContext.launch_inputs, which
    orders the copy after symcomm's previous launch."""
    return t if t.data_ptr() % 16 == 0 or not t.numel() else t.clone()
