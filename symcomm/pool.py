"""The symmetric pool: NCCL-allocated regions registered as symmetric windows, carved up by
torch's caching allocator through csrc/pool_alloc.cc, plus the membership index.

Rules this module enforces (docs/symmetric-memory.md):
- Registration is a collective: every rank adds the same region sizes in the same order, so
  regions are added only by :meth:`SymmetricPool.reserve`, which first checks that all ranks
  asked for the same thing and refuses during CUDA-graph capture.
- Membership runs on every collective, so it is one dict lookup per tensor, never a scan.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from ._native import Native
from ._nccl import Library
from .base import capturing
from .errors import PeerMismatchError, SymcommError, SymmetricMemoryError
from .peers import Exchange

# ncclMemAlloc rounds to the cuMem granularity (2 MiB on Hopper); registering whole
# granules keeps the window size equal to what was really mapped.
GRANULE_SHIFT = 21
REGION_GRANULE = 1 << GRANULE_SHIFT

MIB = 1 << 20


def segment_bytes(nbytes: int) -> int:
    """What torch's caching allocator takes from the pool for one tensor of ``nbytes``: it asks
    its backing allocator for whole segments, 2 MiB for requests up to 1 MiB, 20 MiB for those
    below 10 MiB, and larger ones rounded up to 2 MiB (the constants
    kSmallBuffer, kLargeBuffer and kRoundLarge in torch's caching allocator)."""
    if nbytes <= MIB:
        return 2 * MIB
    if nbytes < 10 * MIB:
        return 20 * MIB
    return -(-nbytes // (2 * MIB)) * 2 * MIB


class SegmentIndex:
    """Maps an address to the registered segment holding it, in O(1).

    Segments are whole 2 MiB granules (ncclMemAlloc maps and aligns at cuMem granularity), so
    a dict from granule number to segment start answers "which segment?" with one shift and
    one lookup: about a third of a bisect over 1,000 starts, and independent of their number.
    Only the first byte is looked up: the pool never hands out a block that crosses a segment
    end, so a tensor (or view) whose first byte is in a segment lies wholly inside it.
    """

    __slots__ = ("_granules", "_sizes")

    def __init__(self) -> None:
        self._granules: dict[int, int] = {}
        self._sizes: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._sizes)

    def add(self, start: int, nbytes: int) -> None:
        if nbytes <= 0 or start % REGION_GRANULE or nbytes % REGION_GRANULE:
            raise ValueError(f"segment [{start:#x}, +{nbytes}) is not a positive number of "
                             f"{REGION_GRANULE}-byte granules at a granule boundary")
        granules = range(start >> GRANULE_SHIFT, (start + nbytes) >> GRANULE_SHIFT)
        if any(g in self._granules for g in granules):
            raise ValueError(f"segment [{start:#x}, +{nbytes}) overlaps a registered one")
        for g in granules:
            self._granules[g] = start
        self._sizes[start] = nbytes

    def remove(self, start: int) -> None:
        nbytes = self._sizes.pop(start)
        for g in range(start >> GRANULE_SHIFT, (start + nbytes) >> GRANULE_SHIFT):
            del self._granules[g]

    def find(self, ptr: int) -> int:
        """Start of the segment holding address ``ptr``, or -1."""
        return self._granules.get(ptr >> GRANULE_SHIFT, -1)

    @property
    def granules(self) -> dict[int, int]:
        """granule number (address >> GRANULE_SHIFT) -> segment start. Read-only for callers:
        the per-call path looks addresses up here directly, with no Python frame in between."""
        return self._granules


@dataclass(frozen=True)
class Region:
    number: int  # registration order: equal across ranks, unlike the address
    base: int
    nbytes: int
    windows: tuple[int, ...]  # one per communicator the region is registered on, in their order


def round_to_granule(nbytes: int) -> int:
    return -(-nbytes // REGION_GRANULE) * REGION_GRANULE


class SymmetricPool:
    """Registered regions on one NCCL communicator, served to torch through a MemPool."""

    def __init__(self, nccl: Library, native: Native, comm: int, device: torch.device,
                 exchange: Exchange) -> None:
        self._nccl = nccl
        self._native = native.lib
        self._comms = [comm]  # registered on each, in this order (SymmetricPool.add_comm)
        self._device = device
        self._exchange = exchange
        self.pool_id: int = self._native.symcomm_pool_create()
        allocator = torch.cuda.memory.CUDAPluggableAllocator(native.path, "symcomm_alloc", "symcomm_free")
        self._allocator = allocator  # torch keeps a raw pointer into it: keep it alive
        self.mempool = torch.cuda.MemPool(allocator.allocator())
        self.index = SegmentIndex()
        self.regions: dict[int, Region] = {}  # keyed by base

    @property
    def capacity(self) -> int:
        return sum(r.nbytes for r in self.regions.values())

    @property
    def bytes_in_use(self) -> int:
        return self._native.symcomm_pool_bytes_in_use(self.pool_id)

    def reserve(self, nbytes: int) -> Region:
        """Collective: add one region of ``nbytes`` (rounded up to 2 MiB) on every rank."""
        if capturing():
            raise SymmetricMemoryError(
                "reserve_symmetric() registers an NCCL window, a collective that cannot run "
                "during CUDA-graph capture; reserve before capturing")
        # Agree first, check after: a rank that raised on its own would leave the others
        # waiting in the exchange.
        asked = self._exchange([nbytes, len(self.regions)], kind="reserve_symmetric")
        if any(row != asked[0] for row in asked):
            raise PeerMismatchError(
                "reserve_symmetric(nbytes): ranks disagree on (nbytes, regions so far): "
                + ", ".join(f"rank {r}: {tuple(row)}" for r, row in enumerate(asked)))
        if nbytes <= 0:
            raise SymmetricMemoryError(f"reserve_symmetric(nbytes): nbytes must be positive, got {nbytes}")
        nbytes = round_to_granule(nbytes)
        with torch.cuda.device(self._device):
            ptr, failure = 0, ""
            try:
                ptr = self._nccl.mem_alloc(nbytes)
                if ptr % REGION_GRANULE:
                    failure = f"ncclMemAlloc returned {ptr:#x}, not {REGION_GRANULE}-byte aligned"
            except SymcommError as exc:
                failure = str(exc)
            # Every rank must enter the register collective, or none: agree on success first.
            if not all(ok for ok, in self._exchange([0 if failure else 1], kind="reserve_symmetric")):
                if ptr:
                    self._nccl.mem_free(ptr)
                raise SymmetricMemoryError(
                    f"reserve_symmetric({nbytes}): allocation failed on at least one rank"
                    + (f" (here: {failure})" if failure else ""))
            windows: list[int] = []
            try:
                for comm in self._comms:
                    windows.append(self._nccl.window_register(comm, ptr, nbytes))
            except Exception:
                for comm, window in zip(self._comms, windows):
                    self._nccl.window_deregister(comm, window)
                self._nccl.mem_free(ptr)
                raise
        # Cannot fail for an aligned, positive region of a live pool (checked above).
        self._native.symcomm_pool_add_region(self.pool_id, ptr, nbytes)
        region = Region(len(self.regions), ptr, nbytes, tuple(windows))
        self.regions[ptr] = region
        self.index.add(ptr, nbytes)
        return region

    def add_comm(self, comm: int) -> None:
        """Collective: register every region, in registration order, on one more NCCL
        communicator (the symmetric path's graph communicator); later regions go on both."""
        added: list[tuple[Region, int]] = []
        with torch.cuda.device(self._device):
            try:
                for region in sorted(self.regions.values(), key=lambda r: r.number):
                    added.append((region, self._nccl.window_register(comm, region.base, region.nbytes)))
            except Exception:
                # All or nothing: close() deregisters only what a communicator in _comms holds.
                for _, window in added:
                    self._nccl.window_deregister(comm, window)
                raise
        for region, window in added:
            self.regions[region.base] = dataclasses.replace(region, windows=(*region.windows, window))
        self._comms.append(comm)

    def locate(self, ptr: int) -> tuple[int, int]:
        """(region number, offset) of a registered range; (-1, -1) when not registered."""
        base = self.index.find(ptr)
        if base < 0:
            return -1, -1
        return self.regions[base].number, ptr - base

    def take_failed_request(self) -> int:
        return self._native.symcomm_pool_take_failed_request(self.pool_id)

    def close(self) -> int:
        """Deregister the windows (collective) and free the regions, unless tensors from the
        pool are still alive: then their memory stays mapped, with a warning, because freeing it
        would let a later allocation reuse addresses those tensors still point at.
        Returns the number of allocations still live."""
        # Dropping the MemPool hands torch's cached, unused blocks back to the sub-allocator.
        self.mempool = None
        live = self._native.symcomm_pool_live_allocations(self.pool_id)
        self._native.symcomm_pool_destroy(self.pool_id)
        with torch.cuda.device(self._device):
            # Windows go in reverse registration order, the same on every rank.
            for region in sorted(self.regions.values(), key=lambda r: -r.number):
                for comm, window in reversed(list(zip(self._comms, region.windows))):
                    self._nccl.window_deregister(comm, window)
                if not live:
                    self._nccl.mem_free(region.base)
        if live:
            warnings.warn(f"Communicator.close(): {live} allocation(s) from the symmetric pool are still "
                          f"alive; {self.capacity} bytes stay mapped until the process exits",
                          ResourceWarning, stacklevel=3)
        self.regions.clear()
        self.index = SegmentIndex()
        return live


class SymmetricContext:
    """Routes allocations on this thread to a SymmetricPool until exit."""

    __slots__ = ("_pool", "_native", "_torch_ctx", "_previous")

    def __init__(self, pool: SymmetricPool) -> None:
        self._pool = pool
        self._native = pool._native
        self._torch_ctx = None
        self._previous = -1

    def __enter__(self) -> SymmetricPool:
        torch_ctx = torch.cuda.use_mem_pool(self._pool.mempool, self._pool._device)
        try:
            torch_ctx.__enter__()
        except RuntimeError as exc:
            # torch routes a pool to one thread at a time, once: a context of this pool already
            # open (nested here, or on another thread, such as autograd's while backward runs
            # inside one) makes it refuse with an internal message.
            if "already recording" not in str(exc):
                raise
            raise SymmetricMemoryError(
                "use_symmetric_memory(comm) is already open for this communicator (here, or on another "
                "thread: torch routes a memory pool to one thread at a time); allocate inside the open "
                "one instead of nesting") from exc
        self._torch_ctx = torch_ctx
        self._previous = self._native.symcomm_pool_set_active(self._pool.pool_id)
        return self._pool

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._torch_ctx.__exit__(exc_type, exc, tb)
        finally:
            self._native.symcomm_pool_set_active(self._previous)
        if exc_type is not None and issubclass(exc_type, torch.OutOfMemoryError):
            failed = self._pool.take_failed_request()
            if failed:
                raise SymmetricMemoryError(
                    f"symmetric pool exhausted: a {failed}-byte request did not fit in "
                    f"{self._pool.capacity} bytes ({self._pool.bytes_in_use} in use). Call "
                    f"comm.reserve_symmetric(nbytes) on every rank, outside graph capture, or "
                    f"pass a larger symmetric_capacity to Communicator") from exc
        return False


class _NullContext:
    """Shared do-nothing context: use_symmetric_memory(disabled=True) builds no object."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> bool:
        return False


NULL_CONTEXT = _NullContext()
