"""Every environment variable symcomm reads, read here and nowhere else.

Each setting is read when it is needed (not at import), so a test or a launcher that sets a
variable before building a Communicator is heard. ``VARIABLES`` is the list the README's
settings table must match (tests/test_structure.py compares them).
"""
from __future__ import annotations

import math
import numbers
import os
from typing import NamedTuple

from .errors import ArgumentError, shown

# The bound on waits on peers where no process group says otherwise (the benchmarks' own NCCL
# communicators): generous against a healthy peer (NCCL init takes seconds), short enough that
# a dead one is reported while someone is still watching. A Communicator defaults to its
# group's own timeout instead (validate.group_timeout_s).
DEFAULT_TIMEOUT_S = 30.0
# The largest timeout symcomm accepts: a week. Every consumer holds it: the kernels count
# nanoseconds in 64 bits (584 years), threading and sockets take any finite float, and a
# timedelta a billion days. A longer wait is no bound a person would watch for.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

VARIABLES: dict[str, str] = {
    "SYMCOMM_CHECK": "1 (or true/yes/on) turns check mode on: every call is compared across ranks before it runs (what is compared: Errors)",
    "SYMCOMM_TIMEOUT_S": "bound in seconds (> 0, at most a week) on symcomm's waits on peers (what it bounds: Errors); default: the process group's timeout",
    "SYMCOMM_DISABLE_CUSTOM_AR": "1 (or true/yes/on) turns off symcomm's peer-memory kernels: the all-reduce kernels, custom-push, fused-flagfree and fused-push (FP4), peer-push (MoE)",
    "SYMCOMM_TUNING_FILE": "dispatch table to load (written by `symcomm-bench tune`)",
    "SYMCOMM_NCCL_LIBRARY": "libnccl to load; otherwise the one torch loaded, then the `nvidia-nccl` wheel, then the system's",
    "SYMCOMM_NATIVE_LIBRARY": "csrc/ library to load instead of the packaged one",
    "SYMCOMM_CUDA_ARCHS": "nvcc `-gencode` flags at build time (read by setup.py; default sm_90 + compute_90 PTX; `none` builds no kernels)",
    "CUDA_HOME, CUDA_PATH": "read by setup.py: where it looks for nvcc first, before PATH ([docs/install.md](docs/install.md))",
    "SYMCOMM_BENCH_CORRUPT": "symcomm-bench test hook: the rank it names (a number) spoils one output element, so #wrong must count it",
    "SYMCOMM_BENCH_DEBUG": "1 (or true/yes/on): symcomm-bench prints the traceback of a failure, not just its one line",
    "PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF": "torch's (the second its newer name), read only: expandable segments have no CUDA IPC handle, so captured inputs there are staged",
    "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE": "set by torchrun; symcomm-bench joins that world instead of launching its own",
    "PYTHONPATH": "Python's own, read by symcomm-bench's launcher to extend it so its ranks import this same symcomm",
}


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _flag(name: str) -> bool:
    """A boolean variable: 1/true/yes/on or 0/false/no/off (any case); unset is false. Any other
    value is an error, not silently false."""
    raw = _get(name)
    if raw is None:
        return False
    word = raw.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ArgumentError(f"{name} must be one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}, got {raw!r}")


def check_mode() -> bool:
    return _flag("SYMCOMM_CHECK")


def checked_timeout(value: object, name: str) -> float:
    """The one rule for every timeout symcomm takes, from an argument or a variable: a finite
    number of seconds, > 0 and at most MAX_TIMEOUT_S. ``name`` is what the error calls it."""
    rule = f"{name} must be a finite number of seconds > 0 and <= {MAX_TIMEOUT_S:g} (a week), got {shown(value)}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # a NumPy scalar too
        raise ArgumentError(rule)
    try:
        seconds = float(value)
    except OverflowError:  # an int past float's range
        raise ArgumentError(rule) from None
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
        raise ArgumentError(rule)
    return seconds


def timeout_s(default: float | None = DEFAULT_TIMEOUT_S) -> float | None:
    """SYMCOMM_TIMEOUT_S under checked_timeout's rule, or ``default`` where it is unset."""
    raw = _get("SYMCOMM_TIMEOUT_S")
    if raw is None:
        return default
    try:
        number = float(raw)
    except ValueError:
        number = None  # not a number: refused below, naming the text as given
    return checked_timeout(raw if number is None else number, "SYMCOMM_TIMEOUT_S")


def custom_kernels_disabled() -> bool:
    return _flag("SYMCOMM_DISABLE_CUSTOM_AR")


def tuning_file() -> str | None:
    return _get("SYMCOMM_TUNING_FILE")


def nccl_library() -> str | None:
    return _get("SYMCOMM_NCCL_LIBRARY")


def native_library() -> str | None:
    return _get("SYMCOMM_NATIVE_LIBRARY")


def bench_corrupt_rank() -> str | None:
    return _get("SYMCOMM_BENCH_CORRUPT")


def bench_debug() -> bool:
    return _flag("SYMCOMM_BENCH_DEBUG")


def torch_allocator_conf() -> str:
    """torch's allocator settings, lower-cased without spaces ("" when unset)."""
    conf = ",".join(os.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return conf.replace(" ", "").lower()


class Launcher(NamedTuple):
    rank: int
    world_size: int
    local_rank: int


def launcher() -> Launcher | None:
    """The rank this process was started as by torchrun (or symcomm-bench's own launcher), or
    None when no launcher set RANK and WORLD_SIZE."""
    rank, world = _get("RANK"), _get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    local = _get("LOCAL_RANK")
    return Launcher(int(rank), int(world), int(local) if local is not None else int(rank))


def local_world_size() -> int | None:
    """LOCAL_WORLD_SIZE: how many ranks the launcher started on this machine (torchrun and
    symcomm-bench's own launcher set it), or None where it did not say."""
    value = _get("LOCAL_WORLD_SIZE")
    return int(value) if value is not None else None


def python_path() -> str | None:
    """PYTHONPATH (Python's own), which a launcher extends so its ranks import the same package."""
    return _get("PYTHONPATH")


def child_environment(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment plus ``extra``, for ranks that a launcher starts."""
    return {**os.environ, **extra}


def export(values: dict[str, str]) -> None:
    """Set variables in this process (the bench's single-rank run sets the launcher's)."""
    os.environ.update(values)
