"""The paths a collective can take, one module each, and the order a Communicator opens them.

Order matters twice: a path may use the paths opened before it (``nccl-symm`` needs ``nccl``'s
library; the custom kernels need ``nccl`` for their teardown barrier and ``nccl-symm``'s pool),
and teardown runs in reverse. Adding a path is one module here, one entry below, and a row in
the tuning table (symcomm/dispatch.py) saying where it is preferred.
"""
from __future__ import annotations

from ..base import FLAGFREE, ONESHOT, TWOSHOT, PathFactory
from .custom import CustomPath
from .nccl import NcclPath, NcclSymmPath
from .peer_gather import PushPath
from .torch_dist import TorchPath

PATHS: tuple[PathFactory, ...] = (
    NcclPath,
    NcclSymmPath,
    lambda: CustomPath(FLAGFREE),
    lambda: CustomPath(ONESHOT),
    lambda: CustomPath(TWOSHOT),
    PushPath,
    TorchPath,
)
