"""What a step takes of the device's memory: the fall of cudaMemGetInfo's free bytes across it.

Every component of a communicator (each NCCL communicator, the symmetric pool and its windows,
the peer runtime's buffers) is measured this way when it is created, so capabilities()["memory"]
accounts for the device memory symcomm holds. The number is the driver's view: it includes
allocation granularity (NCCL's small per-channel buffers take 2 MiB granules) and, for the first
NCCL communicator of a process, NCCL's own one-time module load. Memory that torch's caching
allocator reserves in the same step is not the component's, and is subtracted.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def measured(device: torch.device | None, step: Callable[[], T]) -> tuple[T, int]:
    """(step's result, the device bytes it took); 0 bytes off CUDA."""
    if device is None or device.type != "cuda":
        return step(), 0
    torch.cuda.synchronize(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    cached_before = torch.cuda.memory_reserved(device)
    result = step()
    torch.cuda.synchronize(device)
    taken = free_before - torch.cuda.mem_get_info(device)[0]
    taken -= torch.cuda.memory_reserved(device) - cached_before
    return result, max(taken, 0)
