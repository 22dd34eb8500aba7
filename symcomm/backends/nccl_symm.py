"""The nccl-symm path: NCCL's symmetric kernels on a communicator of its own that holds the
symmetric pool's regions as windows. Everything else about calling NCCL (the launch per op,
graph communicators, teardown) is the plain path's, which it extends."""
from __future__ import annotations

from typing import Any

import torch

from .. import _native, _nccl
from .._nccl import Library
from .._nccl_config import CommConfig
from ..base import NCCL, NCCL_SYMM, Setup
from ..device_memory import measured
from ..pool import Region, SymmetricPool
from .nccl import NcclPath, agree

# The symmetric communicator serves the small messages NCCL's symmetric kernels win at (the plain
# path takes over above a few MiB), whose blocks NCCL caps at maxCTAs; each CTA costs device
# memory (6 MiB at world 1). By NCCL's own model 8 blocks keep its bandwidth over 500 GB/s, at
# about 52 MiB (docs/memory.md).
SYMM_MAX_CTAS = 8


class NcclSymmPath(NcclPath):
    """NCCL's symmetric kernels on a second communicator that has the pool registered as
    windows. Owns the pool: regions are registered on this communicator."""

    name = NCCL_SYMM
    needs_equal_offsets = True

    def __init__(self) -> None:
        super().__init__()
        self.pool: SymmetricPool | None = None
        self.pool_bytes = 0  # the pool's regions and their windows, measured when reserved
        self._reason: str | None = None

    def open(self, setup: Setup) -> str | None:
        plain = setup.opened.get(NCCL)
        if plain is None:
            # NCCL's own open already voted: every rank is here alike.
            reason = f"symmetric memory: needs NCCL, which is off ({setup.off.get(NCCL, 'not opened')})"
        else:
            reason = agree(setup, self._symmetric_blocker(setup, plain.nccl))
            if reason is not None:
                reason = f"symmetric memory: {reason}"
        if reason is not None:
            self._reason = reason
            return reason
        self._open_comm(setup, plain.nccl, CommConfig(max_ctas=SYMM_MAX_CTAS))
        self.pool, pool_bytes = measured(setup.device, lambda: SymmetricPool(plain.nccl, _native.load(), self.comm,
                                                                          setup.device, setup.peers.exchange))
        self._granules = self.pool.index.granules
        capacity = setup.options["symmetric_capacity"]
        if capacity > 0:
            _, reserved = measured(setup.device, lambda: self.pool.reserve(capacity))
            pool_bytes += reserved
        self.pool_bytes = pool_bytes
        return None

    @staticmethod
    def _symmetric_blocker(setup: Setup, nccl: Library) -> str | None:
        if not setup.options["symmetric"]:
            return "disabled by the caller (symmetric=False)"
        if not nccl.has_windows:
            return (f"NCCL {nccl.version_string} has no symmetric windows "
                    f"(needs >= {'.'.join(map(str, _nccl.SYMMETRIC_MIN_VERSION))})")
        try:
            _native.load()
        except OSError as exc:
            return str(exc)
        return None

    def _graph_comm_opened(self) -> None:
        self.pool.add_comm(self.graph_comm)  # collective: every region, in order, as windows

    def reserve(self, nbytes: int) -> Region:
        """Collective: one more pool region (SymmetricPool.reserve), its device bytes counted."""
        region, taken = measured(self._device, lambda: self.pool.reserve(nbytes))
        self.pool_bytes += taken
        return region

    def info(self) -> dict[str, Any]:
        pool = self.pool
        info = super().info()
        if "device_bytes" in info:
            info["device_bytes"]["symmetric pool (regions and their windows)"] = self.pool_bytes
        return {**info, "symmetric_memory": {
            "enabled": pool is not None,
            "reason": self._reason,
            "capacity": pool.capacity if pool else 0,
            "bytes_in_use": pool.bytes_in_use if pool else 0,
            "regions": len(pool.regions) if pool else 0,
        }}

    def close(self) -> None:
        pool, self.pool, self._granules = self.pool, None, None
        if pool is not None:
            torch.cuda.synchronize(self._device)
            pool.close()  # deregistration is collective: every rank does it, in the same order
        super().close()
