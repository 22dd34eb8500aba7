"""The normalisation's FP8 output (csrc/rmsnorm.cuh, fp8_byte) uses the GPU's conversion
instruction on the device and csrc/fp4.cuh's e4m3_saturate on the host, which the torch
reference and the host entry points follow. Bit equality between the two is what lets the
device keep the host's bytes, so it is checked for every one of the 2^32 fp32 patterns (NaNs,
infinities, subnormals and ties included), on the GPU.

The check compiles a small kernel with CuPy (on the GPU image); without CuPy it skips, and
fails under SYMCOMM_REQUIRE_GPU=1 like every GPU skip.
"""
from __future__ import annotations

import os
import pathlib

import pytest

CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc"

_KERNEL = r"""
#include "rmsnorm.cuh"
extern "C" __global__ void count_mismatches(unsigned long long first, unsigned long long count,
                                            unsigned long long* mismatches, unsigned int* example) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
    const unsigned int bits = (unsigned int)(first + i);
    const float v = __uint_as_float(bits);
    if (symcomm::norm::fp8_byte(v) != symcomm::fp4::e4m3_saturate(v)) {
      atomicAdd(mismatches, 1ull);
      atomicMin(example, bits);
    }
  }
}
"""


def _cupy():
    try:
        import cupy
    except ImportError as exc:
        if os.environ.get("SYMCOMM_REQUIRE_GPU") == "1":
            pytest.fail(f"SYMCOMM_REQUIRE_GPU=1 but CuPy is missing: {exc}")
        pytest.skip(f"CuPy is needed to compile the check: {exc}")
    return cupy


def test_device_fp8_byte_equals_the_host_rounding_for_every_fp32():
    cupy = _cupy()
    module = cupy.RawModule(code=_KERNEL, backend="nvcc",
                            options=("-std=c++17", f"-I{CSRC}", "-arch=sm_90"))
    kernel = module.get_function("count_mismatches")
    mismatches = cupy.zeros(1, dtype=cupy.uint64)
    example = cupy.full(1, 0xFFFFFFFF, dtype=cupy.uint32)
    chunk = 1 << 30
    for first in range(0, 1 << 32, chunk):
        kernel((4096,), (256,), (cupy.uint64(first), cupy.uint64(chunk), mismatches, example))
    cupy.cuda.runtime.deviceSynchronize()
    assert int(mismatches[0]) == 0, f"{int(mismatches[0])} patterns differ, the lowest 0x{int(example[0]):08x}"


def test_the_check_sees_a_difference():
    """The same kernel against a rounding that truncates instead: it must find mismatches, or
    the check above could pass without comparing anything."""
    cupy = _cupy()
    wrong = _KERNEL.replace("symcomm::fp4::e4m3_saturate(v)", "(unsigned char)(symcomm::fp4::e4m3_saturate(v) & 0xFE)")
    module = cupy.RawModule(code=wrong, backend="nvcc", options=("-std=c++17", f"-I{CSRC}", "-arch=sm_90"))
    mismatches = cupy.zeros(1, dtype=cupy.uint64)
    example = cupy.full(1, 0xFFFFFFFF, dtype=cupy.uint32)
    module.get_function("count_mismatches")((256,), (256,), (cupy.uint64(0x3F800000), cupy.uint64(1 << 20),
                                                              mismatches, example))
    cupy.cuda.runtime.deviceSynchronize()
    assert int(mismatches[0]) > 0
