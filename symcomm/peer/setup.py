"""Building and extending the peer runtime, always collectively and by vote.

open_context maps every rank's kernel buffers and proves P2P on every pair; map_regions maps
the symmetric pool's regions from every peer (descriptors over symcomm/fd_channel.py);
register_captured maps the buffers a graph captured. Each step votes, so a rank that cannot
take part makes every rank fall back (the kernels off, or pool inputs staged) instead of
leaving its peers waiting. SharedContext is the one context the peer-memory paths of a
communicator share: the first to open builds it, the last to close tears it down.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import socket
import struct
from collections.abc import Callable, Sequence

import torch

from .. import _native, settings
from ..base import NCCL, NCCL_SYMM, Setup
from ..device_memory import measured
from ..errors import CudaError
from ..fd_channel import IDENTITY_INTS, FdChannel, Identity
from ..peers import Exchange
from ..pool import Region
from .capture import CALL_FIELDS, CaptureSession
from .context import (DEFAULT_GRAPH_SLOTS, DEFAULT_STAGING_BYTES, HANDLE_BYTES, PeerContext,
                      allocator_has_ipc_handles, default_flagfree_bytes, handle_ints, ints_handle)

_c = ctypes
SUPPORTED_WORLD_SIZES = (2, 4, 6, 8)

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


def open_context(rank: int, world_size: int, device: torch.device, exchange: Exchange, timeout_s: float,
                 granules: dict[int, int] | None, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 flagfree_bytes: int | None = None, graph_slots: int = DEFAULT_GRAPH_SLOTS,
                 regions: Sequence[tuple[int, int]] = (),
                 off: str | None = None) -> tuple[PeerContext | None, str | None]:
    """Collective: map every rank's buffers and test P2P on every pair. Returns the context, or
    None and the reason the kernels are off (the same decision on every rank). ``off`` is a
    local reason to stay off, which still takes part in the vote so no peer waits for this rank.
    ``flagfree_bytes`` defaults to default_flagfree_bytes(world_size)."""
    if flagfree_bytes is None:
        flagfree_bytes = default_flagfree_bytes(world_size)
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
    votes = exchange([0 if reason is None else 1, host_identity(), *sizes, int(allocator_has_ipc_handles())])
    if reason is not None:
        return None, reason
    if any(row[0] for row in votes):
        return None, "unavailable on another rank: " + ", ".join(str(r) for r, row in enumerate(votes) if row[0])
    if len({row[1] for row in votes}) > 1:
        return None, "the ranks span hosts (CUDA IPC needs one host)"
    if any(row[2:5] != sizes for row in votes):
        per_rank = ", ".join(f"rank {r}: {row[2:5]}" for r, row in enumerate(votes))
        return None, (f"ranks disagree on the buffer sizes [staging, flag-free, graph slots] ({per_rank}); "
                      f"pass the same custom_ar_capacity on every rank")

    ctx = _c.c_void_p()
    code = lib.symcomm_ar_create(rank, world_size, device.index, staging_bytes, flagfree_bytes, graph_slots,
                                 timeout_s, _c.byref(ctx))
    handle = _c.create_string_buffer(HANDLE_BYTES)
    if code == 0:
        code = lib.symcomm_ar_handle(ctx, handle)
    rows = exchange([code, *handle_ints(handle.raw)])
    context = PeerContext(lib, ctx.value or 0, rank, world_size, device, staging_bytes, flagfree_bytes,
                            graph_slots, granules, timeout_s)
    # A captured input is mapped or staged by this answer, and the ranks compare how each
    # captured call reads its input: one rank's allocator setting (PYTORCH_CUDA_ALLOC_CONF)
    # must not make it stage where its peers map, so every rank stages if any must.
    context.can_register = all(row[5] for row in votes)
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        _quiet_destroy(context)
        return None, f"could not allocate the buffers on rank(s) {failed}" + _cuda_reason(lib, code)
    handles = b"".join(ints_handle(row[1:]) for row in rows)
    code = lib.symcomm_ar_open(context.ctx, handles)
    failed = [r for r, (c,) in enumerate(exchange([code])) if c]
    if failed:
        _quiet_destroy(context)
        return None, f"CUDA IPC mapping failed on rank(s) {failed}" + _cuda_reason(lib, code)
    problem = _probe(context, exchange)
    if problem is not None:
        _quiet_destroy(context)
        return None, problem
    context.watch()
    _open_channel(context, timeout_s, exchange)
    map_regions(context, regions, exchange)
    return context, None


def _open_channel(context: PeerContext, timeout_s: float, exchange: Exchange) -> None:
    """Collective: bind this rank's descriptor socket, then announce who it is. The socket is
    bound before the announcement, so every peer listens before anyone sends. A rank without
    one announces zeros, and pool inputs are then staged everywhere (region_problem)."""
    try:
        context.channel = FdChannel(timeout_s)
        mine = context.channel.identity.to_ints()
    except OSError as exc:
        context.region_problem = f"no Unix socket to pass memory handles ({exc})"
        mine = [0] * IDENTITY_INTS
    rows = exchange([0 if context.channel is None else 1, *mine])
    if not all(row[0] for row in rows):
        context.region_problem = context.region_problem or "a peer has no Unix socket to pass memory handles"
        return
    context.channel.meet({r: Identity.from_ints(row[1:]) for r, row in enumerate(rows) if r != context.rank})


def map_regions(context: PeerContext, regions: Sequence[tuple[int, int]], exchange: Exchange) -> None:
    """Collective: map every peer's copy of each symmetric-pool region (base, nbytes), so the
    kernels read inputs there in place.

    Pool regions are cuMem allocations (ncclMemAlloc), which CUDA IPC handles do not cover and
    NCCL 2.28 has no host call to translate. Each rank exports a region as a POSIX file
    descriptor and passes it over a Unix SOCK_SEQPACKET socket (SCM_RIGHTS, symcomm/fd_channel.py) to each peer, which maps
    it. On any failure every rank keeps staging those inputs instead (region_problem says why).
    """
    if not regions or context.region_problem is not None:
        exchange([1])  # peers in the same call learn that this rank opts out
        return
    lib, world = context.lib, context.world_size
    fds: list[int] = []
    code = 0
    for base, _ in regions:
        fd = _c.c_int(-1)
        code = code or lib.symcomm_ar_export_region(context.ctx, base, _c.byref(fd))
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
            failure = _pass_regions(context, regions, fds, mapped)
        except Exception:  # noqa: BLE001 - reported to every rank as a failed vote
            failure = 1
        if not _all_ok(exchange([failure])):
            problem = "passing or mapping pool regions between ranks failed on some rank"
            return
        slots = []
        try:
            for i, _ in enumerate(regions):
                slot = context.next_free_slot()
                ptrs = (_c.c_uint64 * world)(*(mapped[r][i] for r in range(world)))
                if not slot or lib.symcomm_ar_set_slot_ptrs(context.ctx, slot, ptrs):
                    failure = 1
                slots.append(slot)
        except Exception:  # noqa: BLE001 - as above
            failure = 1
        if not _all_ok(exchange([failure])):
            problem = "no device slot left for pool regions on some rank"
            return
        context.region_slots.update({base: slot for (base, _), slot in zip(regions, slots)})
        for base, _ in regions:
            context.region_numbers[base] = len(context.region_numbers)
    finally:
        for fd in fds:
            os.close(fd)
        if problem is not None:
            context.region_problem = problem


def _pass_regions(context: PeerContext, regions: Sequence[tuple[int, int]], fds: list[int],
                  mapped: dict[int, list[int]]) -> int:
    """Send this rank's region fds to every peer, receive and map theirs into ``mapped``
    (rank -> region pointers). Returns 1 on any failure. The channel takes only messages whose
    sender address and credentials are those the claimed rank announced (fd_channel.py), and
    its receive is bounded by the communicator's timeout."""
    lib, rank, world, channel = context.lib, context.rank, context.world_size, context.channel
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
                if failure or lib.symcomm_ar_import_region(context.ctx, fd, nbytes, _c.byref(out)):
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


def _quiet_destroy(context: PeerContext) -> None:
    try:
        context.destroy()
    except CudaError:
        pass  # setup already failed; its reason is the one worth reporting


def _probe(context: PeerContext, exchange: Exchange) -> str | None:
    """Every rank stores a token into every peer and loads every peer's own copy; both
    directions of every pair must carry the right bits. The driver's peer-access report is
    not proof, a round trip of real loads and stores is."""
    lib, world = context.lib, context.world_size
    code = lib.symcomm_ar_probe_write(context.ctx, probe_token(context.rank))
    exchange([code])  # everyone has written (or failed to) before anyone reads
    got = (_c.c_uint32 * 16)()
    if code == 0:
        code = lib.symcomm_ar_probe_read(context.ctx, got)
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


def register_captured(context: PeerContext, session: CaptureSession, failed: bool, exchange: Exchange) -> str | None:
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
    lib = context.lib
    mine: list[int] = []
    code = 0
    for ptr, _ in recorded:
        handle = _c.create_string_buffer(HANDLE_BYTES)
        offset = _c.c_uint64()
        if code == 0:
            code = lib.symcomm_ar_buffer_handle(context.ctx, ptr, handle, _c.byref(offset))
        mine += [*handle_ints(handle.raw), offset.value]
    rows = exchange([code, *mine])
    failed_ranks = [r for r, row in enumerate(rows) if row[0]]
    if failed_ranks:
        return (f"captured buffers could not be exported for CUDA IPC on rank(s) {failed_ranks}"
                + _cuda_reason(lib, code))
    per = HANDLE_BYTES // 8 + 1
    for i, (ptr, slot) in enumerate(recorded):
        handles = b"".join(ints_handle(row[1 + i * per:1 + i * per + per - 1]) for row in rows)
        offsets = (_c.c_uint64 * context.world_size)(*(row[i * per + per] for row in rows))
        code = lib.symcomm_ar_set_slot(context.ctx, slot, handles, offsets, ptr)
        if code:
            break
    failed_ranks = [r for r, (c,) in enumerate(exchange([code])) if c]
    if failed_ranks:
        for _, slot in recorded:  # empty on every rank: a replay is then refused, never misdirected
            lib.symcomm_ar_release_slot(context.ctx, slot)
        return f"mapping peers' captured buffers failed on rank(s) {failed_ranks}" + _cuda_reason(lib, code)
    return None


SHARED_KEY = "peer-context"  # Setup.shared entry of the one SharedContext


class SharedContext:
    """The peer context, shared by the peer-memory paths of one communicator."""

    def __init__(self, context: PeerContext | None, reason: str | None = None, exchange: Exchange | None = None,
                 barrier: Callable[[], None] | None = None) -> None:
        self.context = context
        self.reason = reason
        self.exchange = exchange
        self._barrier = barrier
        self.users = 0
        self.device_bytes = 0  # what opening the context took: its buffers and slot table
        self.abandoned = False  # set by abort(): a timed-out teardown must unmap nothing
        self._regions_seen: set[int] = set()

    @classmethod
    def open(cls, setup: Setup) -> "SharedContext":
        """Collective (decided alike on every rank): build the kernels' context, or say why not."""
        peers, capacity = setup.peers, setup.options["custom_ar_capacity"]
        plain = setup.opened.get(NCCL)
        if plain is None:
            # NCCL is the kernels' fallback and their teardown barrier; its own open voted.
            return cls(None, f"needs NCCL, which is off ({setup.off.get(NCCL, 'not opened')})", peers.exchange)
        symm = setup.opened.get(NCCL_SYMM)
        pool = getattr(symm, "pool", None)
        regions = [] if pool is None else [(r.base, r.nbytes) for r in sorted(pool.regions.values(),
                                                                                key=lambda r: r.number)]
        (context, reason), taken = measured(setup.device, lambda: open_context(
            peers.rank, peers.world_size, setup.device, peers.exchange, setup.timeout_s,
            None if pool is None else pool.index.granules, staging_bytes=capacity, regions=regions,
            # a rank's own choice: voted, since its peers may differ
            off="turned off (custom_ar_capacity=0)" if capacity == 0 else None))
        shared = cls(context, reason, peers.exchange, plain.barrier)
        shared.device_bytes = taken
        shared._regions_seen.update(base for base, _ in regions)
        return shared

    def add_region(self, region: Region) -> None:
        # Every path hears of the region; the kernels map it once (the same call on every rank).
        if region.base in self._regions_seen:
            return
        self._regions_seen.add(region.base)
        map_regions(self.context, [(region.base, region.nbytes)],
                    lambda values: self.exchange(values, kind="reserve_symmetric"))

    def release(self) -> None:
        self.users -= 1
        if self.users or self.context is None:
            return
        context, self.context = self.context, None
        torch.cuda.synchronize(context.device_index)
        # Peers may still read this rank's buffers in their last kernel: wait for all of them
        # (ordered and bounded, on the plain NCCL communicator) before unmapping.
        self._barrier()
        if not self.abandoned:
            context.destroy()
