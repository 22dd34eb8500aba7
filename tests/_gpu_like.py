"""A Communicator on the CPU (gloo) that chooses paths as one on GPUs would.

Its paths are symcomm's real path classes over stand-in native state: the NCCL paths attached
to a fake libnccl, the custom kernels' paths sharing one peer context over a fake kernel
library, and a span of CPU memory standing in for a mapped symmetric-pool region (the
membership maps point at it). Dispatch, every path's why_not, the composite operations and
select() run as on a GPU; nothing is launched, so only select() may be called on it.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

import symcomm
from symcomm import _nccl
from symcomm.backends import custom
from symcomm.backends.custom import CustomAllReduce, CustomPath, Kernels
from symcomm.backends.nccl import NcclPath, NcclSymmPath
from symcomm.backends.peer_gather import PushPath
from symcomm.backends.torch_dist import TorchPath
from symcomm.base import FLAGFREE, ONESHOT, TWOSHOT

GRANULE = 1 << 21
POOL_BYTES = 600 << 20  # holds a 256 MiB input and output side by side
FAKE_NCCL = _nccl.Library(lib=SimpleNamespace(), path="fake", source="test", version=(2, 28, 9))


class Pool:
    """CPU memory standing in for one mapped pool region (never touched: views only)."""

    def __init__(self) -> None:
        self.raw = torch.empty(POOL_BYTES + GRANULE, dtype=torch.uint8)
        start = self.raw.data_ptr()
        self.skip = -start % GRANULE
        self.base = start + self.skip
        self.granules = {g: self.base for g in range(self.base >> 21, (self.base + POOL_BYTES) >> 21)}

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        assert offset % 512 == 0 and offset + nbytes <= POOL_BYTES
        return self.raw[self.skip + offset:self.skip + offset + nbytes].view(dtype).view(shape)


def communicator(pool: Pool) -> symcomm.Communicator:
    """Collective over the default gloo group: a Communicator whose paths think they run on
    GPUs of one host, with ``pool`` mapped."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cpu = torch.device("cpu")
    state = CustomAllReduce(SimpleNamespace(), 1, rank, world, cpu, custom.DEFAULT_STAGING_BYTES,
                            custom.DEFAULT_FLAGFREE_BYTES, custom.DEFAULT_GRAPH_SLOTS, pool.granules, 30.0)
    state.region_slots[pool.base] = 1
    state.region_numbers[pool.base] = 0
    kernels = Kernels(state)

    class Nccl(NcclPath):
        def open(self, setup):
            self.attach(FAKE_NCCL, 1, rank, cpu)

        def close(self):
            pass

    class Symm(NcclSymmPath):
        def open(self, setup):
            self.attach(FAKE_NCCL, 2, rank, cpu)
            self._granules = pool.granules

        def close(self):
            pass

    class Kernel(CustomPath):
        def open(self, setup):
            return None

        def close(self):
            pass

    class Push(PushPath):
        def open(self, setup):
            return None

        def close(self):
            pass

    paths = (Nccl, Symm, lambda: Kernel(FLAGFREE, kernels), lambda: Kernel(ONESHOT, kernels),
             lambda: Kernel(TWOSHOT, kernels), lambda: Push(kernels), TorchPath)
    return symcomm.Communicator(paths=paths, timeout_s=60)
