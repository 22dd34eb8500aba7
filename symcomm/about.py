"""What this install of symcomm has here, one line per part: the native library (built, or why
not), torch, the devices, NCCL. ``python -m symcomm`` prints them all and symcomm-bench's
preamble carries the native library's. Reports only: nothing here raises.
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import __version__, _nccl, _native, build_info, settings
from .errors import NcclUnavailableError


def native_line() -> str:
    """Which native library this process loads, or why there is none."""
    path = _native.library_path()
    if path is None:
        return f"native library: none: {build_info.not_built_reason()}"
    try:
        _native.load()
    except OSError as exc:
        return f"native library: {path} does not load: {exc}"
    if settings.native_library():
        return f"native library: {path} (from SYMCOMM_NATIVE_LIBRARY)"
    record = build_info.build_record() or {}
    if record.get("built"):
        return (f"native library: built with nvcc {record.get('nvcc_release')} from {record.get('found_in')}, "
                f"{build_info.archs(record.get('archs', ''))}: {path}")
    return f"native library: {path} (no build record beside it)"


def torch_line() -> str:
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
    return f"torch: {torch.__version__} ({build})"


def devices_line() -> str:
    if not torch.cuda.is_available():
        return ("devices: no CUDA device visible: Communicators run on the CPU over gloo, "
                "symcomm-bench too")
    count = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    return f"devices: {count} CUDA: {', '.join(names)}"


def nccl_line() -> str:
    if torch.version.cuda is None and not settings.nccl_library():
        return "NCCL: not used (torch is a CPU build; collectives run over torch.distributed)"
    try:
        lib = _nccl.load()
    except NcclUnavailableError as exc:
        return f"NCCL: none: {exc}"
    return f"NCCL: {lib.version_string} ({lib.source}: {lib.path})"


def lines() -> list[str]:
    return [f"symcomm {__version__} at {Path(__file__).resolve().parent}", native_line(), torch_line(),
            devices_line(), nccl_line()]
