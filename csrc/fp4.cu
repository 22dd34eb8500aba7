// NVFP4 quantize / dequantize: plain C ABI over raw pointers, loaded by symcomm/fp4.py.
//
// The format is defined by symcomm.fp4.quantize_reference (pure torch); this file must agree
// with it bit for bit. Summary, per block of 16 values along the last dim, all in fp32:
//   amax  = max |x|                      (NaN wins, so a block holding NaN is marked below)
//   s     = global_scale * amax / 6      (two correctly rounded fp32 ops, in this order)
//   scale = e4m3(min(s, 448))            (round to nearest even, subnormals kept; NaN stays NaN)
//   inv   = scale > 0 ? min(global_scale / scale, FLT_MAX) : 0
//   code  = e2m1(x * inv)                (round to nearest even, saturate at 6, never -0)
//   a block whose scale is NaN gets all codes 0.
// Two codes per byte, the even element in the low nibble.
//
// The per-value math lives in csrc/fp4.cuh (shared with csrc/rmsnorm.cu's quantized outputs).
// It is integer and fp32 logic, not sm_100's cvt instructions (the build targets sm_90), and
// every piece is __host__ __device__: the *_host entry points run the very same functions on the
// CPU, so CI (no GPU) checks this file against the reference.
#include "symcomm.h"
#include "symcomm_testing.h"
#include "fp4.cuh"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

using namespace symcomm;
using namespace symcomm::fp4;

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 1 << 22;  // grid-stride beyond this

struct Shape {
  int64_t blocks;          // rows * blocks_per_row
  int64_t blocks_per_row;  // cols / 16
  int64_t padded_cols;     // blocks_per_row rounded up to 4 (swizzled layout only)
  int64_t padded_rows;     // rows rounded up to 128 (swizzled layout only)
};

bool make_shape(int64_t rows, int64_t cols, Shape* s) {
  if (rows < 0 || cols <= 0 || cols % kBlock) return false;
  s->blocks_per_row = cols / kBlock;
  s->blocks = rows * s->blocks_per_row;
  s->padded_cols = (s->blocks_per_row + 3) / 4 * 4;
  s->padded_rows = (rows + 127) / 128 * 128;
  return true;
}

// ---------------------------------------------------------------------------------- kernels
// One thread per block of 16: 32 bytes of bf16/fp16 (or 64 of fp32) in as 16-byte loads,
// 8 bytes of codes out as one store, one scale byte.

template <typename T, bool kVec>
__device__ __forceinline__ void load_block(const T* p, float (&v)[kBlock]) {
  if constexpr (kVec) {
    constexpr int kLoads = kBlock * sizeof(T) / 16;
    alignas(16) T tmp[kBlock];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      reinterpret_cast<uint4*>(tmp)[j] = __ldg(reinterpret_cast<const uint4*>(p) + j);
    }
#pragma unroll
    for (int i = 0; i < kBlock; ++i) v[i] = to_f32(tmp[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kBlock; ++i) v[i] = to_f32(p[i]);
  }
}

template <typename T, bool kSwizzle, bool kVec>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const T* __restrict__ x, uint8_t* __restrict__ packed,
                                                          uint8_t* __restrict__ scales, const float* gs_ptr,
                                                          float gs_value, Shape shape) {
  // Read on the device, so a global scale computed on the GPU needs no host sync and the
  // launch can be captured in a CUDA graph.
  const float gs = gs_ptr != nullptr ? *gs_ptr : gs_value;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < shape.blocks; b += stride) {
    float v[kBlock];
    load_block<T, kVec>(x + b * kBlock, v);
    uint32_t words[2];
    const uint8_t scale = encode_block(v, gs, words);
    if constexpr (kVec) {
      *reinterpret_cast<uint2*>(packed + b * 8) = make_uint2(words[0], words[1]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) packed[b * 8 + j] = static_cast<uint8_t>(words[j >> 2] >> ((j & 3) * 8));
    }
    scales[scale_index(b, shape.blocks_per_row, shape.padded_cols, kSwizzle)] = scale;
  }
}

// bf16 / fp16 input, 16-byte aligned, one block of 16 per thread. The kernel is bound by instruction issue, not by memory
// (bench/NOTES.md, 2026-11-25), so it spends as few as it can per value: the block's amax comes
// from the packed 16-bit patterns, whose order as unsigned integers is the order of |v| (a NaN
// above infinity, as amax_step has it), three pairs per sm_90 three-way max instruction; the
// values are widened straight from the pairs; and e2m1_magnitude needs no conversion instruction.
template <typename T>
struct Pairs;

template <>
struct Pairs<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t amax_bits(uint32_t m16) { return m16 << 16; }
  static __device__ __forceinline__ void widen(uint32_t w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xFFFF0000u);
  }
};

template <>
struct Pairs<__half> {
  static __device__ __forceinline__ uint32_t amax_bits(uint32_t m16) {
    return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(m16))));
  }
  static __device__ __forceinline__ void widen(uint32_t w, float& lo, float& hi) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
    lo = f.x;
    hi = f.y;
  }
};

// One block of 16 values held as eight little-endian pairs (element 2i in the low half of w[i]).
template <typename T>
__device__ __forceinline__ uint8_t encode_pairs(const uint32_t (&w)[8], float gs, uint32_t (&words)[2]) {
  uint32_t m[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) m[i] = w[i] & 0x7FFF7FFFu;  // |v|, two at a time
  const uint32_t m3 = __vimax3_u16x2(__vimax3_u16x2(m[0], m[1], m[2]), __vimax3_u16x2(m[3], m[4], m[5]),
                                     __vmaxu2(m[6], m[7]));
  const uint32_t lo = m3 & 0xFFFFu, hi = m3 >> 16;
  float v[kBlock];
#pragma unroll
  for (int i = 0; i < 8; ++i) Pairs<T>::widen(w[i], v[2 * i], v[2 * i + 1]);
  return encode_block_amax(v, Pairs<T>::amax_bits(lo > hi ? lo : hi), gs, words);
}

template <typename T, bool kSwizzle>
__global__ void __launch_bounds__(kThreads) quantize16_kernel(const uint4* __restrict__ x, uint8_t* __restrict__ packed,
                                                            uint8_t* __restrict__ scales, const float* gs_ptr,
                                                            float gs_value, Shape shape) {
  const float gs = gs_ptr != nullptr ? *gs_ptr : gs_value;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < shape.blocks; b += stride) {
    const uint4 u0 = __ldg(x + 2 * b), u1 = __ldg(x + 2 * b + 1);
    const uint32_t w[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
    uint32_t words[2];
    const uint8_t sc = encode_pairs<T>(w, gs, words);
    *reinterpret_cast<uint2*>(packed + b * 8) = make_uint2(words[0], words[1]);
    scales[scale_index(b, shape.blocks_per_row, shape.padded_cols, kSwizzle)] = sc;
  }
}

template <typename T, bool kSwizzle, bool kVec>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const uint8_t* __restrict__ packed,
                                                            const uint8_t* __restrict__ scales, T* __restrict__ out,
                                                            const float* gs_ptr, float gs_value, Shape shape) {
  const float gs = gs_ptr != nullptr ? *gs_ptr : gs_value;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < shape.blocks; b += stride) {
    uint32_t words[2];
    if constexpr (kVec) {
      const uint2 w = __ldg(reinterpret_cast<const uint2*>(packed + b * 8));
      words[0] = w.x;
      words[1] = w.y;
    } else {
      words[0] = words[1] = 0u;
#pragma unroll
      for (int j = 0; j < 8; ++j) words[j >> 2] |= static_cast<uint32_t>(packed[b * 8 + j]) << ((j & 3) * 8);
    }
    float y[kBlock];
    decode_block(words, scales[scale_index(b, shape.blocks_per_row, shape.padded_cols, kSwizzle)], gs, y);
    T* dst = out + b * kBlock;
    if constexpr (kVec) {
      alignas(16) T tmp[kBlock];
#pragma unroll
      for (int i = 0; i < kBlock; ++i) tmp[i] = from_f32<T>(y[i]);
#pragma unroll
      for (int j = 0; j < static_cast<int>(kBlock * sizeof(T) / 16); ++j) {
        reinterpret_cast<uint4*>(dst)[j] = reinterpret_cast<const uint4*>(tmp)[j];
      }
    } else {
#pragma unroll
      for (int i = 0; i < kBlock; ++i) dst[i] = from_f32<T>(y[i]);
    }
  }
}

bool aligned(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) % n) == 0; }

dim3 grid_for(int64_t blocks) {
  const int64_t g = (blocks + kThreads - 1) / kThreads;
  return dim3(static_cast<unsigned>(g < kMaxGrid ? g : kMaxGrid));
}

// Calls launch(layout, vec) with both flags as compile-time constants (std::integral_constant),
// so each kernel variant is chosen once here instead of in a 2x2 if-ladder per launcher.
template <typename Launch>
cudaError_t with_flags(bool layout, bool vec, Launch launch) {
  using Yes = std::true_type;
  using No = std::false_type;
  if (layout) vec ? launch(Yes{}, Yes{}) : launch(Yes{}, No{});
  else vec ? launch(No{}, Yes{}) : launch(No{}, No{});
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_quantize(const void* x, const Shape& s, const float* gs_ptr, float gs_value, void* packed,
                            void* scales, bool swizzle, cudaStream_t stream) {
  const T* xt = static_cast<const T*>(x);
  auto* p = static_cast<uint8_t*>(packed);
  auto* sc = static_cast<uint8_t*>(scales);
  // The vector path needs 16-byte aligned input and 8-byte aligned codes; views that start
  // mid-row of a larger buffer may not be, and take the scalar path instead of faulting.
  const bool vec = aligned(x, 16) && aligned(packed, 8);
  const dim3 grid = grid_for(s.blocks), block(kThreads);
  if constexpr (sizeof(T) == 2) {
    if (vec) {
      const auto* xv = static_cast<const uint4*>(x);
      if (swizzle) quantize16_kernel<T, true><<<grid, block, 0, stream>>>(xv, p, sc, gs_ptr, gs_value, s);
      else quantize16_kernel<T, false><<<grid, block, 0, stream>>>(xv, p, sc, gs_ptr, gs_value, s);
      return cudaGetLastError();
    }
  }
  return with_flags(swizzle, vec, [&](auto swz, auto vec_) {
    quantize_kernel<T, decltype(swz)::value, decltype(vec_)::value><<<grid, block, 0, stream>>>(xt, p, sc, gs_ptr,
                                                                                               gs_value, s);
  });
}

template <typename T>
cudaError_t launch_dequantize(const void* packed, const void* scales, const Shape& s, const float* gs_ptr,
                              float gs_value, bool swizzled, void* out, cudaStream_t stream) {
  const auto* p = static_cast<const uint8_t*>(packed);
  const auto* sc = static_cast<const uint8_t*>(scales);
  T* o = static_cast<T*>(out);
  const bool vec = aligned(packed, 8) && aligned(out, 16);
  const dim3 grid = grid_for(s.blocks), block(kThreads);
  return with_flags(swizzled, vec, [&](auto swz, auto vec_) {
    dequantize_kernel<T, decltype(swz)::value, decltype(vec_)::value><<<grid, block, 0, stream>>>(p, sc, o, gs_ptr,
                                                                                                 gs_value, s);
  });
}

// ------------------------------------------------------------------------- host reference run
template <typename T>
void quantize_on_host(const void* x, const Shape& s, float gs, uint8_t* packed, uint8_t* scales, bool swizzle) {
  const T* xt = static_cast<const T*>(x);
  for (int64_t b = 0; b < s.blocks; ++b) {
    float v[kBlock];
    for (int i = 0; i < kBlock; ++i) v[i] = to_f32(xt[b * kBlock + i]);
    uint32_t words[2];
    scales[scale_index(b, s.blocks_per_row, s.padded_cols, swizzle)] = encode_block(v, gs, words);
    std::memcpy(packed + b * 8, words, 8);  // little-endian: byte j = elements 2j (low), 2j+1
  }
}

template <typename T>
void dequantize_on_host(const uint8_t* packed, const uint8_t* scales, const Shape& s, float gs, bool swizzled,
                        void* out) {
  T* o = static_cast<T*>(out);
  for (int64_t b = 0; b < s.blocks; ++b) {
    uint32_t words[2];
    std::memcpy(words, packed + b * 8, 8);
    float y[kBlock];
    decode_block(words, scales[scale_index(b, s.blocks_per_row, s.padded_cols, swizzled)], gs, y);
    for (int i = 0; i < kBlock; ++i) o[b * kBlock + i] = from_f32<T>(y[i]);
  }
}

}  // namespace

// ------------------------------------------------------------------------------------ C ABI
// csrc/symcomm.h documents the layouts. Returns a cudaError_t (cudaErrorInvalidValue for a bad
// shape or dtype). gs_ptr is untyped in the ABI because Python passes a raw device address.
extern "C" {

int symcomm_fp4_quantize(const void* x, symcomm_dtype_t dtype, int64_t rows, int64_t cols, const void* gs_ptr_raw,
                         float gs_value, void* packed, void* scales, int swizzle, cudaStream_t st) {
  Shape s;
  if (!make_shape(rows, cols, &s)) return cudaErrorInvalidValue;
  const auto* gs_ptr = static_cast<const float*>(gs_ptr_raw);
  if (swizzle && rows > 0 && (s.padded_rows != rows || s.padded_cols != s.blocks_per_row)) {
    // Padding entries must read as zero scales; the scales are 1/16 of the codes' bytes, so a
    // memset of the whole buffer costs little next to the kernel.
    const cudaError_t err = cudaMemsetAsync(scales, 0, static_cast<size_t>(s.padded_rows * s.padded_cols), st);
    if (err != cudaSuccess) return err;
  }
  if (s.blocks == 0) return cudaSuccess;
  switch (dtype) {
    case SYMCOMM_FLOAT32: return launch_quantize<float>(x, s, gs_ptr, gs_value, packed, scales, swizzle, st);
    case SYMCOMM_FLOAT16: return launch_quantize<__half>(x, s, gs_ptr, gs_value, packed, scales, swizzle, st);
    case SYMCOMM_BFLOAT16: return launch_quantize<__nv_bfloat16>(x, s, gs_ptr, gs_value, packed, scales, swizzle, st);
    default: return cudaErrorInvalidValue;
  }
}

int symcomm_fp4_dequantize(const void* packed, const void* scales, int64_t rows, int64_t cols,
                           const void* gs_ptr_raw, float gs_value, int swizzled, void* out, symcomm_dtype_t dtype,
                           cudaStream_t st) {
  Shape s;
  if (!make_shape(rows, cols, &s)) return cudaErrorInvalidValue;
  if (s.blocks == 0) return cudaSuccess;
  const auto* gs_ptr = static_cast<const float*>(gs_ptr_raw);
  switch (dtype) {
    case SYMCOMM_FLOAT32: return launch_dequantize<float>(packed, scales, s, gs_ptr, gs_value, swizzled, out, st);
    case SYMCOMM_FLOAT16: return launch_dequantize<__half>(packed, scales, s, gs_ptr, gs_value, swizzled, out, st);
    case SYMCOMM_BFLOAT16:
      return launch_dequantize<__nv_bfloat16>(packed, scales, s, gs_ptr, gs_value, swizzled, out, st);
    default: return cudaErrorInvalidValue;
  }
}

// The same per-block code on the CPU, over host memory; global_scale is a value here.
int symcomm_fp4_quantize_host(const void* x, symcomm_dtype_t dtype, int64_t rows, int64_t cols, float global_scale,
                              void* packed, void* scales, int swizzle) {
  Shape s;
  if (!make_shape(rows, cols, &s)) return cudaErrorInvalidValue;
  auto* p = static_cast<uint8_t*>(packed);
  auto* sc = static_cast<uint8_t*>(scales);
  if (swizzle && rows > 0) std::memset(sc, 0, static_cast<size_t>(s.padded_rows * s.padded_cols));
  switch (dtype) {
    case SYMCOMM_FLOAT32: quantize_on_host<float>(x, s, global_scale, p, sc, swizzle); break;
    case SYMCOMM_FLOAT16: quantize_on_host<__half>(x, s, global_scale, p, sc, swizzle); break;
    case SYMCOMM_BFLOAT16: quantize_on_host<__nv_bfloat16>(x, s, global_scale, p, sc, swizzle); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

int symcomm_fp4_dequantize_host(const void* packed, const void* scales, int64_t rows, int64_t cols,
                                float global_scale, int swizzled, void* out, symcomm_dtype_t dtype) {
  Shape s;
  if (!make_shape(rows, cols, &s)) return cudaErrorInvalidValue;
  const auto* p = static_cast<const uint8_t*>(packed);
  const auto* sc = static_cast<const uint8_t*>(scales);
  switch (dtype) {
    case SYMCOMM_FLOAT32: dequantize_on_host<float>(p, sc, s, global_scale, swizzled, out); break;
    case SYMCOMM_FLOAT16: dequantize_on_host<__half>(p, sc, s, global_scale, swizzled, out); break;
    case SYMCOMM_BFLOAT16: dequantize_on_host<__nv_bfloat16>(p, sc, s, global_scale, swizzled, out); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

}  // extern "C"
