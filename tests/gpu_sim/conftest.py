"""Simulated-ranks tests need one GPU and symcomm's native library: skip without them, with the
reason, unless SYMCOMM_REQUIRE_GPU=1, which turns the skip into a failure so a GPU run cannot
pass by skipping."""
from __future__ import annotations

import pytest
import torch

from _sim import cannot_run


def _unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available (simulated ranks still need one GPU)"
    try:
        from symcomm import _native
        _native.load()
    except OSError as exc:
        return f"symcomm's native library is unavailable: {exc}"
    return None


@pytest.fixture(autouse=True)
def _gpu():
    reason = _unavailable()
    if reason is not None:
        cannot_run(reason)
