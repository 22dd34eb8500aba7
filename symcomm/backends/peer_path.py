"""PeerPath: the life every path on the peer runtime shares (symcomm/peer/).

symcomm's all-reduce kernels, the push gather and the fused FP4 path all launch
through one PeerContext per communicator. The first of them to open builds it by vote (or
records why it is off, the same on every rank); each hears of new pool regions, takes part in
graph capture and closes through it; the last to close tears it down. A subclass says which
calls it serves (why_not) and launches them (run).
"""
from __future__ import annotations

import warnings

import torch

from ..base import Call, Path, Setup
from ..peer.capture import CaptureSession
from ..peer.context import PeerContext
from ..peer.setup import SHARED_KEY, SharedContext, register_captured
from ..pool import Region


class PeerPath(Path):
    """A path on the communicator's shared PeerContext."""

    needs_equal_offsets = True  # peers read (or write) pool tensors at this rank's offset

    def __init__(self, name: str, shared: SharedContext | None = None) -> None:
        """``shared`` attaches an already-built context (tests); open() builds or finds it."""
        self.name = name
        # Kept after close(): a timed-out teardown's abort() must still reach the shared context
        # that the last close() may be tearing down. _context is what calls use, None once closed.
        self._shared: SharedContext | None = None
        self._context: PeerContext | None = None
        if shared is not None:
            self._attach(shared)

    def open(self, setup: Setup) -> str | None:
        shared = setup.shared.get(SHARED_KEY)
        if shared is None:
            shared = setup.shared[SHARED_KEY] = SharedContext.open(setup)
        if shared.context is None:
            return f"symcomm's peer-memory kernels are off: {shared.reason}"
        self._attach(shared)
        return None

    @property
    def context(self) -> PeerContext:
        """The shared context this path launches on (None once closed)."""
        return self._context

    def _attach(self, shared: SharedContext) -> None:
        shared.users += 1
        self._shared, self._context = shared, shared.context
        self.alarm = shared.context.alarm
        self.attached(shared.context)

    def attached(self, context: PeerContext) -> None:
        """Hook: the path now launches on ``context``."""

    def add_region(self, region: Region) -> None:
        self._shared.add_region(region)

    def begin_capture(self) -> None:
        context = self._context
        if context.capture is None:  # the first path on the context starts the session
            context.collect_released()
            context.capture = CaptureSession()

    def discard_capture(self) -> None:
        self._context.capture = None

    def end_capture(self, failed: bool) -> str | None:
        context = self._context
        session, context.capture = context.capture, None
        if session is None:  # a sibling already registered this session
            return None
        exchange = self._shared.exchange
        problem = register_captured(context, session, failed, lambda values: exchange(values, kind="graph_capture"))
        if session.out_of_slots:
            warnings.warn(f"graph_capture(): all {context.graph_slots - 1} buffer slots are in use; later "
                          f"captured custom all-reduces copy their input to the staging buffer instead",
                          ResourceWarning, stacklevel=4)
        return problem

    def info(self) -> dict:
        context = self._context
        if context is None:
            return {}
        return {"custom_all_reduce": {
            "staging_bytes": context.staging_bytes,
            "flagfree_bytes": context.flagfree_bytes,
            "graph_slots_used": context.next_slot - 1 - len(context.free_slots),
            "graphs_alive": len(context.graph_slots_of),
            # pool regions whose inputs the kernels read in place (else: staged, and why)
            "symmetric_regions_mapped": len(context.region_slots),
            "symmetric_regions_problem": context.region_problem,
        }, "device_bytes": {"peer kernels' buffers (staging, scratch, flag-free, slots)": self._shared.device_bytes}}

    def close(self) -> None:
        if self._context is not None:
            self._context = None
            self._shared.release()

    def abort(self) -> None:
        # After a timed-out close the peers may still read these buffers: leave them mapped
        # rather than free memory under a peer's kernel.
        if self._shared is not None:
            self._shared.abandoned = True
        self._context = None


def offset_unit(call: Call, tensor: torch.Tensor, world: int) -> int:
    """Bytes that every rank's offset and length in ``tensor`` (the whole gathered output, or
    the whole input of a reduce-scatter) are whole multiples of: one rank's chunk when every
    rank has the same size, else one row. The peer kernels move 16-byte vectors, so this is
    what must be a multiple of 16; with equal sizes the rows themselves need not be (a 1-D
    tensor's rows are single elements)."""
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        return 0
    return tensor.nbytes // world if call.even else tensor.nbytes // tensor.shape[0]
