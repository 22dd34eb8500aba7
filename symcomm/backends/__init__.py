"""The paths an operation can take, one module each, and the order a Communicator opens them.

Order matters twice: a path may use the paths opened before it (``nccl-symm`` needs ``nccl``'s
library; the peer-memory paths need ``nccl`` for their teardown barrier and ``nccl-symm``'s
pool), and teardown runs in reverse.
Adding a path is one module here, one entry below, and a row in the tuning table
(symcomm/dispatch.py) saying where it is preferred.
"""
from __future__ import annotations

from ..base import FLAGFREE, ONESHOT, TWOSHOT, PathFactory
from .composite import UnfusedFp4Path, reference_norm, unfused_norm
from .custom_ar import AllReduceKernelPath
from .ep_a2a import A2aCombinePath, A2aDispatchPath
from .ep_push import PushCombinePath, PushDispatchPath
from .fp4_flagfree import FlagFreeFp4Path
from .fp4_push import FusedPushFp4Path
from .nccl import NcclPath
from .nccl_symm import NcclSymmPath
from .peer_gather import PushPath
from .torch_dist import TorchPath
from .twoshot_push import TwoShotPushPath

PATHS: tuple[PathFactory, ...] = (
    # the collectives'
    NcclPath,
    NcclSymmPath,
    lambda: AllReduceKernelPath(FLAGFREE),
    lambda: AllReduceKernelPath(ONESHOT),
    lambda: AllReduceKernelPath(TWOSHOT),
    TwoShotPushPath,
    PushPath,
    TorchPath,
    # all_reduce_rmsnorm's
    unfused_norm,
    reference_norm,
    # all_gatherv_fp4's
    FlagFreeFp4Path,
    FusedPushFp4Path,
    UnfusedFp4Path,
    # moe_dispatch's and moe_combine's
    PushDispatchPath,
    A2aDispatchPath,
    PushCombinePath,
    A2aCombinePath,
)
