"""Communicator.graph_capture(): the collective bracket around a CUDA-graph capture.

Paths record what they launch while the graph is captured (begin_capture) and, after the
capture ended, register it with their peers (end_capture), which is collective and must run
outside the capture. Every rank takes the same steps, so a problem found on one rank is
reported on all of them.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from . import base
from .base import Path
from .errors import ArgumentError, PeerMismatchError


class CaptureBracket:
    """One Communicator's bracket: at most one session at a time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.active = False

    @contextlib.contextmanager
    def session(self, paths: Sequence[Path]) -> Iterator[None]:
        if self.active:
            raise ArgumentError("graph_capture() is already active on this communicator (it does not nest)")
        # Every rank raises alike: setup steps inside a capture would end up in the graph.
        misplaced = ArgumentError("graph_capture() must enclose the torch.cuda.graph(...) block, not sit "
                                  "inside it: buffers can be registered only outside a capture")
        if base.capturing(self.device):
            raise misplaced
        self.active = True
        try:
            for path in paths:
                path.begin_capture()
        except BaseException:
            self.active = False
            for path in paths:
                path.discard_capture()
            raise
        failed = True
        try:
            yield
            failed = False
        finally:
            self.active = False
            if base.capturing(self.device):
                for path in paths:
                    path.discard_capture()
                raise misplaced
            problems = [p for p in (path.end_capture(failed) for path in paths) if p is not None]
            if problems and not failed:
                raise PeerMismatchError(f"graph_capture(): {'; '.join(problems)}. Do not replay the captured "
                                        f"graph: its custom all-reduces on unregistered buffers refuse to run (the "
                                        f"next call raises CommTimeoutError), the rest would meet mismatched peers")
