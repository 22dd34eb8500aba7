"""Loads csrc/'s shared library (plain C ABI, no libtorch) built by setup.py.

csrc/symcomm.h declares the ABI and csrc/symcomm_testing.h the hooks that exist for tests and
measurements; ``SIGNATURES``, ``TESTING_SIGNATURES`` and the argument structs below are their
ctypes twins and the only place Python declares native signatures (tests/test_native_header.py
fails when they disagree). A library built from other sources is refused at load: its
``symcomm_abi_version()`` must be ABI_VERSION.

Looked up at ``SYMCOMM_NATIVE_LIBRARY``, then inside the package. Missing is not an error:
the caller records why symmetric memory is off and carries on with plain NCCL.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from . import build_info, settings
from .errors import CudaError

_c = ctypes
_int, _u32, _u64, _i64, _size = _c.c_int, _c.c_uint32, _c.c_uint64, _c.c_int64, _c.c_size_t
_i32p = _c.POINTER(_c.c_int32)
_f32, _f64, _ptr, _bytes = _c.c_float, _c.c_double, _c.c_void_p, _c.c_char_p
# symcomm.h's typedefs, named here so the table reads like the header.
_status = _dtype = _algo = _quant = _ep_quant = _int
_ar = _stream = _ptr

ABI_VERSION = 15  # symcomm.h's SYMCOMM_ABI_VERSION


class RmsnormArgs(ctypes.Structure):
    """symcomm_rmsnorm_args_t."""

    _fields_ = [("residual", _ptr), ("weight", _ptr), ("dtype", _dtype), ("rows", _i64), ("cols", _i64),
                ("eps", _f32), ("residual_out", _ptr), ("quant", _quant), ("out", _ptr), ("scales", _ptr),
                ("scale_ptr", _ptr), ("scale_value", _f32), ("swizzle", _int)]


class GathervFp4Args(ctypes.Structure):
    """symcomm_gatherv_fp4_args_t."""

    _fields_ = [("x", _ptr), ("dtype", _dtype), ("rows", _i64), ("cols", _i64), ("row_offset", _i64),
                ("total_rows", _i64), ("gs_ptr", _ptr), ("gs_value", _f32), ("payload_slot", _int),
                ("payload_offset", _u64), ("scales_slot", _int), ("scales_offset", _u64), ("nextra", _int),
                ("extra_srcs", _c.POINTER(_u64)), ("extra_slots", _c.POINTER(_int)),
                ("extra_offsets", _c.POINTER(_u64)), ("extra_row_bytes", _c.POINTER(_u64))]


class FlagFreeFp4Args(ctypes.Structure):
    """symcomm_flagfree_fp4_args_t."""

    _fields_ = [("x", _ptr), ("dtype", _dtype), ("cols", _i64), ("rows", _c.POINTER(_i64)), ("gs_ptr", _ptr),
                ("gs_value", _f32), ("payload", _ptr), ("scales", _ptr)]


class EpDispatchArgs(ctypes.Structure):
    """symcomm_ep_dispatch_args_t."""

    _fields_ = [("x", _ptr), ("dtype", _dtype), ("rows", _i64), ("cols", _i64), ("topk_ids", _ptr),
                ("ids_int64", _int), ("weights", _ptr), ("weights_dtype", _dtype), ("topk", _int), ("num_experts", _int), ("max_tokens", _i64), ("align", _int),
                ("capacity", _i64), ("quant", _ep_quant), ("gs_ptr", _ptr), ("gs_value", _f32), ("swizzle", _int),
                ("recv_slot", _int), ("recv_offset", _u64), ("scales_slot", _int), ("scales_offset", _u64),
                ("src_slot", _int), ("src_offset", _u64), ("table_slot", _int), ("table_offset", _u64),
                ("group_slot", _int), ("group_offset", _u64), ("send_rows", _i32p), ("expert_counts", _i32p), ("expert_offsets", _i32p)]


class EpCombineArgs(ctypes.Structure):
    """symcomm_ep_combine_args_t."""

    _fields_ = [("expert_out", _ptr), ("dtype", _dtype), ("cols", _i64), ("capacity", _i64), ("quant", _ep_quant),
                ("recv_group", _i32p), ("num_local", _int),
                ("returned_slot", _int), ("returned_offset", _u64), ("max_tokens", _i64), ("topk", _int),
                ("rows", _i64), ("send_rows", _i32p), ("topk_ids", _ptr), ("ids_int64", _int), ("out", _ptr)]


STRUCTS = {"symcomm_rmsnorm_args_t": RmsnormArgs, "symcomm_gatherv_fp4_args_t": GathervFp4Args,
           "symcomm_flagfree_fp4_args_t": FlagFreeFp4Args,
           "symcomm_ep_dispatch_args_t": EpDispatchArgs, "symcomm_ep_combine_args_t": EpCombineArgs}

# name -> (argtypes, restype), in symcomm.h's order.
SIGNATURES: dict[str, tuple[list, object]] = {
    "symcomm_abi_version": ([], _int),
    "symcomm_set_early_dependents": ([_int], _int),
    # pool_alloc.cc
    "symcomm_pool_create": ([], _int),
    "symcomm_pool_add_region": ([_int, _size, _size], _status),  # base is a uintptr_t
    "symcomm_pool_set_active": ([_int], _int),
    "symcomm_pool_bytes_in_use": ([_int], _size),
    "symcomm_pool_live_allocations": ([_int], _size),
    "symcomm_pool_take_failed_request": ([_int], _size),
    "symcomm_pool_destroy": ([_int], None),
    "symcomm_alloc": ([_size, _int, _stream], _ptr),
    "symcomm_free": ([_ptr, _size, _int, _stream], None),
    # custom_ar.cu
    "symcomm_ar_create": ([_int, _int, _int, _size, _size, _int, _f64, _c.POINTER(_ar)], _status),
    "symcomm_ar_handle": ([_ar, _bytes], _status),
    "symcomm_ar_open": ([_ar, _bytes], _status),
    "symcomm_ar_probe_write": ([_ar, _u32], _status),
    "symcomm_ar_probe_read": ([_ar, _c.POINTER(_u32)], _status),
    "symcomm_ar_buffer_handle": ([_ar, _ptr, _bytes, _c.POINTER(_u64)], _status),
    "symcomm_ar_set_slot": ([_ar, _int, _bytes, _c.POINTER(_u64), _ptr], _status),
    "symcomm_ar_release_slot": ([_ar, _int], _status),
    "symcomm_ar_guard_capture": ([_ar, _stream, _c.POINTER(_u64)], _status),
    "symcomm_ar_take_released": ([_ar, _c.POINTER(_u64), _int, _c.POINTER(_int)], _status),
    "symcomm_ar_order_streams": ([_ar, _stream, _stream], _status),
    "symcomm_ar_alarm": ([_ar, _c.POINTER(_c.POINTER(_u64))], _status),
    "symcomm_ar_export_region": ([_ar, _ptr, _c.POINTER(_int)], _status),
    "symcomm_ar_import_region": ([_ar, _int, _size, _c.POINTER(_ptr)], _status),
    "symcomm_ar_set_slot_ptrs": ([_ar, _int, _c.POINTER(_u64)], _status),
    "symcomm_ar_run": ([_ar, _algo, _dtype, _ptr, _int, _u64, _ptr, _u64, _int, _stream], _status),
    "symcomm_ar_oneshot_in_place": ([_ar, _dtype, _int, _u64, _ptr, _ptr, _u64, _stream], _status),
    "symcomm_ar_twoshot_push": ([_ar, _dtype, _ptr, _ptr, _int, _u64, _ptr, _u64, _stream], _status),
    "symcomm_ar_flagfree_all_gatherv": ([_ar, _dtype, _ptr, _ptr, _c.POINTER(_u64), _stream], _status),
    "symcomm_ar_flagfree_reduce_scatterv": ([_ar, _dtype, _ptr, _ptr, _c.POINTER(_u64), _stream], _status),
    "symcomm_ar_gatherv": ([_ar, _int, _c.POINTER(_u64), _c.POINTER(_int), _c.POINTER(_u64), _c.POINTER(_u64), _u64,
                            _stream], _status),
    "symcomm_ar_gatherv_fp4": ([_ar, _c.POINTER(GathervFp4Args), _stream], _status),
    "symcomm_ar_flagfree_gatherv_fp4": ([_ar, _c.POINTER(FlagFreeFp4Args), _stream], _status),
    "symcomm_ar_reduce_scatterv": ([_ar, _dtype, _ptr, _int, _u64, _u64, _u64, _ptr, _u64, _int, _stream], _status),
    "symcomm_ar_destroy": ([_ar], _status),
    "symcomm_ar_retire": ([_ar], _status),
    "symcomm_cuda_error_string": ([_status], _bytes),
    # fp4.cu
    "symcomm_fp4_quantize": ([_ptr, _dtype, _i64, _i64, _ptr, _f32, _ptr, _ptr, _int, _stream], _status),
    "symcomm_fp4_dequantize": ([_ptr, _ptr, _i64, _i64, _ptr, _f32, _int, _ptr, _dtype, _stream], _status),
    # rmsnorm.cu
    "symcomm_rmsnorm": ([_ptr, _c.POINTER(RmsnormArgs), _stream], _status),
    # ep.cu
    "symcomm_ep_dispatch": ([_ar, _c.POINTER(EpDispatchArgs), _stream], _status),
    "symcomm_ep_combine": ([_ar, _c.POINTER(EpCombineArgs), _stream], _status),
}
# symcomm_testing.h: exported for tests and measurements, not API.
TESTING_SIGNATURES: dict[str, tuple[list, object]] = {
    "symcomm_ar_sim_link": ([_c.POINTER(_ar), _int, _int], _status),
    "symcomm_ar_debug_seed_epochs": ([_ar, _u64], _status),
    "symcomm_ar_debug_meetings": ([_ar, _c.POINTER(_u64)], _status),
    "symcomm_ar_set_overlap": ([_ar, _int], _status),
    "symcomm_ep_debug_dedup_from": ([_ar, _i64], _status),
    "symcomm_fp4_debug_grid": ([_ar, _int, _int, _int], _status),
    "symcomm_debug_late_copy": ([_ptr, _ptr, _u64, _u64, _stream], _status),
    "symcomm_debug_unwaiting_copy": ([_ptr, _ptr, _u64, _stream], _status),
    "symcomm_ar_gatherv_fp4_host": ([_c.POINTER(GathervFp4Args), _ptr, _ptr], _status),
    "symcomm_flagfree_fp4_wire_host": ([_c.POINTER(FlagFreeFp4Args), _int, _int, _ptr, _ptr, _ptr], _status),
    "symcomm_fp4_quantize_host": ([_ptr, _dtype, _i64, _i64, _f32, _ptr, _ptr, _int], _status),
    "symcomm_fp4_dequantize_host": ([_ptr, _ptr, _i64, _i64, _f32, _int, _ptr, _dtype], _status),
    "symcomm_rmsnorm_host": ([_ptr, _c.POINTER(RmsnormArgs)], _status),
    "symcomm_norm_row_parts": ([_i64, _i64, _i64, _ptr, _ptr, _ptr], _int),
    "symcomm_ep_dispatch_host": ([_int, _c.POINTER(EpDispatchArgs), _c.POINTER(_ptr), _c.POINTER(_ptr),
                                  _c.POINTER(_i32p), _c.POINTER(_i32p), _c.POINTER(_i32p)], _status),
    "symcomm_ep_combine_host": ([_int, _c.POINTER(EpCombineArgs), _c.POINTER(_ptr)], _status),
}

# symcomm_dtype_t
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# symcomm_norm_quant_t
NORM_QUANT_CODES = {None: 0, "fp8": 1, "nvfp4": 2}
# symcomm_ep_quant_t
EP_QUANT_CODES = {None: 0, "nvfp4": 1, "fp8": 2}
EP_MAX_EXPERTS, EP_MAX_TOPK = 1024, 32  # SYMCOMM_EP_MAX_EXPERTS, SYMCOMM_EP_MAX_TOPK
SUCCESS = 0


@dataclass(frozen=True)
class Native:
    lib: ctypes.CDLL
    path: str


def library_path() -> str | None:
    if env := settings.native_library():
        return env
    folder = Path(__file__).resolve().parent / "_native"
    matches = sorted(folder.glob("libsymcomm*.so"))
    return str(matches[0]) if matches else None


def bind(lib: ctypes.CDLL, path: str) -> None:
    """Declare every signature on ``lib``; OSError saying why ``lib`` is not usable."""
    table = {**SIGNATURES, **TESTING_SIGNATURES}
    missing = [name for name in table if not hasattr(lib, name)]
    # OSError like a missing library: callers treat both as "native code unavailable".
    if len(missing) == len(table):
        raise OSError(f"{path} is not symcomm's native library: it exports none of its functions "
                      f"(check SYMCOMM_NATIVE_LIBRARY)")
    if "symcomm_abi_version" in missing:
        raise OSError(f"{path} predates symcomm's ABI versioning (this symcomm needs ABI {ABI_VERSION}): rebuild it "
                      f"(pip install -e .)")
    lib.symcomm_abi_version.argtypes, lib.symcomm_abi_version.restype = [], _int
    built = lib.symcomm_abi_version()
    if built != ABI_VERSION:
        raise OSError(f"{path} was built for symcomm ABI {built}, and this symcomm needs ABI {ABI_VERSION}: rebuild "
                      f"it (pip install -e .)")
    if missing:
        raise OSError(f"{path} lacks {len(missing)} of symcomm's functions (first: {missing[0]}) though it says ABI "
                      f"{built}: a broken build; rebuild it (pip install -e .)")
    for name, (argtypes, restype) in table.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype


_LOADED: Native | None = None


def load() -> Native:
    """The native library, loaded once. Raises OSError with the reason when it is missing."""
    global _LOADED
    if _LOADED is None:
        path = library_path()
        if path is None:
            raise OSError(f"symcomm's native library is missing: {build_info.not_built_reason()}")
        lib = ctypes.CDLL(path)
        bind(lib, path)
        _LOADED = Native(lib, path)
    return _LOADED


def check(lib: ctypes.CDLL, what: str, code: int) -> None:
    """Raises CudaError for a symcomm_status_t other than success."""
    if code != SUCCESS:
        raise CudaError(what, code, lib.symcomm_cuda_error_string(code).decode())
