// Residual add + RMSNorm (+ FP8 / NVFP4 quantization) of rows that are already all-reduced:
// the math, as __host__ __device__ pieces, and the per-row device routine of the kernel
// (csrc/rmsnorm.cu), whose host twin runs the same pieces in the same order.
//
// Rounding contract (docs/rmsnorm.md says the same for users):
//   h = round_T(float(a) + float(residual))   (h = a without residual). a is the all-reduced
//       row already rounded to T, exactly what "all_reduce, then a + residual in T"
//       computes: one fp32 add of two T values, rounded once to nearest even.
//   sumsq = sum of float(h)^2 over the row, in fp32, in the fixed order described below;
//   rinv  = 1 / sqrt(sumsq / hidden + eps)     (each op correctly rounded fp32)
//   y     = round_T((float(h) * rinv) * float(weight))
//   FP8:   e4m3(float(y) / scale), saturating to +-448 (torch's cast does the same)
//   NVFP4: csrc/fp4.cuh's encoding of float(y) with the global scale: bitwise what
//          symcomm.fp4.quantize(y, global_scale) gives.
// So quantized outputs quantize the rounded y, never an unrounded fp32 value.
//
// Reduction order (the part any other implementation must reproduce to get the same bits). A
// row of `hidden` elements is nvec = hidden / 8 vectors of 16 bytes. It is reduced by a virtual
// block of kThreads threads:
//   1. thread t owns vectors j = t, t + kThreads, t + 2 kThreads, ... (in that order) and keeps
//      one fp32 partial, acc = acc + x * x (two rounded ops, not an FMA) over its vectors'
//      lanes 0..7 in order, from +0;
//   2. each warp (threads 32w .. 32w+31) combines its partials with the xor butterfly
//      v += shfl_xor(v, o) for o = 16, 8, 4, 2, 1 (every lane ends with the same value, since
//      fp32 addition is commutative);
//   3. the kWarps warp sums are added in warp order: ((w0 + w1) + w2) + ...
// The order depends on kThreads and the vector mapping only, never on the grid or on how many
// vectors a thread holds beyond its last one. A caller of rmsnorm_row() must therefore launch
// exactly kThreads threads per row (blockDim.x == kThreads, one row at a time per block) and
// hand thread t its vectors t + i * kThreads in h[i]. block_sum_host() is the same order on the
// CPU, and symcomm/rmsnorm.py's torch reference computes it too. (No FMA: with one, a square
// that underflows fp32's normal range would round differently than torch's x * x, then + acc.)
#ifndef SYMCOMM_RMSNORM_CUH_
#define SYMCOMM_RMSNORM_CUH_

#include "fp4.cuh"
#include "fp8.cuh"

namespace symcomm {
namespace norm {

constexpr int kVec = 8;         // bf16/fp16 elements per 16-byte vector
constexpr int kThreads = 256;   // threads per row: part of the reduction order (see above)
constexpr int kWarps = kThreads / 32;
constexpr int kMaxIters = 16;   // vectors per thread a kernel may hold in registers
constexpr int64_t kMaxHidden = int64_t(kThreads) * kVec * kMaxIters;  // 32768
// Most blocks a decode row is split over (rmsnorm_row's parts): each sums the whole row, so more
// parts buy less; 4 measured best against 1 and 2 (H100, bench/NOTES.md).
constexpr int kMaxParts = 4;

// Whether [rows, hidden] tensors of `bytes` bytes at p and q share memory (null shares nothing).
inline bool overlaps(const void* p, const void* q, size_t bytes) {
  if (p == nullptr || q == nullptr) return false;
  const auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
  return a < b + bytes && b < a + bytes;
}

// Blocks per row (rmsnorm_row's parts) for `rows` rows of `nvec` vectors, where `slots` blocks
// can each have an SM: as many as the row's iterations allow (a block with none would only
// sum), up to kMaxParts, while rows x parts fits the slots. One where h overlaps what the kernel
// reads (`aliased`: in place, or the input written into h): the blocks of a row are not ordered
// with each other, so one block's h could land before another block of the row read that
// vector, which would then add the residual to it twice. (A thread-block cluster meeting before
// the first store kept the split correct there but cost 0.7-0.8 us a call at 1-64 rows, five
// times what the split saves for bf16 output; H100, bench/NOTES.md.)
inline int row_parts(int64_t rows, int nvec, int64_t slots, bool aliased) {
  const int iters = (nvec + kThreads - 1) / kThreads;
  int parts = 1;
  while (!aliased && parts * 2 <= iters && parts * 2 <= kMaxParts && rows * parts * 2 <= slots) parts *= 2;
  return parts;
}

// Values of symcomm_norm_quant_t (csrc/symcomm.h).
enum Quant : int { kQuantNone = 0, kQuantFp8 = 1, kQuantNvfp4 = 2 };

// One 16-byte vector of a row, as its eight T values.
template <typename T>
struct alignas(16) Vec {
  T v[kVec];
};

// add_rn, mul_rn, div_rn and sqrt_rn (fp4.cuh): correctly rounded on the device as on the host.

// h = a + residual, in fp32, rounded once to T (in place on the a lanes).
template <typename T>
SYMCOMM_HD void add_residual(Vec<T>& h, const Vec<T>& residual) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) h.v[i] = from_f32<T>(add_rn(to_f32(h.v[i]), to_f32(residual.v[i])));
}

// Step 1 of the reduction order for one vector.
template <typename T>
SYMCOMM_HD float sumsq_step(float acc, const Vec<T>& h) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const float x = to_f32(h.v[i]);
    acc = add_rn(acc, mul_rn(x, x));
  }
  return acc;
}

SYMCOMM_HD float inv_rms(float sumsq, int64_t hidden, float eps) {
  return div_rn(1.0f, sqrt_rn(add_rn(div_rn(sumsq, static_cast<float>(hidden)), eps)));
}

// y for one vector, rounded to T; yf gets the rounded values back in fp32 for quantizing.
template <typename T>
SYMCOMM_HD void normalize(const Vec<T>& h, const Vec<T>& w, float rinv, Vec<T>& y, float (&yf)[kVec]) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    y.v[i] = from_f32<T>(mul_rn(mul_rn(to_f32(h.v[i]), rinv), to_f32(w.v[i])));
    yf[i] = to_f32(y.v[i]);
  }
}

// Steps 2 and 3 on the CPU: partials[t] is thread t's step-1 sum.
inline float block_sum_host(const float (&partials)[kThreads]) {
  float warp_sums[kWarps];
  for (int w = 0; w < kWarps; ++w) {
    float v[32];
    for (int l = 0; l < 32; ++l) v[l] = partials[32 * w + l];
    for (int o = 16; o > 0; o >>= 1) {
      float next[32];
      for (int l = 0; l < 32; ++l) next[l] = add_rn(v[l], v[l ^ o]);
      for (int l = 0; l < 32; ++l) v[l] = next[l];
    }
    warp_sums[w] = v[0];
  }
  float total = warp_sums[0];
  for (int w = 1; w < kWarps; ++w) total = add_rn(total, warp_sums[w]);
  return total;
}

// Where one row's outputs go. The pointers are the whole tensors; rmsnorm_row indexes them.
struct Output {
  int quant;                  // Quant
  void* y;                    // kQuantNone: T [rows, hidden]; kQuantFp8: e4m3 bytes [rows, hidden];
                              // kQuantNvfp4: packed codes [rows, hidden / 2]
  uint8_t* scales;            // kQuantNvfp4: e4m3 block scales (linear, or swizzled)
  const float* scale_ptr;     // FP8 dequant scale / NVFP4 global scale, read on the device if set
  float scale_value;          // ... otherwise this value
  int swizzle;                // kQuantNvfp4: scales in the 128x4 layout
  int64_t padded_cols;        // kQuantNvfp4 swizzled: hidden / 16 rounded up to 4
};

#ifdef __CUDACC__
// One 16-byte vector in one instruction. Reading a Vec<T> through a pointer field by field made
// nvcc 13.0 emit eight 2-byte loads (the residual and weight reads, sm_90 SASS, 2026-11-25).
template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const Vec<T>* p) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  Vec<T> v;
  memcpy(&v, &u, sizeof v);
  return v;
}

template <typename T>
__device__ __forceinline__ void store_vec(Vec<T>* p, const Vec<T>& v) {
  uint4 u;
  memcpy(&u, &v, sizeof u);
  *reinterpret_cast<uint4*>(p) = u;
}

// Steps 2 and 3 on the device: every thread of the block gets the row's sum. smem holds kWarps
// floats, written once: a block sums one row.
__device__ __forceinline__ float block_sum(float partial, float* smem) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) partial = __fadd_rn(partial, __shfl_xor_sync(0xffffffffu, partial, o));
  if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = partial;
  __syncthreads();
  float total = smem[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) total = __fadd_rn(total, smem[w]);
  return total;
}

// The output's scale (FP8 dequant scale / NVFP4 global scale; 1 without quantization). Callers
// read it before the row's sum and use it only after: nvcc moved a use made before the sum
// (FP8's reciprocal) to right after the load, stalling the thread there for a memory round trip.
__device__ __forceinline__ float load_out_scale(const Output& out, int quant) {
  return quant == kQuantNone ? 1.0f : (out.scale_ptr != nullptr ? *out.scale_ptr : out.scale_value);
}

// A 16-byte copy from global to shared memory that bypasses registers (cp.async, sm_80), and the
// wait for this thread's copies. A thread that reads back only what it copied needs no barrier.
// Cached in L1 (.ca): every block copies the same weight, and the blocks resident on one SM then
// read it from L1 after the first. With .cg (L2 only) each block fetched all of it from L2, as
// many bytes as its row without a residual: y alone at 1024 rows of 7168 took 9.66 us against
// 6.28 with .ca, and h + y at 256 rows 4.36 against 3.53 (H100, same run, bench/NOTES.md).
template <typename T>
__device__ __forceinline__ void copy_to_shared(Vec<T>* dst, const Vec<T>* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}

__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Makes nvcc treat the packed words of h as new values, so that the fp32 conversions made for
// the sum of squares are not kept alive across the reduction for normalize (32 registers at a
// 7168-wide row, which cost blocks per SM); converting again is one instruction a value.
template <typename T>
__device__ __forceinline__ void launder(Vec<T>& h) {
  uint32_t* u = reinterpret_cast<uint32_t*>(&h);
#pragma unroll
  for (int k = 0; k < 4; ++k) asm volatile("" : "+r"(u[k]));
}

// One row, after the all-reduce and the residual add: thread t (blockDim.x == kThreads) holds
// h[i] = vector t + i * kThreads of the row (already rounded to T, and already stored to the
// new residual by the caller if it keeps one) for every such vector below nvec; the rest of h
// is ignored. w is the weight as vectors (global memory, or this thread's shared-memory copies:
// it reads w[t + i * kThreads] only), scale is load_out_scale(out, kQuant). kQuant is out.quant,
// known at compile time (less code and fewer registers); kStaged: w is a shared-memory copy made
// with copy_to_shared by this thread, waited for only after the row's sum. Writes y (or its FP8
// / NVFP4 encoding) for the row's vectors of the iterations i with i % parts == part (all of
// them with the defaults): blocks that share a row each sum all of it, in the same
// order, and write their part. Every thread of the block must call it (it synchronises the
// block), with the same row, nvec, output and part.
// For NVFP4, hidden must be a multiple of 16: the two halves of a 16-value block are vectors
// 2k and 2k+1, held by lanes t and t^1 of one warp in the same iteration, which exchange amax.
template <typename T, int kIters, int kQuant, bool kStaged>
__device__ __forceinline__ void rmsnorm_row(const Vec<T> (&h_in)[kIters], const Vec<T>* w, float scale, int64_t row,
                                            int nvec, float eps, const Output& out, float* smem, int parts = 1,
                                            int part = 0) {
  const int t = threadIdx.x;
  Vec<T> h[kIters];
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    h[i] = h_in[i];
    if (t + i * kThreads < nvec) acc = sumsq_step(acc, h[i]);
    launder(h[i]);
  }
  const int64_t hidden = int64_t(nvec) * kVec;
  const float rinv = inv_rms(block_sum(acc, smem), hidden, eps);
  if (kStaged) wait_copies();
  fp8::Scale fp8_scale;
  if (kQuant == kQuantFp8) fp8_scale = fp8::scale_of(scale);
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    if (i % parts != part) continue;  // uniform over the block
    const int j = t + i * kThreads;
    const bool active = j < nvec;
    Vec<T> y;
    float yf[kVec];
    if (active) normalize(h[i], load_vec(w + j), rinv, y, yf);
    if (kQuant == kQuantNone) {
      if (active) store_vec(reinterpret_cast<Vec<T>*>(out.y) + row * nvec + j, y);
    } else if (kQuant == kQuantFp8) {
      if (active) {
        uint32_t words[2];
        fp8::encode8(yf, fp8_scale, words);
        reinterpret_cast<uint2*>(out.y)[row * nvec + j] = make_uint2(words[0], words[1]);
      }
    } else {
      // Every lane takes part in the shuffle (the loop is uniform); an inactive lane's partner
      // is inactive too, since nvec is even.
      uint32_t amax_bits = 0u;
      if (active) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) amax_bits = fp4::amax_step(amax_bits, yf[k]);
      }
      const uint32_t other = __shfl_xor_sync(0xffffffffu, amax_bits, 1);
      amax_bits = other > amax_bits ? other : amax_bits;
      if (active) {
        const uint8_t sc = fp4::block_scale(amax_bits, scale);
        const uint32_t word = fp4::scale_is_nan(sc) ? 0u : fp4::pack8(yf, fp4::block_inv(sc, scale));
        reinterpret_cast<uint32_t*>(out.y)[row * nvec + j] = word;
        if ((j & 1) == 0) {
          const int64_t col = j / 2;
          out.scales[out.swizzle ? fp4::swizzled_index(row, col, out.padded_cols) : row * (nvec / 2) + col] = sc;
        }
      }
    }
  }
}

#endif  // __CUDACC__

}  // namespace norm
}  // namespace symcomm

#endif  // SYMCOMM_RMSNORM_CUH_
