"""Loads csrc/'s shared library (plain C ABI, no libtorch) built by setup.py.

Looked up at ``SYMCOMM_NATIVE_LIBRARY``, then inside the package. Missing is not an error:
the caller records why symmetric memory is off and carries on with plain NCCL.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

_c = ctypes


@dataclass(frozen=True)
class Native:
    lib: ctypes.CDLL
    path: str


def library_path() -> str | None:
    if env := os.environ.get("SYMCOMM_NATIVE_LIBRARY"):
        return env
    folder = Path(__file__).resolve().parent / "_native"
    matches = sorted(folder.glob("libsymcomm*.so"))
    return str(matches[0]) if matches else None


def _bind(lib: ctypes.CDLL) -> None:
    sigs = {
        "symcomm_pool_create": ([], _c.c_int),
        "symcomm_pool_add_region": ([_c.c_int, _c.c_size_t, _c.c_size_t], _c.c_int),
        "symcomm_pool_set_active": ([_c.c_int], _c.c_int),
        "symcomm_pool_bytes_in_use": ([_c.c_int], _c.c_size_t),
        "symcomm_pool_live_allocations": ([_c.c_int], _c.c_size_t),
        "symcomm_pool_take_failed_request": ([_c.c_int], _c.c_size_t),
        "symcomm_pool_destroy": ([_c.c_int], None),
        "symcomm_alloc": ([_c.c_size_t, _c.c_int, _c.c_void_p], _c.c_void_p),
        "symcomm_free": ([_c.c_void_p, _c.c_size_t, _c.c_int, _c.c_void_p], None),
    }
    for name, (argtypes, restype) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype


_LOADED: Native | None = None


def bind(signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL:
    """The loaded library with ``signatures`` (name -> (argtypes, restype)) applied.

    Each module that calls into csrc/ declares its own functions here, next to the code that
    uses them, instead of one shared table. Raises OSError as load() does.
    """
    lib = load().lib
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def load() -> Native:
    """The native library, loaded once. Raises OSError with the reason when it is missing."""
    global _LOADED
    if _LOADED is None:
        path = library_path()
        if path is None:
            raise OSError("symcomm's native library was not built (install with nvcc on PATH)")
        lib = ctypes.CDLL(path)
        _bind(lib)
        _LOADED = Native(lib, path)
    return _LOADED
