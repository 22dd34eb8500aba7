"""symcomm's own all-reduce kernels (csrc/custom_ar.cu) over peer-mapped memory: three paths,
``custom-flagfree``, ``custom-oneshot`` and ``custom-twoshot``.

One ``CustomAllReduce`` per communicator owns the mapped buffers; the three ``CustomPath``
objects share it (the first to open builds it, the last to close tears it down), so dispatch
treats each kernel as a path of its own. Setup is collective and decided by vote at each step,
so a rank that cannot take part makes every rank fall back to NCCL instead of leaving the
others waiting. docs/architecture.md has the rules; csrc/custom_ar.cu explains the kernels and
their memory ordering.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import socket
import struct
import warnings
from collections.abc import Callable, Sequence

import torch

from .. import _native, settings
from ..base import (FLAGFREE, NCCL, NCCL_SYMM, ONESHOT, SCATTERING_OPS as SCATTERS, TWOSHOT, Alarm, Call,
                    Path, Setup, raw_stream)
from ..errors import ArgumentError, CudaError
from ..fd_channel import IDENTITY_INTS, FdChannel, Identity
from ..peers import Exchange
from ..pool import GRANULE_SHIFT, Region

_c = ctypes
ALGO_CODES = {FLAGFREE: 0, ONESHOT: 1, TWOSHOT: 2}
DTYPE_CODES = _native.DTYPE_CODES
SUPPORTED_WORLD_SIZES = (2, 4, 6, 8)
HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
# Staging (and the two-shot scratch, as large) bounds one-shot/two-shot: 16 MiB covers the
# range where the kernels can beat NCCL (docs/measuring.md: NCCL reaches its bandwidth from
# about 16 MiB).
DEFAULT_STAGING_BYTES = 16 << 20
# Per rank and per receive buffer (three of them) for the flag-free kernel, which only wins
# for small messages where latency, not bandwidth, decides.
DEFAULT_FLAGFREE_BYTES = 512 << 10
# Device-side pointer tables for buffers recorded during graph capture (64 bytes each).
DEFAULT_GRAPH_SLOTS = 4096
# symcomm.h's SYMCOMM_AR_ABORT_* kinds and phases, for the alarm's message.
ABORT_TIMEOUT, ABORT_UNREGISTERED, ABORT_CLOSED = 1, 2, 3
ABORT_PHASES = ("start barrier", "middle barrier", "end barrier", "wait for its data")

def load_library() -> ctypes.CDLL:
    """The native library with the custom all-reduce entry points bound (OSError if absent)."""
    return _native.load().lib


def host_identity() -> int:
    """A number equal on ranks that share a host: hostname and boot id, hashed stably (Python's
    hash() differs per process)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    digest = hashlib.blake2b(f"{socket.gethostname()}/{boot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def probe_token(rank: int) -> int:
    """What rank ``rank`` writes into every peer during the P2P test: distinct per rank and
    never the zero the probe words start at. A function so tests can make one rank lie."""
    return 0xA5C30000 | (rank + 1)


def world_size_problem(world_size: int) -> str | None:
    if world_size not in SUPPORTED_WORLD_SIZES:
        return (f"world size {world_size} is unsupported (the kernels serve "
                f"{', '.join(map(str, SUPPORTED_WORLD_SIZES))} ranks)")
    return None


def _to_ints(raw: bytes) -> list[int]:
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def _to_bytes(ints: list[int]) -> bytes:
    return b"".join(v.to_bytes(8, "little", signed=True) for v in ints)


class CustomAllReduce:
    """This rank's mapped buffers and kernel context. Build it with :func:`setup`."""

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
        # Only cudaMalloc'd memory has CUDA IPC handles: torch's expandable segments (cuMem) and
        # its cudaMallocAsync backend do not, so captured inputs there are staged instead.
        conf = settings.torch_allocator_conf()
        self.can_register = "expandable_segments:true" not in conf and "backend:cudamallocasync" not in conf

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

    def describe_abort(self, code: int) -> str:
        kind, phase, peer = code >> 32, (code >> 16) & 0xFFFF, code & 0xFFFF
        if kind == ABORT_TIMEOUT:
            what = (f"rank {self.rank}'s custom all-reduce waited {self.timeout_s:g} s for rank {peer} at its "
                    f"{ABORT_PHASES[min(phase, 3)]} and gave up (raise the timeout where a rank may be that late)")
        elif kind == ABORT_UNREGISTERED:
            what = (f"rank {self.rank} replayed a captured custom all-reduce whose buffers were never registered "
                    f"(its slot has no address for rank {peer}): a graph from a graph_capture() that raised")
        else:
            what = f"rank {self.rank}'s custom all-reduce stopped (code {code:#x})"
        return (f"{what}. That call's output and every later one's were not written; this communicator is "
                f"broken and every call raises: close() it and build a new one (the CUDA context is intact)")

    def run(self, algo: int, call: Call, stage: int, slot: int, offset: int = 0,
            session: CaptureSession | None = None) -> None:
        x = call.inputs[0]
        code = self.lib.symcomm_ar_run(self.ctx, algo, DTYPE_CODES[x.dtype], call.in_ptrs[0], slot, offset,
                                       call.out_ptrs[0], call.nbytes, stage, self.launch_stream(session))
        if code:
            self.check("custom all-reduce launch", code)

    def session(self) -> CaptureSession | None:
        """The graph_capture() session the current launch is captured in, or None: eager, or a
        capture outside graph_capture(), which records nothing (one flag test in the eager case)."""
        session = self.capture
        return session if session is not None and torch.cuda.is_current_stream_capturing() else None

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
        if torch.cuda.is_current_stream_capturing():
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


STAGED, IN_REGION, DIRECT = -1, -2, -3  # CaptureSession.calls codes for unrecorded inputs


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a 16-byte-aligned copy of it for the kernels' vector loads. Alignment is one rank's
    own business, so it must never decide a path (ranks would wait in different ones): the
    kernels' callers copy a misaligned input instead of declining it."""
    return t if t.data_ptr() % 16 == 0 or not t.numel() else t.clone()
# The kernel field of a captured call (CALL_FIELDS): one code per kernel a context launches, so
# that ranks which captured different kernels for the same bytes disagree there. The all-reduce
# kernels' codes are their ALGO_CODES.
CAPTURE_CODES = {FLAGFREE: 0, ONESHOT: 1, TWOSHOT: 2, "custom-push": 3, "fused-push": 4, "fused-flagfree": 5,
                 "fused-oneshot": 6, "fused-twoshot": 7, "custom-oneshot:reduce_scatter": 8}
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
        self.token: int | None = None  # the graph's guard (CustomAllReduce.guard), once a slot is taken
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


def setup_kernels(rank: int, world_size: int, device: torch.device, exchange: Exchange, timeout_s: float,
          granules: dict[int, int] | None, staging_bytes: int = DEFAULT_STAGING_BYTES,
          flagfree_bytes: int = DEFAULT_FLAGFREE_BYTES,
          graph_slots: int = DEFAULT_GRAPH_SLOTS,
          regions: Sequence[tuple[int, int]] = (),
          off: str | None = None) -> tuple[CustomAllReduce | None, str | None]:
    """Collective: map every rank's buffers and test P2P on every pair. Returns the context, or
    None and the reason the kernels are off (the same decision on every rank). ``off`` is a
    local reason to stay off, which still takes part in the vote so no peer waits for this rank."""
    reason, lib = off, None
    if reason is None and settings.custom_kernels_disabled():
        reason = "disabled by SYMCOMM_DISABLE_CUSTOM_AR=1"
    if reason is None:
        reason = world_size_problem(world_size)
    if reason is None:
        try:
            lib = load_library()
        except (OSError, AttributeError) as exc:
            reason = f"native library unavailable: {exc}"
    # Peers' staging, scratch, flag-free and slot addresses are computed from these sizes, so
    # ranks that disagree would write outside each other's buffers: they are part of the vote.
    sizes = [staging_bytes, flagfree_bytes, graph_slots]
    votes = exchange([0 if reason is None else 1, host_identity(), *sizes])
    if reason is not None:
        return None, reason
    if any(row[0] for row in votes):
        return None, "unavailable on another rank: " + ", ".join(str(r) for r, row in enumerate(votes) if row[0])
    if len({row[1] for row in votes}) > 1:
        return None, "the ranks span hosts (CUDA IPC needs one host)"
    if any(row[2:] != sizes for row in votes):
        per_rank = ", ".join(f"rank {r}: {row[2:]}" for r, row in enumerate(votes))
        return None, (f"ranks disagree on the buffer sizes [staging, flag-free, graph slots] ({per_rank}); "
                      f"pass the same custom_ar_capacity on every rank")

    ctx = _c.c_void_p()
    code = lib.symcomm_ar_create(rank, world_size, device.index, staging_bytes, flagfree_bytes, graph_slots,
                                 timeout_s, _c.byref(ctx))
    handle = _c.create_string_buffer(HANDLE_BYTES)
    if code == 0:
        code = lib.symcomm_ar_handle(ctx, handle)
    rows = exchange([code, *_to_ints(handle.raw)])
    state = CustomAllReduce(lib, ctx.value or 0, rank, world_size, device, staging_bytes, flagfree_bytes,
                            graph_slots, granules, timeout_s)
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        _quiet_destroy(state)
        return None, f"could not allocate the buffers on rank(s) {failed}" + _cuda_reason(lib, code)
    handles = b"".join(_to_bytes(row[1:]) for row in rows)
    code = lib.symcomm_ar_open(state.ctx, handles)
    failed = [r for r, (c,) in enumerate(exchange([code])) if c]
    if failed:
        _quiet_destroy(state)
        return None, f"CUDA IPC mapping failed on rank(s) {failed}" + _cuda_reason(lib, code)
    problem = _probe(state, exchange)
    if problem is not None:
        _quiet_destroy(state)
        return None, problem
    state.watch()
    _open_channel(state, timeout_s, exchange)
    map_regions(state, regions, exchange)
    return state, None


def _open_channel(state: CustomAllReduce, timeout_s: float, exchange: Exchange) -> None:
    """Collective: bind this rank's descriptor socket, then announce who it is. The socket is
    bound before the announcement, so every peer listens before anyone sends. A rank without
    one announces zeros, and pool inputs are then staged everywhere (region_problem)."""
    try:
        state.channel = FdChannel(timeout_s)
        mine = state.channel.identity.to_ints()
    except OSError as exc:
        state.region_problem = f"no Unix socket to pass memory handles ({exc})"
        mine = [0] * IDENTITY_INTS
    rows = exchange([0 if state.channel is None else 1, *mine])
    if not all(row[0] for row in rows):
        state.region_problem = state.region_problem or "a peer has no Unix socket to pass memory handles"
        return
    state.channel.meet({r: Identity.from_ints(row[1:]) for r, row in enumerate(rows) if r != state.rank})


def map_regions(state: CustomAllReduce, regions: Sequence[tuple[int, int]], exchange: Exchange) -> None:
    """Collective: map every peer's copy of each symmetric-pool region (base, nbytes), so the
    kernels read inputs there in place.

    Pool regions are cuMem allocations (ncclMemAlloc), which CUDA IPC handles do not cover and
    NCCL 2.28 has no host call to translate. Each rank exports a region as a POSIX file
    descriptor and passes it over a Unix datagram socket (SCM_RIGHTS) to each peer, which maps
    it. On any failure every rank keeps staging those inputs instead (region_problem says why).
    """
    if not regions or state.region_problem is not None:
        exchange([1])  # peers in the same call learn that this rank opts out
        return
    lib, world = state.lib, state.world_size
    fds: list[int] = []
    code = 0
    for base, _ in regions:
        fd = _c.c_int(-1)
        code = code or lib.symcomm_ar_export_region(state.ctx, base, _c.byref(fd))
        if code == 0:
            fds.append(fd.value)
    problem = None
    try:
        if not _all_ok(exchange([code])):
            problem = "exporting pool regions as file descriptors failed on some rank"
            return
        # Between exchanges every local failure, exception included, becomes a vote: a rank that
        # raised here alone would leave its peers waiting in the next exchange.
        mapped: dict[int, list[int]] = {}
        try:
            failure = _pass_regions(state, regions, fds, mapped)
        except Exception:  # noqa: BLE001 - reported to every rank as a failed vote
            failure = 1
        if not _all_ok(exchange([failure])):
            problem = "passing or mapping pool regions between ranks failed on some rank"
            return
        slots = []
        try:
            for i, _ in enumerate(regions):
                slot = state.next_free_slot()
                ptrs = (_c.c_uint64 * world)(*(mapped[r][i] for r in range(world)))
                if not slot or lib.symcomm_ar_set_slot_ptrs(state.ctx, slot, ptrs):
                    failure = 1
                slots.append(slot)
        except Exception:  # noqa: BLE001 - as above
            failure = 1
        if not _all_ok(exchange([failure])):
            problem = "no device slot left for pool regions on some rank"
            return
        state.region_slots.update({base: slot for (base, _), slot in zip(regions, slots)})
        for base, _ in regions:
            state.region_numbers[base] = len(state.region_numbers)
    finally:
        for fd in fds:
            os.close(fd)
        if problem is not None:
            state.region_problem = problem


def _pass_regions(state: CustomAllReduce, regions: Sequence[tuple[int, int]], fds: list[int],
                  mapped: dict[int, list[int]]) -> int:
    """Send this rank's region fds to every peer, receive and map theirs into ``mapped``
    (rank -> region pointers). Returns 1 on any failure. The channel takes only messages whose
    sender address and credentials are those the claimed rank announced (fd_channel.py), and
    its receive is bounded by the communicator's timeout."""
    lib, rank, world, channel = state.lib, state.rank, state.world_size, state.channel
    payload = struct.pack("<q", len(fds))
    for peer in range(world):
        if peer != rank:
            channel.send(rank, peer, payload, fds)
    mapped[rank] = [base for base, _ in regions]
    failure = 0
    for sender, (msg, received) in channel.receive(max_fds=len(regions)).items():
        try:
            if struct.unpack("<q", msg[:8])[0] != len(regions) or len(received) != len(regions):
                failure = 1
                continue
            ptrs = []
            for fd, (_, nbytes) in zip(received, regions):
                out = _c.c_void_p()
                if failure or lib.symcomm_ar_import_region(state.ctx, fd, nbytes, _c.byref(out)):
                    failure = 1
                ptrs.append(out.value or 0)
            mapped[sender] = ptrs
        finally:
            for fd in received:
                os.close(fd)
    return failure


def _all_ok(rows: list[list[int]]) -> bool:
    return not any(row[0] for row in rows)


def _cuda_reason(lib: ctypes.CDLL, code: int) -> str:
    return f" (here: {lib.symcomm_cuda_error_string(code).decode()})" if code else ""


def _quiet_destroy(state: CustomAllReduce) -> None:
    try:
        state.destroy()
    except CudaError:
        pass  # setup already failed; its reason is the one worth reporting


def _probe(state: CustomAllReduce, exchange: Exchange) -> str | None:
    """Every rank stores a token into every peer and loads every peer's own copy; both
    directions of every pair must carry the right bits. The driver's peer-access report is
    not proof, a round trip of real loads and stores is."""
    lib, world = state.lib, state.world_size
    code = lib.symcomm_ar_probe_write(state.ctx, probe_token(state.rank))
    exchange([code])  # everyone has written (or failed to) before anyone reads
    got = (_c.c_uint32 * 16)()
    if code == 0:
        code = lib.symcomm_ar_probe_read(state.ctx, got)
    # bit p: peer p's store arrived here; bit 8+p: our load of peer p's copy saw its token
    ok = 0
    if code == 0:
        for p in range(world):
            ok |= (got[p] == probe_token(p)) << p
            ok |= (got[8 + p] == probe_token(p)) << (8 + p)
    rows = exchange([code, ok])
    bad = []
    for r, (c, bits) in enumerate(rows):
        for p in range(world):
            if c or not (bits >> p) & 1 or not (bits >> (8 + p)) & 1:
                bad.append((p, r))
    if bad:
        pairs = ", ".join(f"{p}->{r}" for p, r in sorted(set(bad)))
        return f"P2P test failed (stores or loads between ranks did not arrive intact: {pairs})"
    return None


def register_captured(state: CustomAllReduce, session: CaptureSession, failed: bool, exchange: Exchange) -> str | None:
    """Collective, after capture: exchange the recorded buffers' IPC handles and fill their
    slots. Returns a problem (the same on every rank) or None."""
    recorded = list(session.slots.items())
    counts = exchange([1 if failed else 0, len(recorded), len(session.calls)])
    if any(row[0] for row in counts):
        return "graph capture failed on rank(s) " + ", ".join(str(r) for r, row in enumerate(counts) if row[0])
    if len({tuple(row[1:]) for row in counts}) > 1:
        return ("ranks captured different numbers of custom all-reduce buffers or calls ("
                + ", ".join(f"rank {r}: {n} buffers in {c} calls" for r, (_, n, c) in enumerate(counts))
                + "); every rank must capture the same calls in the same order")
    if session.calls:
        width = len(CALL_FIELDS)
        patterns = exchange([v for call in session.calls for v in call])  # equal lengths: checked above
        if any(row != patterns[0] for row in patterns):
            at = next(i for i in range(len(patterns[0])) if len({row[i] for row in patterns}) > 1)
            call, field = divmod(at, width)
            per_rank = ", ".join(f"rank {r}: {row[at]}" for r, row in enumerate(patterns))
            return (f"ranks captured different custom all-reduces at captured call {call}: the "
                    f"{CALL_FIELDS[field]} differs ({per_rank}); every rank must capture the same calls on "
                    f"the same buffers, and pool tensors at the same offsets")
    lib = state.lib
    mine: list[int] = []
    code = 0
    for ptr, _ in recorded:
        handle = _c.create_string_buffer(HANDLE_BYTES)
        offset = _c.c_uint64()
        if code == 0:
            code = lib.symcomm_ar_buffer_handle(state.ctx, ptr, handle, _c.byref(offset))
        mine += [*_to_ints(handle.raw), offset.value]
    rows = exchange([code, *mine])
    failed_ranks = [r for r, row in enumerate(rows) if row[0]]
    if failed_ranks:
        return (f"captured buffers could not be exported for CUDA IPC on rank(s) {failed_ranks}"
                + _cuda_reason(lib, code))
    per = HANDLE_BYTES // 8 + 1
    for i, (ptr, slot) in enumerate(recorded):
        handles = b"".join(_to_bytes(row[1 + i * per:1 + i * per + per - 1]) for row in rows)
        offsets = (_c.c_uint64 * state.world_size)(*(row[i * per + per] for row in rows))
        code = lib.symcomm_ar_set_slot(state.ctx, slot, handles, offsets, ptr)
        if code:
            break
    failed_ranks = [r for r, (c,) in enumerate(exchange([code])) if c]
    if failed_ranks:
        for _, slot in recorded:  # empty on every rank: a replay is then refused, never misdirected
            lib.symcomm_ar_release_slot(state.ctx, slot)
        return f"mapping peers' captured buffers failed on rank(s) {failed_ranks}" + _cuda_reason(lib, code)
    return None


class CustomPath(Path):
    """One of the three kernels as a path. The three share one CustomAllReduce through the
    setup's ``shared`` entry: the first to open builds it (or records why it is off), the last to
    close tears it down."""

    needs_equal_offsets = True  # pool inputs are read in place at this rank's offset

    def __init__(self, name: str, kernels: Kernels | None = None) -> None:
        """``kernels`` attaches already-built state (tests); open() builds or finds it."""
        self.name = name
        self._algo = ALGO_CODES.get(name)  # None: not one of the all-reduce kernels (custom-push)
        # Kept after close(): a timed-out teardown's abort() must still reach the shared state
        # that the last close() may be tearing down. _state is what calls use, None once closed.
        self._kernels: Kernels | None = None
        self._state: CustomAllReduce | None = None
        self.capacity = 0
        if kernels is not None:
            self._attach(kernels)

    def open(self, setup: Setup) -> str | None:
        kernels = setup.shared.get(_SHARED_KEY)
        if kernels is None:
            kernels = setup.shared[_SHARED_KEY] = Kernels.open(setup)
        if kernels.state is None:
            return f"custom all-reduce: {kernels.reason}"
        self._attach(kernels)
        return None

    @property
    def state(self) -> CustomAllReduce:
        """The kernels' shared state (for the fused paths that launch on it)."""
        return self._state

    def _attach(self, kernels: Kernels) -> None:
        kernels.users += 1
        self._kernels, self._state = kernels, kernels.state
        self.alarm = kernels.state.alarm
        self.capacity = kernels.state.flagfree_bytes if self.name == FLAGFREE else kernels.state.staging_bytes

    def add_region(self, region: Region) -> None:
        self._kernels.add_region(region)

    def begin_capture(self) -> None:
        state = self._state
        if state.capture is None:  # the first of the three starts the session
            state.collect_released()
            state.capture = CaptureSession()

    def discard_capture(self) -> None:
        self._state.capture = None

    def end_capture(self, failed: bool) -> str | None:
        state = self._state
        session, state.capture = state.capture, None
        if session is None:  # a sibling already registered this session
            return None
        exchange = self._kernels.exchange
        problem = register_captured(state, session, failed, lambda values: exchange(values, kind="graph_capture"))
        if session.out_of_slots:
            warnings.warn(f"graph_capture(): all {state.graph_slots - 1} buffer slots are in use; later "
                          f"captured custom all-reduces copy their input to the staging buffer instead",
                          ResourceWarning, stacklevel=4)
        return problem

    def info(self) -> dict:
        state = self._state
        if state is None:
            return {}
        return {"custom_all_reduce": {
            "staging_bytes": state.staging_bytes,
            "flagfree_bytes": state.flagfree_bytes,
            "graph_slots_used": state.next_slot - 1 - len(state.free_slots),
            "graphs_alive": len(state.graph_slots_of),
            # pool regions whose inputs the kernels read in place (else: staged, and why)
            "symmetric_regions_mapped": len(state.region_slots),
            "symmetric_regions_problem": state.region_problem,
        }}

    def close(self) -> None:
        if self._state is not None:
            self._state = None
            self._kernels.release()

    def abort(self) -> None:
        # After a timed-out close the peers may still read these buffers: leave them mapped
        # rather than free memory under a peer's kernel.
        if self._kernels is not None:
            self._kernels.abandoned = True
        self._state = None

    def why_not(self, call: Call) -> str | None:
        if call.op in SCATTERS and self.name == ONESHOT:
            return self._why_not_scatter(call)
        if call.op != "all_reduce":
            return ("custom-oneshot serves reduce_scatter(v) and all_reduce only" if self.name == ONESHOT
                    else "custom kernels serve all_reduce only")
        if call.redop != "sum":
            return f"custom kernels only sum (op={call.redop!r})"
        if call.dtype not in DTYPE_CODES:
            return f"dtype {call.dtype} is unsupported (float32, float16, bfloat16)"
        nbytes = call.nbytes
        if nbytes % 16:
            return f"{nbytes} bytes is not a multiple of 16 (the kernels move 16-byte vectors)"
        if nbytes > self.capacity:
            return f"{nbytes} bytes exceeds {self.name}'s capacity of {self.capacity} bytes"
        if (call.in_ptrs[0] | call.out_ptrs[0]) & 15:
            return "input or output is not 16-byte aligned"
        return None
    def _why_not_scatter(self, call: Call) -> str | None:
        if call.redop != "sum":
            return f"custom kernels only sum (op={call.redop!r})"
        if call.dtype not in DTYPE_CODES:
            return f"dtype {call.dtype} is unsupported (float32, float16, bfloat16)"
        x = call.inputs[0]
        row_bytes = x.nbytes // x.shape[0] if x.shape[0] else 0
        if row_bytes % 16:
            return f"a row of {row_bytes} bytes is not whole 16-byte vectors"
        if (call.in_ptrs[0] | call.out_ptrs[0]) & 15:
            return "input or output is not 16-byte aligned"
        if call.nbytes > self.capacity and self._state.region_of(call.in_ptrs[0]) is None:
            return (f"{call.nbytes} bytes exceeds the staging capacity of {self.capacity} bytes "
                    f"(an input in the symmetric pool is read in place, with no limit)")
        return None

    def _run_scatter(self, call: Call) -> None:
        """Uneven reduce-scatter as one-shot over this rank's rows: peers' inputs hold them at
        the same offset. A pool input is read in place, any other is staged whole; in place is
        safe here (this rank writes only its own rows, which no peer reads)."""
        state = self._state
        session = state.session()
        x = call.inputs[0]
        sizes = call.sizes or [x.shape[0] // state.world_size] * state.world_size
        row_bytes = call.nbytes // sum(sizes)
        region = state.region_of(call.in_ptrs[0])
        slot, offset = (region[1], call.in_ptrs[0] - region[0]) if region else (0, 0)
        if session is not None:
            if region:
                session.record(IN_REGION, SCATTER_CODE, call.nbytes, state.region_numbers[region[0]], offset)
            else:
                session.record(STAGED, SCATTER_CODE, call.nbytes)
        code = state.lib.symcomm_ar_reduce_scatterv(
            state.ctx, DTYPE_CODES[call.dtype], call.in_ptrs[0], slot, offset, call.nbytes,
            sum(sizes[:state.rank]) * row_bytes, call.out_ptrs[0], sizes[state.rank] * row_bytes,
            0 if region else 1, state.launch_stream(session))
        if code:
            state.check("custom reduce_scatterv launch", code)

    def run(self, call: Call) -> None:
        if call.op in SCATTERS:
            self._run_scatter(call)
            return
        ptr = call.in_ptrs[0]
        # In place, one-shot writes what peers may still be reading: that input is staged.
        overwritten = self._algo == ALGO_CODES[ONESHOT] and ptr == call.out_ptrs[0]
        self._state.run(self._algo, call, *self.input_of(ptr, call.nbytes, overwritten, self._algo))

    def input_of(self, ptr: int, nbytes: int, overwritten: bool,
                 code: int) -> tuple[int, int, int, CaptureSession | None]:
        """How this kernel's launch reads the input at ptr: (stage, slot, offset, the capture
        session or None). A pool input in a mapped region is read in place; inside
        graph_capture() an input with an IPC handle gets a slot of its own; any other is staged
        (flag-free reads its input directly, whatever it is). Inside graph_capture() the call is
        recorded, as kernel ``code``, for the ranks' comparison. ``overwritten``: the launch
        writes its input while peers still read it, so it must be staged."""
        state = self._state
        session = state.session()
        if self._algo and not overwritten:
            region = state.region_of(ptr)  # None also for a region map_regions could not map
            if region is not None:
                base, slot = region
                if session is not None:
                    session.record(IN_REGION, code, nbytes, state.region_numbers[base], ptr - base)
                return 0, slot, ptr - base, session
        if session is None:
            return 1, 0, 0, None
        slot = self._record(session, ptr, overwritten) if self._algo else 0
        session.record(session.order[ptr] if slot else STAGED if self._algo else DIRECT, code, nbytes)
        return (0 if slot else 1), slot, 0, session

    def _record(self, session: CaptureSession, ptr: int, overwritten: bool) -> int:
        """The slot for this captured input, or 0 to stage it instead (still correct, one copy
        slower): symmetric-pool and expandable-segment memory has no IPC handle, and an input
        the launch overwrites while peers read it must be staged."""
        state = self._state
        if not state.can_register or overwritten:
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


_SHARED_KEY = "custom-ar"


class Kernels:
    """The kernels' state, shared by the three paths of one communicator."""

    def __init__(self, state: CustomAllReduce | None, reason: str | None = None, exchange: Exchange | None = None,
                 barrier: Callable[[], None] | None = None) -> None:
        self.state = state
        self.reason = reason
        self.exchange = exchange
        self._barrier = barrier
        self.users = 0
        self.abandoned = False  # set by abort(): a timed-out teardown must unmap nothing
        self._regions_seen: set[int] = set()

    @classmethod
    def open(cls, setup: Setup) -> "Kernels":
        """Collective (decided alike on every rank): build the kernels' state, or say why not."""
        peers, capacity = setup.peers, setup.options["custom_ar_capacity"]
        plain = setup.opened.get(NCCL)
        if plain is None:
            # NCCL is the kernels' fallback and their teardown barrier; its own open voted.
            return cls(None, f"needs NCCL, which is off ({setup.off.get(NCCL, 'not opened')})", peers.exchange)
        symm = setup.opened.get(NCCL_SYMM)
        pool = getattr(symm, "pool", None)
        regions = [] if pool is None else [(r.base, r.nbytes) for r in sorted(pool.regions.values(),
                                                                                key=lambda r: r.number)]
        state, reason = setup_kernels(peers.rank, peers.world_size, setup.device, peers.exchange, setup.timeout_s,
                                      None if pool is None else pool.index.granules, staging_bytes=capacity,
                                      regions=regions,
                                      # a rank's own choice: voted, since its peers may differ
                                      off="turned off (custom_ar_capacity=0)" if capacity == 0 else None)
        shared = cls(state, reason, peers.exchange, plain.barrier)
        shared._regions_seen.update(base for base, _ in regions)
        return shared

    def add_region(self, region: Region) -> None:
        # Every path hears of the region; the kernels map it once (the same call on every rank).
        if region.base in self._regions_seen:
            return
        self._regions_seen.add(region.base)
        map_regions(self.state, [(region.base, region.nbytes)],
                    lambda values: self.exchange(values, kind="reserve_symmetric"))

    def release(self) -> None:
        self.users -= 1
        if self.users or self.state is None:
            return
        state, self.state = self.state, None
        torch.cuda.synchronize(state.device_index)
        # Peers may still read this rank's buffers in their last kernel: wait for all of them
        # (ordered and bounded, on the plain NCCL communicator) before unmapping.
        self._barrier()
        if not self.abandoned:
            state.destroy()
