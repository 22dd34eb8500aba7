"""A script that never closes its Communicator, for tests/test_lifecycle.py (run under torchrun).

The README's flow with ``comm.close()`` forgotten: the Communicator stays in module globals, as
in a user's script, and the script ends right after its last collective and
``dist.destroy_process_group()`` (what the exit race needs: a gloo worker still finishing). It
prints ``closed at exit: True`` from an atexit hook registered before symcomm's, so it runs
after symcomm's own hook (atexit runs hooks last-in, first-out).
"""
from __future__ import annotations

import atexit

import torch
import torch.distributed as dist

dist.init_process_group("gloo")


def _report() -> None:
    print(f"closed at exit: {comm.closed}", flush=True)


atexit.register(_report)  # before symcomm registers its own hook on import: so it runs after it
import symcomm  # noqa: E402 - imported after the hook above on purpose

comm = symcomm.Communicator(timeout_s=60)
x = torch.arange(16, dtype=torch.float32).reshape(4, 4) + comm.rank
comm.all_reduce(x)
comm.all_gatherv(x[: comm.rank], list(range(comm.world_size)))
got = comm.reduce_scatter(torch.ones(4 * comm.world_size, 4))
dist.destroy_process_group()
assert torch.equal(got, torch.full((4, 4), float(comm.world_size)))
