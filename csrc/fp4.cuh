// NVFP4 and e4m3 encoding math shared by csrc/fp4.cu (the codec), csrc/rmsnorm.cu (the
// normalisation's quantized outputs) and csrc/ep.cu (NVFP4 dispatch, FP8 through fp8.cuh), so
// all produce the same bytes from the same values.
//
// Every function is __host__ __device__: the *_host entry points run the very same code on the
// CPU, which is how CI (no GPU) checks it against symcomm/fp4.py's reference. The format itself
// is documented at the top of csrc/fp4.cu and in symcomm/fp4.py.
//
// The e2m1/e4m3 rounding is integer and fp32 logic, not sm_100's cvt instructions: the build
// targets sm_90. (FP8 values, one e4m3 byte each, do use sm_89's e4m3 conversions on the device:
// fp8.cuh, which gives these same bytes.)
#ifndef SYMCOMM_FP4_CUH_
#define SYMCOMM_FP4_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

// __forceinline__ is "inline" too, so these definitions may appear in several translation units.
#define SYMCOMM_HD __host__ __device__ __forceinline__

namespace symcomm {

SYMCOMM_HD uint32_t bits_of(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

SYMCOMM_HD float float_of(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

SYMCOMM_HD float to_f32(float v) { return v; }
SYMCOMM_HD float to_f32(__half v) { return __half2float(v); }
SYMCOMM_HD float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> SYMCOMM_HD T from_f32(float v);
template <> SYMCOMM_HD float from_f32<float>(float v) { return v; }
template <> SYMCOMM_HD __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> SYMCOMM_HD __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Correctly rounded fp32 operations, spelled out so that no compiler flag (contraction into an
// FMA, fast-math division or square root) can make the device differ from the host. The host
// halves are plain operators: setup.py builds with -ffp-contract=off so that the host compiler
// does not fuse a mul_rn into the add_rn after it.
SYMCOMM_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

SYMCOMM_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

SYMCOMM_HD float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

SYMCOMM_HD float sqrt_rn(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

namespace fp4 {

constexpr int kBlock = 16;  // values per scale

// Round v (>= 0, <= 4) to the nearest integer, ties to even. Below 0 (a negative global scale
// that a device tensor carried past validation) both give 0, as __float2uint_rn saturates: the
// flag-free FP4 gather relies on no scale byte having its top bit set (csrc/peer_gather.cu).
SYMCOMM_HD uint32_t round_even(float v) {
#ifdef __CUDA_ARCH__
  return __float2uint_rn(v);
#else
  if (!(v > 0.0f)) return 0u;  // a cast of a negative float to uint32_t is undefined
  return static_cast<uint32_t>(std::nearbyintf(v));  // the default rounding mode: to nearest even
#endif
}

// fp32 -> e4m3fn bits for v in [0, 448] or NaN (callers clamp first: e4m3fn has no infinity).
SYMCOMM_HD uint8_t e4m3_bits(float v) {
  if (!(v == v)) return 0x7F;
  // Below 2^-6 e4m3 is subnormal with a fixed step of 2^-9: round v / 2^-9 to an integer.
  // 8 steps is 2^-6, whose bits (exponent 1, mantissa 0) are also 8, so the carry is free.
  if (v < 0.015625f) return static_cast<uint8_t>(round_even(v * 512.0f));
  // Normal: keep 3 of fp32's 23 mantissa bits, rounding to nearest even on the bits (a carry
  // into the exponent is the right answer), then rebias the exponent from 127 to 7.
  uint32_t b = bits_of(v);
  b += 0x7FFFFu + ((b >> 20) & 1u);
  return static_cast<uint8_t>((b >> 20) - (120u << 3));
}

SYMCOMM_HD float e4m3_value(uint8_t c) {
  const uint32_t mag = c & 0x7Fu;
  float v;
  if (mag == 0x7Fu) {
    v = NAN;
  } else if (mag < 8u) {
    v = static_cast<float>(mag) * (1.0f / 512.0f);  // subnormal: mantissa * 2^-9, exact
  } else {
    v = float_of(((mag >> 3) + 120u) << 23 | (mag & 7u) << 20);
  }
  return (c & 0x80u) ? -v : v;
}

// Signed fp32 -> e4m3fn with saturation: |v| above 448 (infinities included) becomes +-448, the
// way torch's cast to float8_e4m3fn behaves (torch 2.13; older releases gave NaN above 464).
// Any NaN becomes 0x7F: the sign of a NaN is not portable between CPU and GPU arithmetic
// (x86's default NaN is negative, CUDA's positive), and one byte keeps host and device equal.
SYMCOMM_HD uint8_t e4m3_saturate(float v) {
  if (!(v == v)) return 0x7F;
  const uint8_t sign = (bits_of(v) >> 31) ? 0x80u : 0u;  // -0.0 keeps its sign, as in torch
  const float a = fminf(fabsf(v), 448.0f);
  return static_cast<uint8_t>(sign | e4m3_bits(a));
}

// |e2m1| code for a in [0, 6] (callers clamp: infinities saturate to 6).
// The e2m1 grid steps by 0.5 below 2, by 1 in [2, 4) and by 2 in [4, 6]. u = -1, 0, 1 names that
// range (from a's exponent, clamped below at -1); moving the exponent by -u maps it onto [0, 4) or
// [2, 3] with a step of 1, exactly (a tiny or zero a lands far below 0.5 and still rounds to 0).
// Adding 2^23 + 2u + 2 then rounds to an integer, to nearest even since the addend is even, and
// its low bits are the code: the rounded value plus the code of the range's first value (0, 2
// or 4). No float-to-int conversion (sm_90 issues those at a fraction of a float add's rate, and
// the quantize kernel is bound by instruction issue). The same codes as round_even(a * m) + first for every fp32 a in [0, 6] (all 1,086,324,737
// were compared once, bench/NOTES.md 2026-11-25).
SYMCOMM_HD uint32_t e2m1_magnitude(float a) {
  const uint32_t b = bits_of(a);
  const int32_t e = static_cast<int32_t>(b >> 23) - 128;
  const int32_t u = e > -1 ? e : -1;
  const float x = float_of(b - (static_cast<uint32_t>(u) << 23));
  return bits_of(x + float_of(0x4B000002u + 2u * static_cast<uint32_t>(u))) - 0x4B000000u;
}

// The pieces of one block's encoding, separate so that a kernel holding a block in two threads
// (8 values each, csrc/rmsnorm.cuh) computes exactly what encode_block computes in one.

// Running max of |v| as bit patterns: they order like the values (NaN above infinity), so an
// integer max finds amax and lets a NaN win, as torch's amax does.
SYMCOMM_HD uint32_t amax_step(uint32_t amax_bits, float v) {
  const uint32_t b = bits_of(v) & 0x7FFFFFFFu;
  return b > amax_bits ? b : amax_bits;
}

// The block's e4m3 scale byte from its amax.
SYMCOMM_HD uint8_t block_scale(uint32_t amax_bits, float gs) {
  float s = gs * float_of(amax_bits) / 6.0f;
  s = s > 448.0f ? 448.0f : s;  // NaN compares false and stays NaN
  return e4m3_bits(s);
}

// The multiplier that maps the block's values onto the e2m1 grid. A NaN scale (a block holding
// NaN) gives codes 0: callers test scale_is_nan and skip the codes.
SYMCOMM_HD bool scale_is_nan(uint8_t scale) { return (scale & 0x7Fu) == 0x7Fu; }

SYMCOMM_HD float block_inv(uint8_t scale, float gs) {
  const float sf = e4m3_value(scale);
  float inv = 0.0f;
  if (sf > 0.0f) {
    inv = gs / sf;
    inv = inv > FLT_MAX ? FLT_MAX : inv;  // so 0 * inv stays 0 for absurdly large global scales
  }
  return inv;
}

SYMCOMM_HD uint32_t e2m1_code(float v, float inv) {
  const float q = v * inv;
  const float a = fminf(fabsf(q), 6.0f);
  // A value that rounds to 0 is +0 (code 0): one encoding per value. |q| <= 0.25 is exactly
  // the set that rounds to 0, so q < -0.25 is "negative and non-zero".
  return e2m1_magnitude(a) + (q < -0.25f ? 8u : 0u);
}

// Eight codes packed into one little-endian word: element i in bits 4i..4i+3. Added rather than
// or-ed (the fields are disjoint): nvcc then folds each shift into the add (one LEA a code).
SYMCOMM_HD uint32_t pack8(const float* v, float inv) {
  uint32_t word = 0u;
#pragma unroll
  for (int i = 0; i < 8; ++i) word += e2m1_code(v[i], inv) << (i * 4);
  return word;
}

// One block whose amax (amax_step over its 16 values) is known: the e4m3 scale byte, and the
// 16 codes packed into two little-endian words.
SYMCOMM_HD uint8_t encode_block_amax(const float (&v)[kBlock], uint32_t amax_bits, float gs, uint32_t (&words)[2]) {
  const uint8_t scale = block_scale(amax_bits, gs);
  words[0] = words[1] = 0u;
  if (scale_is_nan(scale)) return scale;  // NaN block: codes 0
  const float inv = block_inv(scale, gs);
  words[0] = pack8(v, inv);
  words[1] = pack8(v + 8, inv);
  return scale;
}

// One block: the e4m3 scale byte, and the 16 codes packed into two little-endian words.
SYMCOMM_HD uint8_t encode_block(const float (&v)[kBlock], float gs, uint32_t (&words)[2]) {
  uint32_t amax_bits = 0;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) amax_bits = amax_step(amax_bits, v[i]);
  return encode_block_amax(v, amax_bits, gs, words);
}

SYMCOMM_HD void decode_block(const uint32_t (&words)[2], uint8_t scale, float gs, float (&y)[kBlock]) {
  const float k = e4m3_value(scale) / gs;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) {
    const uint32_t code = (words[i >> 3] >> ((i & 7) * 4)) & 0xFu;
    // Codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6: the e2m1 encoding, exponent bias 1.
    const uint32_t mag = code & 7u;
    float v = mag < 2u ? 0.5f * static_cast<float>(mag)
                       : float_of(((mag >> 1) + 126u) << 23 | (mag & 1u) << 22);
    v = (code & 8u) ? -v : v;
    y[i] = v * k;
  }
}

// Scale (row, col) in the 128x4 interleaved layout of block-scaled GEMMs: 128-row x 4-column
// tiles of 512 bytes in row-major tile order; inside a tile, row r sits at (r % 32) * 16 +
// (r / 32) * 4, so the 4 rows r, r+32, r+64, r+96 share one 16-byte line.
SYMCOMM_HD int64_t swizzled_index(int64_t row, int64_t col, int64_t padded_cols) {
  const int64_t tile = (row >> 7) * (padded_cols >> 2) + (col >> 2);
  return tile * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4 + (col & 3);
}

SYMCOMM_HD int64_t scale_index(int64_t block, int64_t blocks_per_row, int64_t padded_cols, bool swizzled) {
  return swizzled ? swizzled_index(block / blocks_per_row, block % blocks_per_row, padded_cols) : block;
}

// Padded shape of the swizzled layout: rows up to 128, scale columns up to 4.
SYMCOMM_HD int64_t padded_rows(int64_t rows) { return (rows + 127) / 128 * 128; }
SYMCOMM_HD int64_t padded_cols(int64_t blocks_per_row) { return (blocks_per_row + 3) / 4 * 4; }

}  // namespace fp4
}  // namespace symcomm

#endif  // SYMCOMM_FP4_CUH_
