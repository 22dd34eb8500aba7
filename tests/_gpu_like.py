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
from symcomm.backends.composite import UnfusedFp4Path, reference_norm, unfused_norm
from symcomm.backends.custom_ar import AllReduceKernelPath
from symcomm.backends.fp4_push import FusedPushFp4Path
from symcomm.backends.nccl import NcclPath
from symcomm.backends.nccl_symm import NcclSymmPath
from symcomm.backends.peer_gather import PushPath
from symcomm.backends.torch_dist import TorchPath
from symcomm.backends.twoshot_push import TwoShotPushPath
from symcomm.base import FLAGFREE, ONESHOT, TWOSHOT
from symcomm.peer import context as peer_context
from symcomm.peer.setup import SHARED_KEY, SharedContext

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
    state = peer_context.PeerContext(SimpleNamespace(), 1, rank, world, cpu, peer_context.DEFAULT_STAGING_BYTES,
                                     peer_context.default_flagfree_bytes(world), peer_context.DEFAULT_GRAPH_SLOTS,
                                     pool.granules, 30.0)
    state.region_slots[pool.base] = 1
    state.region_numbers[pool.base] = 0
    shared = SharedContext(state)

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

    def on_shared(cls, *args):
        """``cls`` over the fake context: its open() finds the context already shared (as the
        first peer path's open would leave it), and its close() touches no device."""
        class Fake(cls):
            def open(self, setup):
                setup.shared[SHARED_KEY] = shared
                return super().open(setup)

            def close(self):
                pass
        return lambda: Fake(*args)

    paths = (Nccl, Symm, on_shared(AllReduceKernelPath, FLAGFREE), on_shared(AllReduceKernelPath, ONESHOT),
             on_shared(AllReduceKernelPath, TWOSHOT), on_shared(TwoShotPushPath), on_shared(PushPath), TorchPath,
             unfused_norm, reference_norm,
             on_shared(FusedPushFp4Path), UnfusedFp4Path)
    return symcomm.Communicator(paths=paths, timeout_s=60)
