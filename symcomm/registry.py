"""The one piece of global state: live communicators by key.

Compiled graphs refer to a communicator by key, because a torch.library op takes ints, not
Python objects. At interpreter exit it also names the communicators a program never closed,
which ``close_all`` closes (registered with atexit on import).
"""
from __future__ import annotations

import atexit
import itertools
import sys
from typing import Any

from .errors import CommClosedError

_LIVE: dict[int, Any] = {}
_KEYS = itertools.count(1)


def register(comm: Any) -> int:
    key = next(_KEYS)
    _LIVE[key] = comm
    return key


def unregister(key: int) -> None:
    _LIVE.pop(key, None)


def lookup(key: int) -> Any:
    comm = _LIVE.get(key)
    if comm is None:
        raise CommClosedError(f"communicator {key} is closed or never existed")
    return comm


def close_all() -> None:
    """Close every communicator still open, newest first (the reverse of construction, as a
    program closes nested ones). Idempotent: close() unregisters, and a closed one is skipped.

    Run at interpreter exit. A communicator left open holds process groups (the user's, and
    the gloo group of its own for CPU collectives); torn down during interpreter finalization,
    their gloo threads abort the process ("terminate called without an active exception").
    Closed here, they are released while Python still runs. atexit runs its hooks last
    registered first: this module is imported after torch, so this runs before any hook torch
    registered on import; it touches nothing of the user's group, so it is safe after
    dist.destroy_process_group() too. A failure is reported, not raised: the process is leaving.
    """
    for key in sorted(_LIVE, reverse=True):
        comm = _LIVE.get(key)
        if comm is None:
            continue
        try:
            comm.close()
        except Exception as exc:  # noqa: BLE001 - one communicator's failure must not skip the others
            unregister(key)
            print(f"symcomm: closing communicator {key} at exit failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)


atexit.register(close_all)
