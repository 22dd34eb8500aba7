"""The registry: op name -> spec, in the order the CLI lists them. The one place that knows
which ops exist; everything else asks it.

The list follows the operation descriptors (symcomm.operations.OPERATIONS): each names its
spec in ``bench`` ("module:attribute"), so an operation with a spec is benchmarkable without
an entry here. ``--with MODULE`` adds an extension's operations the same way: the module
exports OPERATIONS (descriptors) and PATHS (path classes), as tests/toy_scaled_all_reduce.py
does, and the communicator of the run opens those paths beside the shipped ones.
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from symcomm.operations import OPERATIONS, Operation

from .spec import OpSpec


def _load(reference: str) -> Any:
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _specs(operations: Sequence[Operation]) -> dict[str, OpSpec]:
    """Keyed by the spec's name: one spec may time several operations (moe times moe_dispatch
    and moe_combine together)."""
    specs = (_load(op.bench) for op in operations if op.bench)
    return {spec.name: spec for spec in specs}


# The shipped operations' specs, then whatever extend() registered in this process (the CLI
# calls it once, before parsing, for its --with modules).
SPECS: dict[str, OpSpec] = _specs(OPERATIONS)
NAMES: tuple[str, ...] = tuple(SPECS)  # the shipped ones
# The ops `symcomm-bench baseline` can time: those with one NCCL collective of their own.
BASELINE_NAMES: tuple[str, ...] = tuple(name for name, s in SPECS.items() if s.nccl)


@dataclass(frozen=True)
class Extension:
    """What ``--with`` modules add: their operation descriptors and path classes."""

    modules: tuple[str, ...] = ()
    operations: tuple[Operation, ...] = ()
    paths: tuple[Any, ...] = ()


def extend(modules: Sequence[str]) -> Extension:
    """Imports each module and registers its operations' specs (the CLI's OP then accepts
    them). Raises ValueError naming the module and what it lacks."""
    operations: list[Operation] = []
    paths: list[Any] = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(f"--with {name}: cannot import it ({exc}); is its folder on PYTHONPATH?") from None
        found = getattr(module, "OPERATIONS", None)
        if not found or not all(isinstance(op, Operation) for op in found):
            raise ValueError(f"--with {name}: the module must export OPERATIONS, a sequence of "
                             "symcomm.operations.Operation descriptors")
        # Registering the same module again (a second run in one process) changes nothing.
        clash = [op.name for op in found if op.name in SPECS and (not op.bench or SPECS[op.name] is not _load(op.bench))]
        if clash:
            raise ValueError(f"--with {name}: {', '.join(clash)} is already an operation")
        if not any(op.bench for op in found):
            raise ValueError(f"--with {name}: none of its operations names a benchmark spec (Operation.bench)")
        operations += found
        paths += getattr(module, "PATHS", ())
        SPECS.update(_specs(found))
    return Extension(tuple(modules), tuple(operations), tuple(paths))


def names() -> tuple[str, ...]:
    """Every op the CLI takes now: the shipped ones and those of --with modules."""
    return tuple(SPECS)


def spec(name: str) -> OpSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r} (one of {', '.join(SPECS)})") from None
