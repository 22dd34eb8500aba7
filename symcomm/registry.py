"""The one piece of global state: live communicators by key.

Compiled graphs refer to a communicator by key, because a torch.library op takes ints, not
Python objects.
"""
from __future__ import annotations

import itertools
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
