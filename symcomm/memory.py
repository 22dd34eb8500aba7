"""use_symmetric_memory: the context under which tensors land in registered windows."""
from __future__ import annotations

from . import validate
from .pool import NULL_CONTEXT, SymmetricContext


def use_symmetric_memory(comm, disabled: bool = False):
    """Allocate tensors inside the ``with`` block from ``comm``'s symmetric pool.

    Tensors from the pool are registered NCCL windows, so collectives on ``comm`` can run
    NCCL's symmetric (zero-copy) kernels on them. Symmetric kernels need every rank's tensor at
    the same window offset: allocate the same shapes in the same order on every rank (use
    SYMCOMM_CHECK=1 to verify). Inside it, every allocation must be alike on every rank: make
    calls whose outputs or temporaries have per-rank shapes (all_to_allv, uneven
    reduce_scatterv, moe_combine, misaligned views), pass out= on some ranks only, or call an
    all-reduce past custom_ar_capacity in place on some ranks only, outside it. It does not
    nest, and is open on one thread at a time (torch routes a pool so): a second one raises
    SymmetricMemoryError. With ``disabled=True``, or where symmetric memory is off,
    this returns a shared no-op context and allocations go to torch's normal allocator.
    """
    validate.communicator_key(comm)
    pool = None if disabled else comm.symmetric_pool
    return NULL_CONTEXT if pool is None else SymmetricContext(pool)
