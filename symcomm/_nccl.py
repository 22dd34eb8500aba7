"""ctypes binding to the libnccl.so.2 that torch loaded.

Two NCCL libraries in one process is a bug (each keeps its own proxy threads and cuMem
handles), so the search order prefers the library already mapped into the process:
``SYMCOMM_NCCL_LIBRARY``, then ``/proc/self/maps``, then the ``nvidia/nccl`` wheel, then the
system ``libnccl.so.2``.

Every call returns ``ncclResult_t``; :func:`check` turns a failure into :class:`NcclError`
carrying ``ncclGetErrorString`` and ``ncclGetLastError``. Communicator settings
(``ncclConfig_t``, whose layout depends on the version) come from _nccl_config.py.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import settings
from ._nccl_config import SPLIT_NOCOLOR, CommConfig, ConfigLayout, features, layout_for
from .errors import ArgumentError, CommTimeoutError, DtypeError, NcclError, NcclUnavailableError

# Symmetric windows (ncclCommWindowRegister with NCCL_WIN_COLL_SYMMETRIC) arrived in 2.27.
SYMMETRIC_MIN_VERSION = (2, 27, 0)
# Native fp8 reductions arrived in 2.24 (ncclFloat8e4m3 / ncclFloat8e5m2).
FP8_REDUCE_MIN_VERSION = (2, 24, 0)

NCCL_WIN_COLL_SYMMETRIC = 0x01
UNIQUE_ID_BYTES = 128

RESULT_NAMES = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",  # NCCL >= 2.30
}
IN_PROGRESS = 7

# ncclDataType_t
INT8, UINT8, INT32, UINT32, INT64, UINT64, FLOAT16, FLOAT32, FLOAT64, BFLOAT16 = range(10)
FLOAT8E4M3, FLOAT8E5M2 = 10, 11

DTYPES: dict[torch.dtype, int] = {
    torch.int8: INT8,
    torch.uint8: UINT8,
    torch.int32: INT32,
    torch.int64: INT64,
    torch.float16: FLOAT16,
    torch.float32: FLOAT32,
    torch.float64: FLOAT64,
    torch.bfloat16: BFLOAT16,
    torch.float8_e4m3fn: FLOAT8E4M3,
    torch.float8_e5m2: FLOAT8E5M2,
}

# ncclRedOp_t
REDUCE_OPS: dict[str, int] = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]

    def to_bytes(self) -> bytes:
        return bytes(ctypes.string_at(ctypes.addressof(self), UNIQUE_ID_BYTES))

    @classmethod
    def from_bytes(cls, data: bytes) -> "UniqueId":
        if len(data) != UNIQUE_ID_BYTES:
            raise ValueError(f"an ncclUniqueId is {UNIQUE_ID_BYTES} bytes, got {len(data)}")
        uid = cls()
        ctypes.memmove(ctypes.addressof(uid), data, UNIQUE_ID_BYTES)
        return uid


_c_result = ctypes.c_int
_p = ctypes.c_void_p
_size = ctypes.c_size_t
_int = ctypes.c_int

# name -> argument types. Pointers (comm, window, buffers, stream) travel as void*.
_SIGNATURES: dict[str, list] = {
    "ncclGetVersion": [ctypes.POINTER(_int)],
    "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
    "ncclCommInitRank": [ctypes.POINTER(_p), _int, UniqueId, _int],
    # comm*, nranks, id, rank, config* (the config's struct type depends on the version: void*)
    "ncclCommInitRankConfig": [ctypes.POINTER(_p), _int, UniqueId, _int, _p],
    # parent, color, key, newcomm*, config*
    "ncclCommSplit": [_p, _int, _int, ctypes.POINTER(_p), _p],
    "ncclCommGetAsyncError": [_p, ctypes.POINTER(_int)],
    "ncclCommDestroy": [_p],
    "ncclCommAbort": [_p],
    "ncclGroupStart": [],
    "ncclGroupEnd": [],
    # sendbuff, recvbuff, count, datatype, op, comm, stream
    "ncclAllReduce": [_p, _p, _size, _int, _int, _p, _p],
    # sendbuff, recvbuff, sendcount, datatype, comm, stream
    "ncclAllGather": [_p, _p, _size, _int, _p, _p],
    # sendbuff, recvbuff, recvcount, datatype, op, comm, stream
    "ncclReduceScatter": [_p, _p, _size, _int, _int, _p, _p],
    # sendbuff, recvbuff, count, datatype, root, comm, stream
    "ncclBroadcast": [_p, _p, _size, _int, _int, _p, _p],
    # sendbuff, recvbuff, count, datatype, op, root, comm, stream
    "ncclReduce": [_p, _p, _size, _int, _int, _int, _p, _p],
    # buff, count, datatype, peer, comm, stream
    "ncclSend": [_p, _size, _int, _int, _p, _p],
    "ncclRecv": [_p, _size, _int, _int, _p, _p],
    "ncclMemAlloc": [ctypes.POINTER(_p), _size],
    "ncclMemFree": [_p],
}
# Present only in NCCL >= 2.27; looked up lazily so older libraries still load.
_OPTIONAL = {
    "ncclCommWindowRegister": [_p, _p, _size, ctypes.POINTER(_p), _int],
    "ncclCommWindowDeregister": [_p, _p],
    # comm, ncclCommMemStat_t, uint64_t* (NCCL >= 2.29.7)
    "ncclCommMemStats": [_p, _int, ctypes.POINTER(ctypes.c_uint64)],
}
# ncclCommMemStat_t, in its order
MEM_STATS = ("suspendable_bytes", "suspended", "persistent_bytes", "total_bytes")


def _mapped_nccl() -> str | None:
    """The libnccl already mapped into this process (torch loaded it), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "/libnccl.so" in path and os.path.exists(path):
                    return path
    except OSError:
        pass
    return None


def _wheel_nccl() -> str | None:
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(root) / "nccl" / "lib" / "libnccl.so.2"
        if candidate.exists():
            return str(candidate)
    return None


def candidate_paths() -> list[tuple[str, str]]:
    """(source, path) pairs in the order the loader tries them."""
    found = []
    if env := settings.nccl_library():
        found.append(("SYMCOMM_NCCL_LIBRARY", env))
    if mapped := _mapped_nccl():
        found.append(("already loaded", mapped))
    if wheel := _wheel_nccl():
        found.append(("nvidia-nccl wheel", wheel))
    found.append(("system", "libnccl.so.2"))
    return found


def parse_version(code: int) -> tuple[int, int, int]:
    # NCCL >= 2.9 encodes MAJOR*10000 + MINOR*100 + PATCH; older ones MAJOR*1000 + MINOR*100.
    if code >= 10000:
        return code // 10000, (code % 10000) // 100, code % 100
    return code // 1000, (code % 1000) // 100, code % 100


@dataclass(frozen=True)
class Library:
    """A loaded libnccl: the CDLL, where it came from, and its version."""

    lib: ctypes.CDLL
    path: str
    source: str
    version: tuple[int, int, int]

    @property
    def has_windows(self) -> bool:
        return self.version >= SYMMETRIC_MIN_VERSION and hasattr(self.lib, "ncclCommWindowRegister")

    @property
    def version_string(self) -> str:
        return ".".join(map(str, self.version))

    @property
    def features(self) -> dict[str, bool]:
        """Version-dependent behaviour, by name (symcomm._nccl_config.FEATURES says where each
        was read)."""
        return features(self.version, self.lib)

    @property
    def config_layout(self) -> ConfigLayout | None:
        """The ncclConfig_t layout a CommConfig is built in for this NCCL, or None."""
        return layout_for(self.version)

    def error_string(self, code: int) -> str:
        return self.lib.ncclGetErrorString(code).decode(errors="replace")

    def last_error(self, comm: int | None = None) -> str:
        raw = self.lib.ncclGetLastError(comm)
        return raw.decode(errors="replace") if raw else ""

    def check(self, call: str, code: int, comm: int | None = None) -> None:
        if code != 0:
            raise NcclError(call, code, RESULT_NAMES.get(code, "unknown"),
                            self.error_string(code), self.last_error(comm))

    # Typed wrappers for the setup-time calls. The per-call collectives are invoked through
    # ``lib`` directly by the backends, where every attribute lookup is on the hot path.
    def get_unique_id(self) -> UniqueId:
        uid = UniqueId()
        self.check("ncclGetUniqueId", self.lib.ncclGetUniqueId(ctypes.byref(uid)))
        return uid

    def comm_init_rank(self, world_size: int, uid: UniqueId, rank: int,
                       config: CommConfig | None = None) -> int:
        """Collective: a new communicator. Without ``config``, plain ncclCommInitRank; with one,
        ncclCommInitRankConfig with the struct of this NCCL's layout (ArgumentError, before any
        communication, for a field this NCCL lacks). A ``blocking=False`` config returns a
        communicator that may still be connecting: pass it to :meth:`comm_wait_ready`."""
        handle = _p()
        if config is None:
            self.check("ncclCommInitRank",
                       self.lib.ncclCommInitRank(ctypes.byref(handle), world_size, uid, rank))
            return handle.value
        struct = config.build(self.version)
        code = self.lib.ncclCommInitRankConfig(ctypes.byref(handle), world_size, uid, rank,
                                               ctypes.byref(struct))
        self._check_started("ncclCommInitRankConfig", code, config, handle.value)
        return handle.value

    def comm_split(self, parent: int, color: int | None, key: int,
                   config: CommConfig | None = None) -> int:
        """Collective over ``parent``: the ranks that pass the same ``color`` form a child
        communicator, ordered by ``key``; ``color=None`` joins none and returns 0. Without
        ``config`` the child copies the parent's. The child shares the parent's buffers only if
        the *parent* was created with ``split_share=True``."""
        if color is not None and (isinstance(color, bool) or not isinstance(color, int) or color < 0):
            raise ArgumentError(f"color must be a non-negative int or None, got {color!r}")
        if isinstance(key, bool) or not isinstance(key, int):
            raise ArgumentError(f"key must be an int, got {key!r}")
        struct = config.build(self.version) if config is not None else None
        handle = _p()
        code = self.lib.ncclCommSplit(parent, SPLIT_NOCOLOR if color is None else color, key,
                                      ctypes.byref(handle),
                                      ctypes.byref(struct) if struct is not None else None)
        self._check_started("ncclCommSplit", code, config, parent)
        return handle.value or 0

    def _check_started(self, call: str, code: int, config: CommConfig | None, comm: int) -> None:
        # A non-blocking init answers ncclInProgress; anything else non-zero is a failure.
        if code == IN_PROGRESS and config is not None and config.blocking is False:
            return
        self.check(call, code, comm)

    def comm_wait_ready(self, comm: int, timeout_s: float, poll_s: float = 0.001) -> None:
        """Wait for a non-blocking communicator to finish connecting, at most ``timeout_s``.
        On timeout the communicator is aborted (its memory freed) and CommTimeoutError raised."""
        state = _int(IN_PROGRESS)
        deadline = time.monotonic() + timeout_s
        while True:
            self.check("ncclCommGetAsyncError",
                       self.lib.ncclCommGetAsyncError(comm, ctypes.byref(state)), comm)
            if state.value != IN_PROGRESS:
                self.check("ncclCommGetAsyncError (communicator setup)", state.value, comm)
                return
            if time.monotonic() >= deadline:
                self.comm_abort(comm)
                raise CommTimeoutError(f"NCCL communicator setup did not finish within {timeout_s:.0f} s "
                                       f"(a peer is missing or stuck); it was aborted")
            time.sleep(poll_s)

    def comm_mem_stats(self, comm: int) -> dict[str, int] | None:
        """NCCL's own account of the device memory ``comm`` holds (ncclCommMemStats, NCCL >=
        2.29.7), or None where this NCCL has no such call."""
        if not self.features["comm_mem_stats"]:
            return None
        stats = {}
        for code, name in enumerate(MEM_STATS):
            value = ctypes.c_uint64()
            self.check("ncclCommMemStats", self.lib.ncclCommMemStats(comm, code, ctypes.byref(value)), comm)
            stats[name] = value.value
        return stats

    def comm_destroy(self, comm: int) -> None:
        self.check("ncclCommDestroy", self.lib.ncclCommDestroy(comm))

    def comm_abort(self, comm: int) -> None:
        self.check("ncclCommAbort", self.lib.ncclCommAbort(comm))

    def mem_alloc(self, nbytes: int) -> int:
        ptr = _p()
        self.check("ncclMemAlloc", self.lib.ncclMemAlloc(ctypes.byref(ptr), nbytes))
        return ptr.value

    def mem_free(self, ptr: int) -> None:
        self.check("ncclMemFree", self.lib.ncclMemFree(ptr))

    def window_register(self, comm: int, ptr: int, nbytes: int) -> int:
        """Collective: every rank registers the same size, in the same order."""
        win = _p()
        self.check("ncclCommWindowRegister",
                   self.lib.ncclCommWindowRegister(comm, ptr, nbytes, ctypes.byref(win),
                                                   NCCL_WIN_COLL_SYMMETRIC), comm)
        return win.value

    def window_deregister(self, comm: int, win: int) -> None:
        self.check("ncclCommWindowDeregister", self.lib.ncclCommWindowDeregister(comm, win), comm)

    def group_start(self) -> None:
        self.check("ncclGroupStart", self.lib.ncclGroupStart())

    def group_end(self) -> None:
        self.check("ncclGroupEnd", self.lib.ncclGroupEnd())


def _bind(lib: ctypes.CDLL) -> None:
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, _c_result
    for name, argtypes in _OPTIONAL.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, _c_result
    lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [_int], ctypes.c_char_p
    lib.ncclGetLastError.argtypes, lib.ncclGetLastError.restype = [_p], ctypes.c_char_p


_LOADED: Library | None = None


def load() -> Library:
    """Load (once per process) and bind the NCCL that torch uses. Raises NcclUnavailableError."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    tried = []
    for source, path in candidate_paths():
        try:
            lib = ctypes.CDLL(path)
            _bind(lib)
        except (OSError, AttributeError) as exc:
            tried.append(f"{source} {path}: {exc}")
            continue
        code = _int()
        if lib.ncclGetVersion(ctypes.byref(code)) != 0:
            tried.append(f"{source} {path}: ncclGetVersion failed")
            continue
        _LOADED = Library(lib, path, source, parse_version(code.value))
        return _LOADED
    raise NcclUnavailableError("no usable libnccl.so.2; tried: " + "; ".join(tried))


def reduce_dtype(dtype: torch.dtype, version: tuple[int, int, int]) -> int:
    """NCCL datatype for a reduction (all_reduce, reduce_scatter) over ``dtype``."""
    code = DTYPES.get(dtype)
    if code is None or (code >= FLOAT8E4M3 and version < FP8_REDUCE_MIN_VERSION):
        raise DtypeError(f"dtype {dtype} cannot be reduced by NCCL {'.'.join(map(str, version))}; "
                         f"supported: {', '.join(str(d) for d in DTYPES)}")
    return code
