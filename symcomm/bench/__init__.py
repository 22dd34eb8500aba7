"""symcomm-bench: nccl-tests-style bandwidth tables for symcomm's collectives.

Run ``symcomm-bench OP [options]`` or ``python -m symcomm.bench OP [options]``.
"""
from __future__ import annotations

from .cli import main

__all__ = ["main"]
