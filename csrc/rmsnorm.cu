// Residual add + RMSNorm (+ FP8 / NVFP4 output) over all-reduced rows: the norm half of
// Communicator.all_reduce_rmsnorm (symcomm/rmsnorm.py), run after its all-reduce. The math and the reduction order are in
// csrc/rmsnorm.cuh; this file only loads rows, launches, and runs the same code on the host.
#include "symcomm.h"
#include "symcomm_testing.h"
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

// One block of kThreads per row, the reduction order's virtual block. Every load of the row is
// issued before its first store: a store to the new residual may alias a later vector of the
// input (an in-place update, or a caller of add_rmsnorm passing its input as residual_out), and a
// load-add-store loop waited out one memory round trip per vector (sm_90 SASS, 2026-11-25).
// The weight goes to shared memory with cp.async alongside: held in registers across the row's
// sum it pushed the 7168-wide kernel from 64 registers to 139, and read from global memory after
// the sum it costs one more round trip. Rows of up to kSmemIters * kThreads vectors (32 KB);
// wider rows read it from global memory.
constexpr int kSmemIters = 8;

// Blocks per SM that the register budget must allow: a row is one block's whole job, so blocks
// resident side by side are what keeps memory busy while others reduce. Unbounded, nvcc gave the
// 7168-wide row 90-96 registers (2 blocks per SM); capped at 80 (3) nothing spills, and 3 blocks
// measured better than 4 (64 registers) at 1-2048 rows and worse only at 4096 (H100,
// bench/NOTES.md). Without a residual the kernel holds half the row data and fits 4. Wider rows
// hold more per thread and get fewer blocks.
constexpr int min_blocks(int iters, bool residual) {
  return iters <= 4 ? (residual ? 3 : 4) : (iters <= 8 ? 2 : 1);
}

// signal: when to let the next kernel on the stream launch (launch.cuh). kSignalEarly on entry;
// kSignalLate only once this block is done. Launched early,
// its blocks take the SM slots this grid leaves free and wait there; with more rows than SMs
// that placed them unevenly (2.3 to 1 rows per SM) and made the next call slower: at 256 rows of
// 7168, 6.4 us per call against 4.6 with one slot fewer per SM (H100, bench/NOTES.md).
// kSignalNever where early signals are off for the process (dependents_early): the next kernel
// then starts when this grid exits.
//
// parts: blocks per row. With fewer rows than SMs a row's normalisation and quantization (a few
// hundred instructions a thread after the sum) ran on one SM while the others idled: FP8 output
// cost 1.9x bf16's time at one row (H100, bench/NOTES.md). Block b takes row b / parts, loads
// and sums all of it (the same order, so the same rinv in every block), and stores h and y for
// the iterations i with i % parts == b % parts; never where h overlaps a or the residual
// (row_parts says why; all_reduce_rmsnorm hands the kernel an a of its own,
// symcomm/rmsnorm.py's NormCall.all_reduce_out).
enum DependentSignal : int { kSignalEarly = 0, kSignalLate = 1, kSignalNever = 2 };

template <typename T, int kIters, int kQuant, bool kResidual>
__global__ void __launch_bounds__(kThreads, min_blocks(kIters, kResidual)) rmsnorm_kernel(
    const T* a, const T* residual, const T* weight, T* residual_out, Output out, int nvec, float eps, int signal,
    int parts) {
  constexpr bool kStage = kIters <= kSmemIters;
  __shared__ float smem[kWarps];
  __shared__ Vec<T> staged[kStage ? kIters * kThreads : 1];
  wait_for_predecessor();
  if (signal == kSignalEarly) let_dependents_launch();
  const int64_t row = blockIdx.x / parts;
  const int part = blockIdx.x % parts;
  // No __restrict__ and no read-only loads: a and residual may be residual_out itself.
  const Vec<T>* a_row = reinterpret_cast<const Vec<T>*>(a) + row * nvec;
  const Vec<T>* r_row = reinterpret_cast<const Vec<T>*>(residual) + row * nvec;
  Vec<T> h[kIters], r[kIters];
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int j = threadIdx.x + i * kThreads;
    if (j < nvec) {
      h[i] = load_vec(a_row + j);
      if (kResidual) r[i] = load_vec(r_row + j);
    }
  }
  const Vec<T>* w = reinterpret_cast<const Vec<T>*>(weight);
  if (kStage) {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int j = threadIdx.x + i * kThreads;
      if (j < nvec && i % parts == part) copy_to_shared(staged + j, w + j);
    }
    w = staged;
  }
  const float scale = load_out_scale(out, kQuant);
  // h = a (+ residual), kept in residual_out when the caller passed one (without a residual too:
  // the caller then asked for a copy of a as the new residual).
  Vec<T>* h_row = reinterpret_cast<Vec<T>*>(residual_out) + row * nvec;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int j = threadIdx.x + i * kThreads;
    if (j < nvec) {
      if (kResidual) add_residual(h[i], r[i]);
      if (residual_out != nullptr && i % parts == part) store_vec(h_row + j, h[i]);
    }
  }
  rmsnorm_row<T, kIters, kQuant, kStage>(h, w, scale, row, nvec, eps, out, smem, parts, part);
  if (signal == kSignalLate) let_dependents_launch();
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

// The current device's SM count (0 if it cannot be read: every launch then triggers late).
int sm_count() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return sms;
}

// Blocks per row for this kernel's call: row_parts, aliased wherever the new residual overlaps a
// or the residual (all three [rows, nvec] vectors of 16 bytes). symcomm_norm_row_parts exposes it.
int parts_for(int64_t rows, int nvec, int64_t slots, const void* a, const void* residual, const void* residual_out) {
  const size_t bytes = size_t(rows) * size_t(nvec) * 16;
  return row_parts(rows, nvec, slots, overlaps(residual_out, a, bytes) || overlaps(residual_out, residual, bytes));
}

template <typename T, int kIters, int kQuant>
cudaError_t launch_iters(const void* a, const void* residual, const void* weight, void* residual_out,
                         const Output& out, int rows, int nvec, float eps, cudaStream_t st) {
  const int sms = sm_count();
  const int parts = parts_for(rows, nvec, sms, a, residual, residual_out);
  const int64_t blocks = int64_t(rows) * parts;
  const int signal = !dependents_early() ? kSignalNever : blocks > sms ? kSignalLate : kSignalEarly;
  // A programmatic dependent launch (launch.cuh): behind the op's all-reduce, or
  // behind any kernel of the caller's, the launch overlaps that kernel's tail.
  const auto args = [&](auto kernel) {
    return launch(true, kernel, static_cast<unsigned>(blocks), kThreads, st, static_cast<const T*>(a),
                  static_cast<const T*>(residual), static_cast<const T*>(weight), static_cast<T*>(residual_out), out,
                  nvec, eps, signal, parts);
  };
  return residual != nullptr ? args(rmsnorm_kernel<T, kIters, kQuant, true>)
                             : args(rmsnorm_kernel<T, kIters, kQuant, false>);
}

template <typename T, int kIters>
cudaError_t launch_quant(const void* a, const void* residual, const void* weight, void* residual_out,
                         const Output& out, int rows, int nvec, float eps, cudaStream_t st) {
  switch (out.quant) {
    case kQuantNone: return launch_iters<T, kIters, kQuantNone>(a, residual, weight, residual_out, out, rows, nvec, eps, st);
    case kQuantFp8: return launch_iters<T, kIters, kQuantFp8>(a, residual, weight, residual_out, out, rows, nvec, eps, st);
    default: return launch_iters<T, kIters, kQuantNvfp4>(a, residual, weight, residual_out, out, rows, nvec, eps, st);
  }
}

template <typename T>
cudaError_t launch_rows(const void* a, const void* residual, const void* weight, void* residual_out, const Output& out,
                        int64_t rows, int64_t cols, float eps, cudaStream_t st) {
  const int nvec = static_cast<int>(cols / kVec);
  const int n = static_cast<int>(rows);
  const int iters = (nvec + kThreads - 1) / kThreads;
  if (iters <= 1) return launch_quant<T, 1>(a, residual, weight, residual_out, out, n, nvec, eps, st);
  if (iters <= 2) return launch_quant<T, 2>(a, residual, weight, residual_out, out, n, nvec, eps, st);
  if (iters <= 4) return launch_quant<T, 4>(a, residual, weight, residual_out, out, n, nvec, eps, st);
  if (iters <= 8) return launch_quant<T, 8>(a, residual, weight, residual_out, out, n, nvec, eps, st);
  return launch_quant<T, kMaxIters>(a, residual, weight, residual_out, out, n, nvec, eps, st);
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
        fp8::encode8_host(yf, scale, words);
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

int symcomm_rmsnorm(const void* a, const symcomm_rmsnorm_args_t* args, cudaStream_t st) {
  if (args == nullptr) return cudaErrorInvalidValue;
  const symcomm_rmsnorm_args_t& g = *args;
  const int q = static_cast<int>(g.quant);
  const int64_t rows = g.rows, cols = g.cols;
  if (!valid(a, g.residual, g.weight, rows, cols, g.residual_out, q, g.out, g.scales)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (q == kQuantNvfp4 && g.swizzle && (fp4::padded_rows(rows) != rows || fp4::padded_cols(cols / 16) != cols / 16)) {
    // Padding must read as zero scales, as symcomm.fp4.quantize writes it.
    const cudaError_t err = cudaMemsetAsync(g.scales, 0, swizzled_bytes(rows, cols), st);
    if (err != cudaSuccess) return err;
  }
  const Output o = make_output(cols, q, g.out, g.scales, static_cast<const float*>(g.scale_ptr), g.scale_value,
                               g.swizzle);
  switch (g.dtype) {
    case SYMCOMM_FLOAT16:
      return launch_rows<__half>(a, g.residual, g.weight, g.residual_out, o, rows, cols, g.eps, st);
    case SYMCOMM_BFLOAT16:
      return launch_rows<__nv_bfloat16>(a, g.residual, g.weight, g.residual_out, o, rows, cols, g.eps, st);
    default: return cudaErrorInvalidValue;
  }
}

int symcomm_norm_row_parts(int64_t rows, int64_t cols, int64_t slots, const void* a, const void* residual,
                           const void* residual_out) {
  return parts_for(rows, int(cols / kVec), slots, a, residual, residual_out);
}

int symcomm_rmsnorm_host(const void* a, const symcomm_rmsnorm_args_t* args) {
  if (args == nullptr) return cudaErrorInvalidValue;
  const symcomm_rmsnorm_args_t& g = *args;
  const int q = static_cast<int>(g.quant);
  const int64_t rows = g.rows, cols = g.cols;
  if (!valid(a, g.residual, g.weight, rows, cols, g.residual_out, q, g.out, g.scales)) return cudaErrorInvalidValue;
  auto* sc = static_cast<uint8_t*>(g.scales);
  if (q == kQuantNvfp4 && g.swizzle && rows > 0) std::memset(sc, 0, swizzled_bytes(rows, cols));
  switch (g.dtype) {
    case SYMCOMM_FLOAT16:
      rmsnorm_on_host<__half>(a, g.residual, g.weight, rows, cols, g.eps, g.residual_out, q, g.out, sc,
                              g.scale_value, g.swizzle);
      break;
    case SYMCOMM_BFLOAT16:
      rmsnorm_on_host<__nv_bfloat16>(a, g.residual, g.weight, rows, cols, g.eps, g.residual_out, q, g.out, sc,
                                     g.scale_value, g.swizzle);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

}  // extern "C"
