// Standalone residual add + RMSNorm (+ FP8 / NVFP4 output) over all-reduced rows: the unfused
// path of Communicator.all_reduce_rmsnorm (symcomm/rmsnorm.py), and the reference a fused
// all-reduce kernel is compared with bit for bit. The math and the reduction order are in
// csrc/rmsnorm.cuh; this file only loads rows, launches, and runs the same code on the host.
#include "symcomm.h"
#include "launch.cuh"
#include "rmsnorm.cuh"

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace symcomm;
using namespace symcomm::norm;

// One block of kThreads per row: the block is the reduction order's virtual block, so the
// kernel needs nothing beyond rmsnorm_row. h stays in registers (kIters vectors per thread),
// so the row is read once; kIters is the smallest power of two that covers the row.
template <typename T, int kIters>
__global__ void __launch_bounds__(kThreads) rmsnorm_kernel(const T* a, const T* residual, const T* weight,
                                                           T* residual_out, Output out, int nvec, float eps) {
  __shared__ float smem[kWarps];
  enter_after_predecessor();
  const int64_t row = blockIdx.x;
  // No __restrict__ and no read-only loads: a and residual may be residual_out itself (the
  // caller's in-place residual, or the all-reduce written straight into the new residual).
  // Each element is read before it is written, by the same thread.
  const Vec<T>* a_row = reinterpret_cast<const Vec<T>*>(a) + row * nvec;
  const Vec<T>* r_row = residual != nullptr ? reinterpret_cast<const Vec<T>*>(residual) + row * nvec : nullptr;
  Vec<T>* h_row = residual_out != nullptr ? reinterpret_cast<Vec<T>*>(residual_out) + row * nvec : nullptr;
  Vec<T> h[kIters];
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int j = threadIdx.x + i * kThreads;
    if (j < nvec) {
      h[i] = a_row[j];
      if (r_row != nullptr) add_residual(h[i], r_row[j]);
      if (h_row != nullptr) h_row[j] = h[i];
    }
  }
  rmsnorm_row<T, kIters>(h, row, nvec, weight, eps, out, smem);
}

bool aligned(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) % n) == 0; }

// The argument rules symcomm/rmsnorm.py also checks, kept here so that a direct C caller
// cannot launch out of bounds.
bool valid(const void* a, const void* residual, const void* weight, int64_t rows, int64_t cols, void* residual_out,
           int quant, const void* out, const void* scales) {
  if (rows < 0 || rows > INT_MAX || cols <= 0 || cols % kVec || cols > kMaxHidden) return false;
  if (quant != kQuantNone && quant != kQuantFp8 && quant != kQuantNvfp4) return false;
  if (quant == kQuantNvfp4 && cols % fp4::kBlock) return false;
  if (rows == 0) return true;
  if (a == nullptr || weight == nullptr || out == nullptr || (quant == kQuantNvfp4 && scales == nullptr)) return false;
  const uintptr_t out_align = quant == kQuantNone ? 16 : (quant == kQuantFp8 ? 8 : 4);
  return aligned(a, 16) && aligned(residual, 16) && aligned(weight, 16) && aligned(residual_out, 16) &&
         aligned(out, out_align);
}

Output make_output(int64_t cols, int quant, void* out, void* scales, const float* scale_ptr, float scale_value,
                   int swizzle) {
  return Output{quant, out, static_cast<uint8_t*>(scales), scale_ptr, scale_value, swizzle,
                fp4::padded_cols(cols / fp4::kBlock)};
}

template <typename T, int kIters>
cudaError_t launch_iters(const void* a, const void* residual, const void* weight, void* residual_out,
                         const Output& out, int64_t rows, int nvec, float eps, cudaStream_t st) {
  // Always a programmatic dependent launch (launch.cuh): behind the all-reduce of the unfused
  // path, or behind any kernel of the caller's, the launch overlaps that kernel's tail.
  return launch(true, rmsnorm_kernel<T, kIters>, static_cast<unsigned>(rows), kThreads, st, static_cast<const T*>(a),
                static_cast<const T*>(residual), static_cast<const T*>(weight), static_cast<T*>(residual_out), out,
                nvec, eps);
}

template <typename T>
cudaError_t launch_rows(const void* a, const void* residual, const void* weight, void* residual_out, const Output& out,
                        int64_t rows, int64_t cols, float eps, cudaStream_t st) {
  const int nvec = static_cast<int>(cols / kVec);
  const int iters = (nvec + kThreads - 1) / kThreads;
  if (iters <= 1) return launch_iters<T, 1>(a, residual, weight, residual_out, out, rows, nvec, eps, st);
  if (iters <= 2) return launch_iters<T, 2>(a, residual, weight, residual_out, out, rows, nvec, eps, st);
  if (iters <= 4) return launch_iters<T, 4>(a, residual, weight, residual_out, out, rows, nvec, eps, st);
  if (iters <= 8) return launch_iters<T, 8>(a, residual, weight, residual_out, out, rows, nvec, eps, st);
  return launch_iters<T, kMaxIters>(a, residual, weight, residual_out, out, rows, nvec, eps, st);
}

// ------------------------------------------------------------------------- host reference run
// The same pieces in the order rmsnorm_row uses them; NVFP4 blocks go through encode_block,
// which composes the pieces the kernel calls across two lanes.
template <typename T>
void rmsnorm_on_host(const void* a, const void* residual, const void* weight, int64_t rows, int64_t cols, float eps,
                     void* residual_out, int quant, void* out, uint8_t* scales, float scale, int swizzle) {
  const int64_t nvec = cols / kVec;
  const auto* a_vecs = static_cast<const Vec<T>*>(a);
  const auto* r_vecs = static_cast<const Vec<T>*>(residual);
  const auto* w_vecs = static_cast<const Vec<T>*>(weight);
  auto* h_vecs = static_cast<Vec<T>*>(residual_out);
  const int64_t blocks_per_row = cols / fp4::kBlock;
  const int64_t padded_cols = fp4::padded_cols(blocks_per_row);
  std::vector<Vec<T>> h(static_cast<size_t>(nvec));
  std::vector<float> y_row(static_cast<size_t>(cols));
  for (int64_t row = 0; row < rows; ++row) {
    float partials[kThreads] = {};
    for (int64_t j = 0; j < nvec; ++j) {
      Vec<T> v;
      std::memcpy(&v, &a_vecs[row * nvec + j], sizeof v);
      if (r_vecs != nullptr) {
        Vec<T> r;
        std::memcpy(&r, &r_vecs[row * nvec + j], sizeof r);
        add_residual(v, r);
      }
      if (h_vecs != nullptr) std::memcpy(&h_vecs[row * nvec + j], &v, sizeof v);
      h[j] = v;
      partials[j % kThreads] = sumsq_step(partials[j % kThreads], v);
    }
    const float rinv = inv_rms(block_sum_host(partials), cols, eps);
    for (int64_t j = 0; j < nvec; ++j) {
      Vec<T> w, y;
      std::memcpy(&w, &w_vecs[j], sizeof w);
      float yf[kVec];
      normalize(h[j], w, rinv, y, yf);
      if (quant == kQuantNone) {
        std::memcpy(static_cast<Vec<T>*>(out) + row * nvec + j, &y, sizeof y);
      } else if (quant == kQuantFp8) {
        uint32_t words[2];
        fp8_vec(yf, scale, words);
        std::memcpy(static_cast<uint8_t*>(out) + (row * nvec + j) * 8, words, 8);  // little-endian
      } else {
        std::memcpy(&y_row[j * kVec], yf, sizeof yf);
      }
    }
    if (quant == kQuantNvfp4) {
      for (int64_t b = 0; b < blocks_per_row; ++b) {
        float v[fp4::kBlock];
        std::memcpy(v, &y_row[b * fp4::kBlock], sizeof v);
        uint32_t words[2];
        const uint8_t sc = fp4::encode_block(v, scale, words);
        std::memcpy(static_cast<uint8_t*>(out) + (row * blocks_per_row + b) * 8, words, 8);
        scales[swizzle ? fp4::swizzled_index(row, b, padded_cols) : row * blocks_per_row + b] = sc;
      }
    }
  }
}

size_t swizzled_bytes(int64_t rows, int64_t cols) {
  return static_cast<size_t>(fp4::padded_rows(rows) * fp4::padded_cols(cols / fp4::kBlock));
}

}  // namespace

// ------------------------------------------------------------------------------------ C ABI
// csrc/symcomm.h documents the arguments. Returns a cudaError_t (cudaErrorInvalidValue for a bad
// shape, dtype, quant mode or alignment).
extern "C" {

int symcomm_rmsnorm(const void* a, const void* residual, const void* weight, symcomm_dtype_t dtype, int64_t rows,
                    int64_t cols, float eps, void* residual_out, symcomm_norm_quant_t quant, void* out, void* scales,
                    const void* scale_ptr, float scale_value, int swizzle, cudaStream_t st) {
  const int q = static_cast<int>(quant);
  if (!valid(a, residual, weight, rows, cols, residual_out, q, out, scales)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (q == kQuantNvfp4 && swizzle && (fp4::padded_rows(rows) != rows || fp4::padded_cols(cols / 16) != cols / 16)) {
    // Padding must read as zero scales, as symcomm.fp4.quantize writes it.
    const cudaError_t err = cudaMemsetAsync(scales, 0, swizzled_bytes(rows, cols), st);
    if (err != cudaSuccess) return err;
  }
  const Output o = make_output(cols, q, out, scales, static_cast<const float*>(scale_ptr), scale_value, swizzle);
  switch (dtype) {
    case SYMCOMM_FLOAT16: return launch_rows<__half>(a, residual, weight, residual_out, o, rows, cols, eps, st);
    case SYMCOMM_BFLOAT16: return launch_rows<__nv_bfloat16>(a, residual, weight, residual_out, o, rows, cols, eps, st);
    default: return cudaErrorInvalidValue;
  }
}

int symcomm_rmsnorm_host(const void* a, const void* residual, const void* weight, symcomm_dtype_t dtype,
                         int64_t rows, int64_t cols, float eps, void* residual_out, symcomm_norm_quant_t quant,
                         void* out, void* scales, float scale, int swizzle) {
  const int q = static_cast<int>(quant);
  if (!valid(a, residual, weight, rows, cols, residual_out, q, out, scales)) return cudaErrorInvalidValue;
  auto* sc = static_cast<uint8_t*>(scales);
  if (q == kQuantNvfp4 && swizzle && rows > 0) std::memset(sc, 0, swizzled_bytes(rows, cols));
  switch (dtype) {
    case SYMCOMM_FLOAT16:
      rmsnorm_on_host<__half>(a, residual, weight, rows, cols, eps, residual_out, q, out, sc, scale, swizzle);
      break;
    case SYMCOMM_BFLOAT16:
      rmsnorm_on_host<__nv_bfloat16>(a, residual, weight, rows, cols, eps, residual_out, q, out, sc, scale, swizzle);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

}  // extern "C"
