"""How close to the wire: the bytes a collective must move over each GPU's links, and how long a
copy-engine peer copy of that many bytes takes in the same run.

A collective of S bytes moves S x f over each GPU's links whatever its algorithm, f being
nccl-tests' bus-bandwidth factor (2(W-1)/W for all-reduce, (W-1)/W for the gathers and
reduce-scatters). After the sweep every rank, at the same time, copies that many bytes from the
next rank's GPU into its own with ``Tensor.copy_`` across devices, which CUDA runs on the copy
engine over NVLink. ``auto of link`` = copy time / auto's time: 1.00 moves the bytes as fast as
a bare peer copy, above 1.00 is faster than one. The copy is a bandwidth yardstick from a few
MiB: below that each copy costs a round trip between the two devices' streams (torch makes the
copy wait on an event of the other device's stream and back), 13-21 us on 2x H200 whatever the
size, so auto beats it there by 2.6-4x.

Why a copy across devices in one process, not a copy from a peer's symmetric-memory view: that
view is a local-device tensor over memory mapped from another process, and ``copy_`` on it
failed with "invalid argument" on H200s (bench/NOTES.md, 2026-11-28). A copy between two
devices the process can see is the plain, supported way to drive the link.

Collective: every rank calls ``measure`` with the same sizes. Where any rank cannot copy (the
next rank's GPU is not visible to it, no peer access, a failure mid-way) every rank reports the
same refusal and no times; the barriers still pair up, so nothing hangs.
"""
from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .report import DeviceInfo, LinkTimes, pci_address

# The stream waits before the first copy for long enough that the host has queued every copy by
# the time it starts: timed otherwise, the copies of a small size would wait for the host
# (torch's cross-device copy costs ~10-20 us of CPU time each: events and stream waits on both
# devices), and the column would show the CPU's speed, not the link's.
_HOLD_US_PER_COPY = 50.0
_CLOCK_GHZ = 2.0  # for the hold's cycle count; a hold longer than needed only costs idle time


def local_refusal(device: torch.device, mine: DeviceInfo, peer: DeviceInfo) -> tuple[str | None, int | None]:
    """(why this rank cannot copy from ``peer``'s GPU, or None; the peer GPU's index here)."""
    if device.type != "cuda":
        return "the ranks run on the CPU: no link to measure", None
    if getattr(torch.cuda, "_sleep", None) is None:
        return "this torch has no torch.cuda._sleep, without which small copies would time the host", None
    if peer.host != mine.host:
        return f"rank {peer.rank} is on another host ({peer.host})", None
    for index in range(torch.cuda.device_count()):
        if pci_address(index) == peer.pci:
            if index == device.index:
                return f"rank {peer.rank} uses this rank's GPU", None
            # torch runs the copy on the source GPU's stream, writing into this one: both ways.
            if not (torch.cuda.can_device_access_peer(index, device.index)
                    and torch.cuda.can_device_access_peer(device.index, index)):
                return f"GPUs {device.index} and {index} have no peer access", None
            return None, index
    return (f"rank {mine.rank} cannot see rank {peer.rank}'s GPU (CUDA_VISIBLE_DEVICES hides it): "
            f"the copy runs between two GPUs of one process"), None


def _hold(iters: int) -> None:
    torch.cuda._sleep(int(max(1000.0, iters * _HOLD_US_PER_COPY) * _CLOCK_GHZ * 1e3))  # torch's spin kernel


def _time_copy(dst: torch.Tensor, src: torch.Tensor, iters: int) -> float:
    """us per copy of ``src`` (another GPU) into ``dst`` (this one, the current device), ``iters``
    copies in a row."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _hold(iters)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _copy_one(wire: int, device: torch.device, peer_index: int, iters: int, rounds: int,
              seed: int) -> tuple[float, int]:
    """(us, bytes wrong) for ``wire`` bytes from GPU ``peer_index`` into ``device``. Its buffers
    are this call's locals: freed when it returns, before the next size allocates."""
    pattern = torch.randint(0, 256, (wire,), dtype=torch.uint8, device=device,
                            generator=torch.Generator(device=device).manual_seed(seed))
    src = pattern.to(torch.device("cuda", peer_index))
    dst = torch.empty_like(pattern)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    wrong = int((dst != pattern).sum().item())
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize(peer_index)
        torch.cuda.synchronize(device)
        samples.append(_time_copy(dst, src, iters))
    return statistics.median(samples), wrong


def measure(sizes: Sequence[int], factor: float, devices: Sequence[DeviceInfo], rank: int,
            device: torch.device, iters: int, rounds: int, seed: int,
            gather: Callable[[object], list]) -> LinkTimes:
    """Time a peer copy of each size's wire bytes on every rank at once. Collective.
    ``devices``: every rank's DeviceInfo (the header's list); ``gather``: every rank's JSON value."""
    world = len(devices)
    if world < 2:
        return LinkTimes(factor, refusal="world 1: nothing crosses a link")
    why, peer_index = local_refusal(device, devices[rank], devices[(rank + 1) % world])
    # A refusal anywhere is agreed before any copy, so no rank times copies only to discard them.
    refusal = next((r for r in gather(why) if r), None)
    if refusal is not None:
        return LinkTimes(factor, refusal=refusal)
    times: dict[int, float] = {}
    wrong = 0
    with torch.cuda.device(device):  # _sleep and the events use the current device's stream
        for nbytes in sizes:
            wire = int(nbytes * factor)
            # Every rank reaches every barrier, copying or not: a rank that failed must not
            # leave the others waiting.
            dist.barrier()
            if why is not None or wire == 0:
                continue
            try:
                times[nbytes], bad = _copy_one(wire, device, peer_index, iters, rounds, seed * 7919 + nbytes)
                wrong += bad
            except Exception as exc:  # noqa: BLE001 - any failure becomes the column's refusal, on every rank
                why = f"rank {rank}: {type(exc).__name__}: {exc}"
        dist.barrier()
        try:
            with torch.cuda.device(peer_index):
                torch.cuda.empty_cache()  # the sources' memory on the peer GPU goes back to it
        except Exception as exc:  # noqa: BLE001 - the gather below must still happen on every rank
            why = why or f"rank {rank}: freeing the peer GPU's memory: {type(exc).__name__}: {exc}"
    reports = gather({"why": why, "times": {str(n): t for n, t in times.items()}, "wrong": wrong})
    refusal = next((r["why"] for r in reports if r["why"]), None)
    if refusal is not None:
        return LinkTimes(factor, refusal=refusal)
    mean = {n: sum(r["times"].get(str(n), 0.0) for r in reports) / world for n in times}
    return LinkTimes(factor, mean, sum(r["wrong"] for r in reports))
