// FP8 (e4m3fn) codes of eight values that share one scale: code = e4m3(RN(v / scale)), +-448 for
// anything larger (infinities included), 0x7F for every NaN; and the values back, code * scale.
// The fused norm's FP8 output (rmsnorm.cuh) and the EP FP8 dispatch and combine (ep.cuh) both
// encode here, so the two give torch's bytes the same way (symcomm/rmsnorm.py, symcomm/ep/fp8.py).
//
// The host functions run fp4.cuh's integer rounding and are the CPU twins' code; the device
// functions use sm_89's conversion instructions and give the same bytes and values, which
// tests/gpu_sim/test_fp8_cvt.py checks on a GPU: byte() and encode8 for every fp32 value (encode8
// at ten scales), decode8 for every code at 2^24 scales.
#ifndef SYMCOMM_FP8_CUH_
#define SYMCOMM_FP8_CUH_

#include "fp4.cuh"

#ifdef __CUDACC__
#include <cuda_fp8.h>
#endif

#include <cstdint>

namespace symcomm {
namespace fp8 {

constexpr int kUnit = 8;  // values a lane encodes at once: one 8-byte word pair

// One value's byte. On the GPU one cvt.rn.satfinite instruction gives e4m3_saturate's byte for
// every fp32 pattern but NaN, whose sign it keeps: the software rounding took about 15 dependent
// instructions a value (the norm's FP8 output cost 3.4 us more than bf16 at every row count
// with it, world 1, H100).
SYMCOMM_HD uint8_t byte(float v) {
#ifdef __CUDA_ARCH__
  const uint8_t c = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
  return v == v ? c : uint8_t(0x7F);
#else
  return fp4::e4m3_saturate(v);
#endif
}

// Eight codes of v / scale as a little-endian word pair (value i in byte i), dividing each
// value: the CPU twins' code.
inline void encode8_host(const float (&v)[kUnit], float scale, uint32_t (&words)[2]) {
  words[0] = words[1] = 0u;
  for (int i = 0; i < kUnit; ++i) words[i >> 2] |= static_cast<uint32_t>(byte(div_rn(v[i], scale))) << ((i & 3) * 8);
}

#ifdef __CUDACC__
// The device's codes without a division per value (the IEEE division is a call behind a range
// check, one branch region per value in the sm_90 SASS). q = RN(v * RN(1 / scale)), and the
// division runs only where q could give another byte:
//   |q - RN(v / scale)| < 3 ulp of v / scale (two roundings of 2^-24 each, and RN's own), so at
//   most 6 floats apart; the byte changes only across an e4m3 rounding midpoint, which for
//   q >= 2^-6 (e4m3's normal range) has 0x80000 in its 20 low bits, 2^19 floats from either end
//   of its binade. So q's byte is RN(v / scale)'s unless q's low bits are within 8 of 0x80000, or
//   q is in [2^-12, 2^-6) (e4m3 subnormals, whose midpoints sit elsewhere; below 2^-12 both are
//   far under 2^-10, half the least subnormal, and give a signed zero). Infinite v stays
//   infinite and NaN stays NaN. Needs a scale whose reciprocal is a normal fp32 number (anything
//   else divides).
struct Scale {
  float scale;
  float inv;   // RN(1 / scale)
  bool fast;   // inv is normal: the rule above holds
};

__device__ __forceinline__ Scale scale_of(float scale) {
  const float inv = __frcp_rn(scale);
  const uint32_t e = (__float_as_uint(inv) >> 23) & 0xFFu;
  return Scale{scale, inv, e != 0u && e != 0xFFu};
}

__device__ __forceinline__ bool needs_division(float q) {
  const uint32_t b = __float_as_uint(q) & 0x7FFFFFFFu;
  const bool subnormal = b - 0x39800000u < 0x3C800000u - 0x39800000u;  // 2^-12 <= |q| < 2^-6
  const bool near_midpoint = (b & 0xFFFFFu) - (0x80000u - 8u) <= 16u;
  return subnormal || near_midpoint;
}

// encode8_host's bytes: two values per conversion (cvt.rn.satfinite.e4m3x2), then a NaN's byte
// made 0x7F whatever its sign, as byte() (satfinite never gives 0x7F or 0xFF for a number).
__device__ __forceinline__ void encode8(const float (&v)[kUnit], const Scale& s, uint32_t (&words)[2]) {
  float q[kUnit];
  bool divide = !s.fast;
#pragma unroll
  for (int i = 0; i < kUnit; ++i) {
    q[i] = __fmul_rn(v[i], s.inv);
    divide |= needs_division(q[i]);
  }
  if (divide) {
#pragma unroll
    for (int i = 0; i < kUnit; ++i) q[i] = __fdiv_rn(v[i], s.scale);
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    uint32_t w = 0u;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const uint32_t two = __nv_cvt_float2_to_fp8x2(make_float2(q[4 * k + 2 * p], q[4 * k + 2 * p + 1]),
                                                    __NV_SATFINITE, __NV_E4M3);
      w |= two << (16 * p);
    }
    const uint32_t nan = ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;  // bytes 0x7F / 0xFF
    words[k] = w & ~nan;
  }
}

// code * scale for eight codes: each code through fp16 (cvt.rn.f16x2.e4m3x2; every e4m3 value is
// an fp16 value, so both conversions are exact), then one rounded product, as
// fp4::e4m3_value(code) * scale on the host. A NaN code gives a NaN.
__device__ __forceinline__ void decode8(uint2 codes, float scale, float (&y)[kUnit]) {
  const uint32_t w[2] = {codes.x, codes.y};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const __half2_raw two = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[k >> 1] >> (16 * (k & 1))),
                                                      __NV_E4M3);
    const float2 f = __half22float2(__half2(two));
    y[2 * k] = __fmul_rn(f.x, scale);
    y[2 * k + 1] = __fmul_rn(f.y, scale);
  }
}
#endif  // __CUDACC__

}  // namespace fp8
}  // namespace symcomm

#endif  // SYMCOMM_FP8_CUH_
