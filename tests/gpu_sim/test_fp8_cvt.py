"""FP8 on the device (csrc/fp8.cuh, used by the normalisation's FP8 output and the EP FP8
dispatch and combine) uses the GPU's conversion instructions, and csrc/fp4.cuh's e4m3_saturate /
e4m3_value on the host, which the torch references and the host entry points follow. Bit
equality between the two is what lets the device keep the host's bytes, so it is checked for
every one of the 2^32 fp32 patterns (NaNs, infinities, subnormals and ties included), and every
code at 2^24 scales the other way, on the GPU.

The checks compile small kernels with nvcc in the library's floating-point mode (subnormals kept:
CuPy's own compilation adds -ftz=true, which flushes them in every fp32 instruction) and run them
through CuPy; without nvcc or CuPy they skip, and fail under SYMCOMM_REQUIRE_GPU=1 like every GPU
skip.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

from _sim import cannot_run

CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc"

_KERNEL = r"""
#include "fp8.cuh"
extern "C" __global__ void count_mismatches(unsigned long long first, unsigned long long count,
                                            unsigned long long* mismatches, unsigned int* example) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
    const unsigned int bits = (unsigned int)(first + i);
    const float v = __uint_as_float(bits);
    if (symcomm::fp8::byte(v) != symcomm::fp4::e4m3_saturate(v)) {
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
        cannot_run(f"CuPy is needed to run the check: {exc}")
    return cupy


def _nvcc() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found = shutil.which("nvcc") or shutil.which(os.path.join(home, "bin", "nvcc"))
    if found is None:
        cannot_run("nvcc is needed to compile the check")
    return found


def _module(code: str, folder: pathlib.Path):
    """``code`` compiled as the library's units are (-O3, setup.py's sm_90 code and compute_90
    PTX, no -ftz) into ``folder``, which must outlive the module (CuPy loads the file when a
    function is first asked for)."""
    cupy = _cupy()
    source, binary = folder / "check.cu", folder / "check.fatbin"
    source.write_text(code)
    built = subprocess.run([_nvcc(), "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90",
                            "-gencode=arch=compute_90,code=compute_90", "-fatbin", f"-I{CSRC}", "-o", str(binary),
                            str(source)], capture_output=True, text=True)
    assert built.returncode == 0, f"nvcc could not compile the check:\n{built.stderr}"
    return cupy.RawModule(path=str(binary))


def test_device_fp8_byte_equals_the_host_rounding_for_every_fp32(tmp_path):
    cupy = _cupy()
    module = _module(_KERNEL, tmp_path)
    kernel = module.get_function("count_mismatches")
    mismatches = cupy.zeros(1, dtype=cupy.uint64)
    example = cupy.full(1, 0xFFFFFFFF, dtype=cupy.uint32)
    chunk = 1 << 30
    for first in range(0, 1 << 32, chunk):
        kernel((4096,), (256,), (cupy.uint64(first), cupy.uint64(chunk), mismatches, example))
    cupy.cuda.runtime.deviceSynchronize()
    assert int(mismatches[0]) == 0, f"{int(mismatches[0])} patterns differ, the lowest 0x{int(example[0]):08x}"


def test_the_check_sees_a_difference(tmp_path):
    """The same kernel against a rounding that truncates instead: it must find mismatches, or
    the check above could pass without comparing anything."""
    cupy = _cupy()
    wrong = _KERNEL.replace("symcomm::fp4::e4m3_saturate(v)", "(unsigned char)(symcomm::fp4::e4m3_saturate(v) & 0xFE)")
    assert wrong != _KERNEL
    module = _module(wrong, tmp_path)
    mismatches = cupy.zeros(1, dtype=cupy.uint64)
    example = cupy.full(1, 0xFFFFFFFF, dtype=cupy.uint32)
    module.get_function("count_mismatches")((256,), (256,), (cupy.uint64(0x3F800000), cupy.uint64(1 << 20),
                                                              mismatches, example))
    cupy.cuda.runtime.deviceSynchronize()
    assert int(mismatches[0]) > 0


# fp8.cuh's device encode8 multiplies by the scale's reciprocal and divides only where the
# product could round to another byte than the quotient. Checked here against the division for
# every fp32 pattern, eight consecutive patterns per vector, at scales with a normal reciprocal
# (the fast path) and without one (everything divides).
_FAST_KERNEL = r"""
#include "fp8.cuh"
extern "C" __global__ void encode8_mismatches(float scale, unsigned long long first, unsigned long long vectors,
                                              unsigned long long* mismatches, unsigned int* example,
                                              unsigned long long* divided) {
  const symcomm::fp8::Scale s = symcomm::fp8::scale_of(scale);
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long v = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; v < vectors; v += stride) {
    float y[8];
    bool any = false;
    for (int k = 0; k < 8; ++k) {
      y[k] = __uint_as_float((unsigned int)(first + v * 8 + k));
      any |= symcomm::fp8::needs_division(__fmul_rn(y[k], s.inv));
    }
    if (any || !s.fast) atomicAdd(divided, 1ull);
    unsigned int words[2];
    symcomm::fp8::encode8(y, s, words);
    for (int k = 0; k < 8; ++k) {
      const unsigned char got = (unsigned char)(words[k >> 2] >> ((k & 3) * 8));
      if (got != symcomm::fp4::e4m3_saturate(__fdiv_rn(y[k], scale))) {
        atomicAdd(mismatches, 1ull);
        atomicMin(example, __float_as_uint(y[k]));
      }
    }
  }
}
"""

# 2^-5 (the norm tests' scale), 448 / 6, values with long mantissas, extreme but normal
# reciprocals, a subnormal scale with a normal reciprocal (an EP block's amax / 448 can be one),
# and three without one (fp32 subnormal scale, huge scale, FLT_MAX).
FP8_SCALES = (2.0 ** -5, 448.0 / 6, 0.37, 1.7e-5, 6.5e4, 1e-30, 1.1e-38, 2.0 ** -130, 3.0e38,
              3.4028234663852886e38)


def _encode8_run(code: str, scale: float, folder: pathlib.Path) -> tuple[int, int, float]:
    """(values whose byte differs from the division's, the lowest such pattern, the share of
    vectors that divided) over every fp32 pattern at ``scale``."""
    cupy = _cupy()
    kernel = _module(code, folder).get_function("encode8_mismatches")
    mismatches = cupy.zeros(1, dtype=cupy.uint64)
    divided = cupy.zeros(1, dtype=cupy.uint64)
    example = cupy.full(1, 0xFFFFFFFF, dtype=cupy.uint32)
    chunk = 1 << 30
    for first in range(0, 1 << 32, chunk):
        kernel((4096,), (256,), (cupy.float32(scale), cupy.uint64(first), cupy.uint64(chunk // 8), mismatches, example,
                                 divided))
    cupy.cuda.runtime.deviceSynchronize()
    return int(mismatches[0]), int(example[0]), int(divided[0]) / (1 << 29)


@pytest.mark.parametrize("scale", FP8_SCALES)
def test_device_fp8_encode8_equals_division_for_every_fp32(scale, tmp_path):
    count, example, share = _encode8_run(_FAST_KERNEL, scale, tmp_path)
    assert count == 0, f"{count} values differ, the lowest pattern 0x{example:08x}"
    # The fast path must be what runs for most vectors when the reciprocal is normal (NaNs, tiny
    # and huge values divide): else this test would compare the division with itself.
    inv = 1.0 / float(_cupy().float32(scale))  # the fp32 scale's reciprocal, unrounded
    fast = 2.0 ** -126 <= inv < 2.0 ** 128
    assert share < 0.1 if fast else share == 1.0, share


# An encoder that never divides: the product's byte, as encode8 without its fallback.
_PRODUCT_ONLY = r"""
__device__ void product_only(const float (&y)[8], const symcomm::fp8::Scale& s, unsigned int (&words)[2]) {
  words[0] = words[1] = 0u;
  for (int k = 0; k < 8; ++k) words[k >> 2] |= (unsigned int)symcomm::fp8::byte(__fmul_rn(y[k], s.inv)) << ((k & 3) * 8);
}
"""


def test_the_encode8_check_sees_a_difference(tmp_path):
    """The product alone must give other bytes than the division somewhere (at a scale whose
    reciprocal is inexact), or the check above could not tell encode8 from it."""
    naive = _FAST_KERNEL.replace('extern "C"', _PRODUCT_ONLY + 'extern "C"', 1)
    naive = naive.replace("symcomm::fp8::encode8(y, s, words);", "product_only(y, s, words);")
    assert "product_only(y, s, words);" in naive
    count, _, _ = _encode8_run(naive, 448.0 / 6, tmp_path)
    assert count > 0


# fp8.cuh's device decode8 (through fp16) against the host's e4m3_value(code) * scale: every code,
# as both bytes of a pair, at 2^24 scales: scale index i has the fp32 pattern i << 8 | (91 i mod
# 256), so every sign and exponent with 2^15 mantissas each, including +-0, +-inf, 1.0 and every
# power of two (i a multiple of 2^15), subnormals and NaNs. Bitwise, except that a NaN only has to
# be a NaN.
_DECODE_KERNEL = r"""
#include "fp8.cuh"
extern "C" __global__ void decode8_mismatches(unsigned long long* mismatches, unsigned int* example) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 24) * 128;
       i += stride) {
    const unsigned int index = (unsigned int)(i >> 7);
    const float scale = __uint_as_float(index << 8 | ((index * 0x5Bu) & 0xFFu));
    const unsigned int lo = (unsigned int)(i & 127) * 2, hi = lo + 1;  // the pair (lo, hi), then (hi, lo)
    const unsigned int pair = lo | hi << 8 | hi << 16 | lo << 24;
    float y[8];
    symcomm::fp8::decode8(make_uint2(pair, pair ^ 0x80808080u), scale, y);
    for (int k = 0; k < 8; ++k) {
      const unsigned int word = k < 4 ? pair : pair ^ 0x80808080u;
      const unsigned char code = (unsigned char)(word >> ((k & 3) * 8));
      const float want = __fmul_rn(symcomm::fp4::e4m3_value(code), scale);
      const bool same = (want != want) ? (y[k] != y[k]) : __float_as_uint(y[k]) == __float_as_uint(want);
      if (!same) {
        atomicAdd(mismatches, 1ull);
        atomicMin(example, (unsigned int)code << 24 | index);
      }
    }
  }
}
"""


def _decode_mismatches(code: str, folder: pathlib.Path) -> tuple[int, int]:
    cupy = _cupy()
    module = _module(code, folder)
    mismatches = cupy.zeros(1, dtype=cupy.uint64)
    example = cupy.full(1, 0xFFFFFFFF, dtype=cupy.uint32)
    module.get_function("decode8_mismatches")((4096,), (256,), (mismatches, example))
    cupy.cuda.runtime.deviceSynchronize()
    return int(mismatches[0]), int(example[0])


def test_device_fp8_decode8_equals_the_host_values(tmp_path):
    count, example = _decode_mismatches(_DECODE_KERNEL, tmp_path)
    assert count == 0, f"{count} values differ, the lowest (code << 24 | scale index) 0x{example:08x}"


def test_the_decode_check_sees_a_difference(tmp_path):
    """The check against a reference that flips the scale's last bit must fail."""
    wrong = _DECODE_KERNEL.replace("symcomm::fp4::e4m3_value(code), scale)",
                                   "symcomm::fp4::e4m3_value(code), __uint_as_float(__float_as_uint(scale) ^ 1u))")
    assert wrong != _DECODE_KERNEL
    count, _ = _decode_mismatches(wrong, tmp_path)
    assert count > 0
