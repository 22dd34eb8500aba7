"""The collective start and end of a communicator's paths: opened in order, closed in reverse
within the timeout (aborted past it)."""
from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from .base import Path, PathFactory, Setup
from .bounded import bounded
from .errors import CommTimeoutError


def open_paths(factories: Sequence[PathFactory], setup: Setup, opened: list[Path],
               reasons: list[str | None]) -> None:
    """Collective: build and open each path in order. Every path tried is appended to ``opened``
    as soon as it exists (so a failure part way leaves the caller able to close it), and its
    reason to stay off (None: open) to ``reasons``. Later paths find the earlier ones by name in
    ``setup.opened`` and ``setup.off`` (the collectives' paths: composite ones share names)."""
    for factory in factories:
        path = factory()
        opened.append(path)
        reason = path.open(setup)
        reasons.append(reason)
        if reason is None:
            setup.opened.setdefault(path.name, path)
        else:
            setup.off.setdefault(path.name, reason)


def close_paths(opened: Sequence[Path], timeout_s: float, device: torch.device | None) -> None:
    """Collective: close ``opened`` in reverse order within ``timeout_s``; on timeout, abort each
    (NCCL communicators aborted, peer mappings left alone) and raise CommTimeoutError. Every
    path's close runs even after one fails (they are collective); the first failure is raised."""
    paths = list(opened)[::-1]
    abandoned = threading.Event()  # set when close gave up: the thread must stop touching things

    def teardown() -> None:
        failures = []
        for path in paths:
            if abandoned.is_set():
                return
            try:
                path.close()
            except Exception as exc:  # noqa: BLE001 - finish the other (collective) closes first
                failures.append(exc)
        if failures:
            raise failures[0]

    try:
        bounded("close", teardown, timeout_s, device)
    except CommTimeoutError:
        abandoned.set()
        for path in paths:
            try:
                bounded(f"abort {path.name}", path.abort, timeout_s, device)
            except Exception:  # noqa: BLE001 - best effort after a timeout already reported
                pass
        raise
