"""What a CUDA-graph capture inside Communicator.graph_capture() recorded on a peer context:
each captured call's kernel and how it reads its input, and the buffers that need a device slot
of their own. symcomm/peer/setup.py's register_captured compares it across ranks and fills the slots."""
from __future__ import annotations

from ..base import FLAGFREE, ONESHOT, PUSH, TWOSHOT, TWOSHOT_PUSH

STAGED, IN_REGION, DIRECT = -1, -2, -3  # CaptureSession.calls codes for unrecorded inputs
# The kernel field of a captured call (CALL_FIELDS): one code per kernel a context launches, so
# that ranks which captured different kernels for the same bytes disagree there. The all-reduce
# kernels' codes are their ALGO_CODES.
CAPTURE_CODES = {FLAGFREE: 0, ONESHOT: 1, TWOSHOT: 2, PUSH: 3, "fused-push": 4, "custom-oneshot:reduce_scatter": 8,
                 "ep-dispatch": 9, "ep-combine": 10, "custom-flagfree:all_gather": 11,
                 "custom-flagfree:reduce_scatter": 12, "custom-flagfree:all_gatherv": 13,
                 "custom-flagfree:reduce_scatterv": 14, "fused-flagfree": 15, TWOSHOT_PUSH: 16}
SCATTER_CODE = CAPTURE_CODES["custom-oneshot:reduce_scatter"]


class CaptureSession:
    """Input buffers recorded while capturing inside Communicator.graph_capture(), in call order.

    Each gets a device-side slot now; the slot's peer pointers are written after capture, when
    every rank has exchanged its handles (register_captured). The order of recording is the
    order of the calls, which every rank makes alike, so the i-th buffers of all ranks belong
    together.
    """

    def __init__(self) -> None:
        self.stream: int | None = None  # the one stream its calls are captured on (follow)
        self.token: int | None = None  # the graph's guard (PeerContext.guard), once a slot is taken
        self.slots: dict[int, int] = {}  # data pointer -> slot
        self.order: dict[int, int] = {}  # data pointer -> its index among the recorded buffers
        # Per captured call, what peers will rely on at replay (CALL_FIELDS): the index of its
        # recorded buffer or how it reads its input instead, the kernel, the byte count, and for
        # a pool input its region's slot and offset. Ranks compare all of it, not just counts:
        # rank 0 capturing buffers A, A, B and rank 1 C, D, D record two each, yet pair A with D
        # at call 2; a pool tensor at a rank-dependent offset would be read at the wrong place.
        self.calls: list[tuple[int, int, int, int, int]] = []
        self.out_of_slots = False

    def record(self, how: int, algo: int, nbytes: int, region_slot: int = -1, offset: int = -1) -> None:
        self.calls.append((how, algo, nbytes, region_slot, offset))


CALL_FIELDS = ("input buffer", "kernel", "message size in bytes", "symmetric pool region", "offset in that region")


