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
from . import fp4
from .fp4_gather import Fp4Gathered
from . import fused_norm
from .fused_norm import NormChoice, NormedResult
from .memory import use_symmetric_memory

__version__ = "0.1.0"

__all__ = [
    "ArgumentError", "Choice", "CommClosedError", "CommTimeoutError", "Communicator", "CudaError", "DtypeError",
    "Fp4Gathered", "NcclError", "NcclUnavailableError", "NormChoice", "NormedResult", "PeerMismatchError",
    "SymcommError", "SymmetricMemoryError", "fp4", "fused_norm", "use_symmetric_memory",
]
