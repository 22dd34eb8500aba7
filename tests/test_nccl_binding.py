"""The ctypes binding's pure logic: versions, lookup order, ids, dtypes, error mapping."""
from __future__ import annotations

import pytest
import torch

from symcomm import _nccl
from symcomm.errors import DtypeError, NcclError, NcclUnavailableError


def test_version_codes():
    assert _nccl.parse_version(22809) == (2, 28, 9)
    assert _nccl.parse_version(22700) == (2, 27, 0)
    assert _nccl.parse_version(2804) == (2, 8, 4)  # pre-2.9 encoding


def test_lookup_order_env_first(monkeypatch):
    monkeypatch.setenv("SYMCOMM_NCCL_LIBRARY", "/opt/custom/libnccl.so.2")
    paths = _nccl.candidate_paths()
    assert paths[0] == ("SYMCOMM_NCCL_LIBRARY", "/opt/custom/libnccl.so.2")
    assert paths[-1] == ("system", "libnccl.so.2")


def test_missing_library_names_every_attempt(monkeypatch):
    monkeypatch.setattr(_nccl, "_LOADED", None)
    monkeypatch.setattr(_nccl, "candidate_paths", lambda: [("test", "/nonexistent/libnccl.so.2")])
    with pytest.raises(NcclUnavailableError, match="/nonexistent/libnccl.so.2"):
        _nccl.load()


def test_unique_id_round_trip():
    raw = bytes(range(128))
    assert _nccl.UniqueId.from_bytes(raw).to_bytes() == raw
    with pytest.raises(ValueError, match="128 bytes"):
        _nccl.UniqueId.from_bytes(b"short")


def test_reduce_dtypes():
    version = (2, 28, 9)
    assert _nccl.reduce_dtype(torch.bfloat16, version) == _nccl.BFLOAT16
    assert _nccl.reduce_dtype(torch.float8_e4m3fn, version) == _nccl.FLOAT8E4M3
    with pytest.raises(DtypeError, match="cannot be reduced by NCCL 2.23"):
        _nccl.reduce_dtype(torch.float8_e5m2, (2, 23, 4))
    with pytest.raises(DtypeError, match="complex64"):
        _nccl.reduce_dtype(torch.complex64, version)
    # Every dtype the issue lists maps to a distinct NCCL type.
    wanted = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.int8, torch.uint8, torch.int32, torch.int64]
    assert len({_nccl.DTYPES[d] for d in wanted}) == len(wanted)


class _FakeLib:
    """Stands in for libnccl's two error-reporting calls."""

    def ncclGetErrorString(self, code):
        return b"invalid usage (run with NCCL_DEBUG=WARN for details)"

    def ncclGetLastError(self, comm):
        return b"ncclAllReduce: invalid root"


def test_failures_become_nccl_errors_with_both_messages():
    lib = _nccl.Library(_FakeLib(), "/fake", "test", (2, 28, 9))
    lib.check("ncclAllReduce", 0)  # success is silent
    with pytest.raises(NcclError) as info:
        lib.check("ncclAllReduce", 5)
    err = info.value
    assert (err.code, err.name, err.call) == (5, "ncclInvalidUsage", "ncclAllReduce")
    assert "invalid usage" in str(err) and "invalid root" in str(err)
    assert not lib.has_windows  # the fake has no ncclCommWindowRegister
