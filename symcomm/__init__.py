"""symcomm: NCCL symmetric-memory collectives for PyTorch.

    comm = symcomm.Communicator()                  # collective over torch.distributed's WORLD
    with symcomm.use_symmetric_memory(comm):
        x = torch.randn(4096, device="cuda")       # lands in a registered NCCL window
    comm.all_reduce(x, out=x)                      # zero-copy symmetric kernel where it wins
"""
from .communicator import Communicator
from .dispatch import Choice
from .errors import (ArgumentError, CommClosedError, CommTimeoutError, CudaError, DtypeError, NcclError,
                     NcclUnavailableError, PeerMismatchError, SymcommError, SymmetricMemoryError)
from . import fp4, rmsnorm
from .memory import use_symmetric_memory
from .operations.all_gatherv_fp4 import Fp4Choice, Fp4Gathered
from .operations.all_reduce_rmsnorm import NormChoice
from .operations.moe_dispatch import Dispatched, EpHandle, moe_dispatch_nbytes
from .rmsnorm import NormedResult
from .tensor_parallel import copy_to_tp_region, reduce_from_tp_region

__version__ = "0.1.0"

__all__ = [
    "ArgumentError", "Choice", "CommClosedError", "CommTimeoutError", "Communicator", "CudaError", "Dispatched",
    "DtypeError", "EpHandle", "Fp4Choice", "Fp4Gathered", "NcclError", "NcclUnavailableError", "NormChoice",
    "NormedResult", "PeerMismatchError", "SymcommError", "SymmetricMemoryError", "copy_to_tp_region", "fp4",
    "moe_dispatch_nbytes", "reduce_from_tp_region", "rmsnorm", "use_symmetric_memory",
]
