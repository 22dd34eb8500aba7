// Fused all-reduce + residual add + RMSNorm (+ FP8 / NVFP4 output): the three all-reduce
// kernels of custom_ar.cu, each followed inside the same launch by csrc/rmsnorm.cuh's per-row
// routine, so the all-reduced rows never make a round trip through memory and the norm needs
// no launch of its own.
//
// Same bits as unfused. Each fused kernel sums like its all-reduce (fp32, rank order, the
// first rank's value seeding the sum, rounded once to T), then runs the standalone kernel's
// code: rmsnorm_row with a block of norm::kThreads threads per row and thread t holding
// vectors t + i * kThreads. So its outputs equal "the same all-reduce, then csrc/rmsnorm.cu",
// bit for bit, on every rank.
//
//   flag-free: every rank pushes its rows into every peer's receive buffer (as flag_free), then
//              each block waits for the vectors of its rows, sums, normalises.
//   one-shot:  barrier, every rank reads all peers' rows, sums and normalises every row, barrier.
//   two-shot:  barrier, rank r sums and normalises its chunk of rows into its scratch (h, y and
//              scales), barrier, every rank copies every chunk from its owner. The residual is
//              read by the owner only: it must be the same on every rank (as it is under tensor
//              parallelism), or each rank gets its owners' sums.
//
// Synchronisation, epochs and giving up are peer.cuh's, shared with every other peer kernel.
#include "peer.cuh"
#include "rmsnorm.cuh"

#include <cstring>

namespace {
using namespace symcomm::ar;
using symcomm::launch;
namespace norm = symcomm::norm;

// Everything of one call besides the input: the rows, the norm's arguments, the outputs.
template <typename T>
struct NormRows {
  const T* residual;  // [rows, hidden] or null
  T* residual_out;    // [rows, hidden]: h
  const T* weight;    // [hidden]
  float eps;
  int rows;
  int nvec;           // hidden / 8
  int parts;          // blocks per row (launch_norm): each sums all of it and writes its part
  norm::Output out;   // y (or its FP8 / NVFP4 encoding)
};

// rmsnorm_row's mode here: the output format read at run time, the weight staged in shared
// memory once per block (stage_weight), blocks that may take several rows.
using FusedMode = norm::RowMode<norm::kQuantAny, true, false>;

// The weight, every vector this thread will read (t + i * kThreads), copied to shared memory
// with cp.async: read from global memory after the row's sum it was one more memory round trip
// per row, and held in registers it would cost the registers that keep the row's loads in
// flight. Called after the kernel's wait for its predecessor (which may write the weight);
// rmsnorm_row waits for the copies after the sum.
template <typename T, int kIters>
__device__ __forceinline__ const norm::Vec<T>* stage_weight(const NormRows<T>& a, norm::Vec<T>* staged) {
  const norm::Vec<T>* w = reinterpret_cast<const norm::Vec<T>*>(a.weight);
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int j = threadIdx.x + i * norm::kThreads;
    if (j < a.nvec) norm::copy_to_shared(staged + j, w + j);
  }
  return staged;
}

// h for one vector: the W ranks' vectors summed in rank order (reduce_at's sum), the residual
// (already loaded) added.
template <typename T, int W>
__device__ __forceinline__ norm::Vec<T> sum_h(const uint4 (&v)[W], const norm::Vec<T>& residual,
                                              const NormRows<T>& a) {
  float acc[Lanes<T>::kN];
  Lanes<T>::load(v[0], acc);
#pragma unroll
  for (int r = 1; r < W; ++r) Lanes<T>::add(v[r], acc);
  const uint4 sum = Lanes<T>::pack(acc);
  norm::Vec<T> h;
  memcpy(&h, &sum, sizeof h);
  if (a.residual != nullptr) norm::add_residual(h, residual);
  return h;
}

// Stores this block's share of a row's h (iterations i % a.parts == part) to the new residual.
template <typename T, int kIters>
__device__ __forceinline__ void store_h(const norm::Vec<T> (&h)[kIters], int64_t base, int part, const NormRows<T>& a) {
  norm::Vec<T>* out = reinterpret_cast<norm::Vec<T>*>(a.residual_out) + base;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int j = threadIdx.x + i * norm::kThreads;
    if (j < a.nvec && i % a.parts == part) norm::store_vec(out + j, h[i]);
  }
}

// One row summed from every rank's input in rank order, residual added, stored to a.residual_out,
// and normalised into a.out: the standalone kernel's row, with the all-reduce in front. Every
// load of the row (W peers' vectors and the residual) is issued before its first store: the
// store to the new residual may alias the inputs as far as the compiler knows, and a
// load-sum-store loop waited out one peer round trip per vector, kIters in series per row.
// Block `part` of a.parts stores h and y for the iterations i % a.parts == part only.
template <typename T, int W, int kIters>
__device__ __forceinline__ void sum_and_norm_row(const uint4* const* src, int row, int part, const NormRows<T>& a,
                                                 const norm::Vec<T>* w, float scale, float* smem) {
  const int64_t base = int64_t(row) * a.nvec;
  const norm::Vec<T>* res = reinterpret_cast<const norm::Vec<T>*>(a.residual) + base;
  uint4 v[kIters][W];
  norm::Vec<T> r[kIters];
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int j = threadIdx.x + i * norm::kThreads;
    if (j < a.nvec) {
#pragma unroll
      for (int p = 0; p < W; ++p) v[i][p] = src[p][base + j];
      if (a.residual != nullptr) r[i] = norm::load_vec(res + j);
    }
  }
  norm::Vec<T> h[kIters];
#pragma unroll
  for (int i = 0; i < kIters; ++i)
    if (threadIdx.x + i * norm::kThreads < a.nvec) h[i] = sum_h<T, W>(v[i], r[i], a);
  store_h<T, kIters>(h, base, part, a);
  norm::rmsnorm_row<T, kIters, FusedMode>(h, w, scale, row, a.nvec, a.eps, a.out, smem, a.parts, part);
}

template <typename T, int W, int kIters>
__global__ void __launch_bounds__(norm::kThreads) one_shot_norm(Sync s, const Peers* in, size_t in_offset,
                                                                NormRows<T> a) {
  __shared__ float smem[norm::kWarps];
  __shared__ norm::Vec<T> staged[kIters * norm::kThreads];
  const uint64_t epoch = next_epoch(s);
  if (epoch == 0 || !slot_ready(s, in, W)) return;
  const uint4* src[kMaxRanks];
  for (int r = 0; r < W; ++r) src[r] = reinterpret_cast<const uint4*>(in->ptr[r] + in_offset);
  const norm::Vec<T>* w = stage_weight<T, kIters>(a, staged);
  const float scale = norm::load_out_scale(a.out, a.out.quant);
  if (!barrier(s, kStart, W, epoch)) {
    norm::wait_copies();
    return;
  }
  // Block b takes rows and parts b, b + gridDim.x, ... of the rows x parts items (some blocks
  // take none where this rank's a.parts is below the grid's: launch_norm).
  for (int item = blockIdx.x; item < a.rows * a.parts; item += gridDim.x)
    sum_and_norm_row<T, W, kIters>(src, item / a.parts, item % a.parts, a, w, scale, smem);
  norm::wait_copies();  // a block without rows
  // Peers read this rank's input until they pass here.
  barrier(s, kEnd, W, epoch);
}

// n elements of one row from an owner's scratch, every load of a thread issued before its first
// store. A load-store loop makes the compiler wait out one NVLink round trip per iteration (the
// store may alias the next load), and at decode sizes a row is one block's whole job: fused
// two-shot at one 8192-value row took 28.9 us at world 2 (H200, 2026-11-24 tune), against 7.0
// for the two-shot all-reduce alone. With kBatch loads per thread a row of up to 4 * 256 *
// 16 bytes is one round trip.
template <typename V>
__device__ __forceinline__ void copy_row(V* dst, const V* src, size_t n) {
  constexpr int kBatch = 4;
  for (size_t base = threadIdx.x; base < n; base += size_t(kBatch) * blockDim.x) {
    V v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k)
      if (base + size_t(k) * blockDim.x < n) v[k] = src[base + size_t(k) * blockDim.x];
#pragma unroll
    for (int k = 0; k < kBatch; ++k)
      if (base + size_t(k) * blockDim.x < n) dst[base + size_t(k) * blockDim.x] = v[k];
  }
}

// Where two-shot's owners leave their rows for the gather: h, then y as the output format
// stores it (T, FP8 bytes, or NVFP4 codes), then linear NVFP4 block scales, each area 16-byte
// aligned. Row indices are the full tensor's; an owner fills only its chunk.
struct ScratchLayout {
  size_t y_offset;
  size_t scales_offset;
  size_t y_row_bytes;
};

template <typename T, int W, int kIters>
__global__ void __launch_bounds__(norm::kThreads) two_shot_norm(Sync s, Peers scratch, const Peers* in,
                                                                size_t in_offset, NormRows<T> a, ScratchLayout lay) {
  __shared__ float smem[norm::kWarps];
  __shared__ norm::Vec<T> staged[kIters * norm::kThreads];
  const int rank = s.rank;
  const uint64_t epoch = next_epoch(s);
  if (epoch == 0 || !slot_ready(s, in, W)) return;
  const uint4* src[kMaxRanks];
  for (int r = 0; r < W; ++r) src[r] = reinterpret_cast<const uint4*>(in->ptr[r] + in_offset);
  const int chunk = (a.rows + W - 1) / W;
  const norm::Vec<T>* w = stage_weight<T, kIters>(a, staged);
  const float scale = norm::load_out_scale(a.out, a.out.quant);
  if (!barrier(s, kStart, W, epoch)) {
    norm::wait_copies();
    return;
  }
  // Owner phase: rows of this rank's chunk, normalised into its own scratch. Block b takes the
  // same offsets within every chunk in both phases, so its mid barrier covers what it gathers.
  char* mine = scratch.ptr[rank];
  NormRows<T> own = a;
  own.residual_out = reinterpret_cast<T*>(mine);
  own.out.y = mine + lay.y_offset;
  own.out.scales = reinterpret_cast<uint8_t*>(mine + lay.scales_offset);
  own.out.swizzle = 0;
  const int lo = rank * chunk, hi = lo + chunk < a.rows ? lo + chunk : a.rows;
  // One block per row here (a.parts is 1): the gather below copies whole rows that block b
  // itself wrote on every owner.
  for (int row = lo + blockIdx.x; row < hi; row += gridDim.x) sum_and_norm_row<T, W, kIters>(src, row, 0, own, w, scale, smem);
  norm::wait_copies();  // a block without rows
  // After it, every peer has read our input (so it may be reused) and every chunk is ready.
  if (!barrier(s, kMid, W, epoch)) return;
  const size_t h_row = size_t(a.nvec) * 16;
  const int blocks_per_row = a.nvec / 2;  // NVFP4 scales per row (hidden / 16)
  // y rows are whole 4-byte words in every format, and an NVFP4 output only has to be 4-byte
  // aligned (the standalone kernel's rule, which validation applies): 16-byte units where the
  // output and the row length allow, words otherwise. Equal in every block: a uniform branch.
  const bool y_vec = lay.y_row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(a.out.y) % 16 == 0;
  for (int k = 0; k < W; ++k) {
    const int owner = (rank + k) % W;  // staggered, so the ranks do not all read one owner
    const int olo = owner * chunk, ohi = olo + chunk < a.rows ? olo + chunk : a.rows;
    const char* theirs = scratch.ptr[owner];
    for (int row = olo + blockIdx.x; row < ohi; row += gridDim.x) {
      copy_row(reinterpret_cast<uint4*>(reinterpret_cast<char*>(a.residual_out) + row * h_row),
               reinterpret_cast<const uint4*>(theirs + row * h_row), size_t(a.nvec));
      const char* y_src = theirs + lay.y_offset + row * lay.y_row_bytes;
      char* y_dst = static_cast<char*>(a.out.y) + row * lay.y_row_bytes;
      if (y_vec)
        copy_row(reinterpret_cast<uint4*>(y_dst), reinterpret_cast<const uint4*>(y_src), lay.y_row_bytes / 16);
      else
        copy_row(reinterpret_cast<uint32_t*>(y_dst), reinterpret_cast<const uint32_t*>(y_src), lay.y_row_bytes / 4);
      if (a.out.quant == norm::kQuantNvfp4) {
        // Loaded in one go as well (at most 512 scales a row, two a thread), then placed in the layout.
        const uint8_t* sc = reinterpret_cast<const uint8_t*>(theirs + lay.scales_offset) + size_t(row) * blocks_per_row;
        uint8_t v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int c = threadIdx.x + i * blockDim.x;
          if (c < blocks_per_row) v[i] = sc[c];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int c = threadIdx.x + i * blockDim.x;
          if (c < blocks_per_row)
            a.out.scales[a.out.swizzle ? symcomm::fp4::swizzled_index(row, c, a.out.padded_cols)
                                       : size_t(row) * blocks_per_row + c] = v[i];
        }
      }
    }
  }
  // No closing barrier, as two_shot: an owner rewrites its scratch only after the next call's
  // start barrier, which peers reach only once they finished gathering from it.
}

// flag_free's protocol (receive buffers rotating over three, sentinel words, each block keeping
// its own buffer index and clear count), with rows instead of a flat range: every block of the
// context takes part in every call, whatever its mapping, because the bookkeeping is per block.
template <typename T, int W, int kIters>
__global__ void __launch_bounds__(norm::kThreads) flag_free_norm(Sync s, Peers recv, const uint4* x, size_t slot_vecs,
                                                                 NormRows<T> a) {
  __shared__ float smem[norm::kWarps];
  __shared__ norm::Vec<T> staged[kIters * norm::kThreads];
  __shared__ uint32_t buf, prev;
  __shared__ bool stopped;
  const int rank = s.rank;
  flagfree_turn(s, size_t(a.rows) * a.nvec, &buf, &prev, &stopped);
  if (stopped) return;
  // Push everything first, so no peer waits on data this rank has yet to send. The push is
  // spread over the whole grid in runs of 32 vectors, one warp's coalesced 512 bytes, not by
  // row: at decode sizes there are fewer rows than blocks, and a row pushed by its own block
  // alone left one SM to write it to every peer. Measured 2026-11-23, world 2, H200, with the
  // receive below: 7.68 -> 7.57 us at one 8192-value row, 10.01 -> 8.74 us at 16 rows (the
  // flag-free all-reduce + standalone norm: 6.86 and 7.82, so still ahead). Which
  // block pushes a vector does not matter to the receivers, who wait for each vector's sentinel
  // to go; nor to the clears (flagfree_clear): a peer rewrites this call's buffer only two calls
  // later, after its kernel of the next call, which waits on data this rank sends only once
  // this whole kernel (every block's clear) has finished.
  {
    const size_t total = size_t(a.rows) * a.nvec;
    const size_t warps = size_t(gridDim.x) * (blockDim.x / 32);
    const size_t warp = size_t(threadIdx.x / 32) * gridDim.x + blockIdx.x;  // neighbours on different SMs
    for (size_t idx = warp * 32 + threadIdx.x % 32; idx < total; idx += warps * 32) {
      const uint4 v = without_sentinel(x[idx]);
      for (int p = 0; p < W; ++p)
        if (p != rank) reinterpret_cast<uint4*>(recv.ptr[p])[(buf * W + rank) * slot_vecs + idx] = v;
    }
  }
  const uint4* mine = reinterpret_cast<const uint4*>(recv.ptr[rank]);
  const int items = a.rows * a.parts;
  const norm::Vec<T>* w = blockIdx.x < items ? stage_weight<T, kIters>(a, staged) : nullptr;
  const float scale = norm::load_out_scale(a.out, a.out.quant);
  // Block b takes rows and parts b, b + gridDim.x, ... of the rows x parts items; every block of
  // a row reads all of it.
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int row = item / a.parts, part = item % a.parts;
    const int64_t base = int64_t(row) * a.nvec;
    // Every slot of every vector of the row, and the residual, is looked at first (one round of
    // loads in flight), then only the slots still unwritten are waited on, as flag_free does:
    // waiting vector by vector kept a thread's kIters trips to memory one after another.
    uint4 v[kIters][W];
    norm::Vec<T> res[kIters];
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int j = threadIdx.x + i * norm::kThreads;
      if (j >= a.nvec) continue;
      const size_t idx = size_t(base) + j;
#pragma unroll
      for (int r = 0; r < W; ++r)
        v[i][r] = r == rank ? without_sentinel(x[idx]) : load_volatile(mine + (buf * W + r) * slot_vecs + idx);
      if (a.residual != nullptr) res[i] = norm::load_vec(reinterpret_cast<const norm::Vec<T>*>(a.residual) + idx);
    }
    norm::Vec<T> h[kIters];
    bool gave_up = false;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int j = threadIdx.x + i * norm::kThreads;
      if (j >= a.nvec || gave_up) continue;
      const size_t idx = size_t(base) + j;
#pragma unroll
      for (int r = 0; r < W; ++r) {
        if (r == rank || !has_sentinel(v[i][r]) || gave_up) continue;
        const uint4* p = mine + (buf * W + r) * slot_vecs + idx;
        const uint64_t t0 = now_ns();
        do {
          if (has_given_up(s)) {
            gave_up = true;
          } else if (now_ns() - t0 > s.timeout_ns) {
            give_up(s, abort_code(SYMCOMM_AR_ABORT_TIMEOUT, kFlagFreePhase, r));
            gave_up = true;
          } else {
            v[i][r] = load_volatile(p);
          }
        } while (!gave_up && has_sentinel(v[i][r]));
      }
      if (!gave_up) h[i] = sum_h<T, W>(v[i], res[i], a);
    }
    // rmsnorm_row synchronises the block: every thread leaves together, or none does.
    if (__syncthreads_or(gave_up)) {
      norm::wait_copies();
      return;
    }
    store_h<T, kIters>(h, base, part, a);
    norm::rmsnorm_row<T, kIters, FusedMode>(h, w, scale, row, a.nvec, a.eps, a.out, smem, a.parts, part);
  }
  flagfree_clear<W>(s, recv, slot_vecs, buf, prev);
}

template <typename T, int W, int kIters>
cudaError_t launch_norm(Context* c, int algo, const uint4* x, int slot, size_t in_offset, const NormRows<T>& a,
                        const ScratchLayout& lay, cudaStream_t stream) {
  const Sync s = make_sync(c);
  // Blocks per row: with fewer rows than blocks, a row's sum of squares, normalisation and
  // quantization ran on one SM while the grid's other blocks idled. Every block of a row reads
  // and sums all of it (so the reduction order, and every bit, stays the standalone kernel's)
  // and writes its part, as rmsnorm.cu splits decode rows. Two-shot keeps one block per row:
  // its gather copies the rows a block wrote itself. Equal on every rank (rows and the grid
  // caps are), as block b meets block b.
  const int cap = algo == SYMCOMM_AR_FLAGFREE ? c->flagfree_blocks : c->grid_blocks;
  const int parts = algo == SYMCOMM_AR_TWOSHOT ? 1 : norm::row_parts(a.rows, a.nvec, cap, false);
  const int64_t items = int64_t(a.rows) * parts;
  const int blocks = items < c->grid_blocks ? int(items) : c->grid_blocks;
  // One block per row on a rank whose h is its residual itself (in place; norm::row_parts says
  // why). That is this rank's own business, so the grid above stays every rank's: surplus blocks
  // only meet their peers. (x never overlaps h: validation refuses it.)
  NormRows<T> split = a;
  const size_t bytes = size_t(a.rows) * size_t(a.nvec) * sizeof(norm::Vec<T>);
  split.parts = norm::overlaps(a.residual_out, a.residual, bytes) ? 1 : parts;
  switch (algo) {
    case SYMCOMM_AR_FLAGFREE:
      return launch(c->overlap, flag_free_norm<T, W, kIters>, c->flagfree_blocks, norm::kThreads, stream, s,
                    c->flagfree, x, c->flagfree_bytes / 16, split);
    case SYMCOMM_AR_ONESHOT:
      return launch(c->overlap, one_shot_norm<T, W, kIters>, blocks, norm::kThreads, stream, s, c->slots + slot,
                    in_offset, split);
    case SYMCOMM_AR_TWOSHOT:
      return launch(c->overlap, two_shot_norm<T, W, kIters>, blocks, norm::kThreads, stream, s, c->scratch,
                    c->slots + slot, in_offset, split, lay);
    default:
      return cudaErrorInvalidValue;
  }
}

constexpr size_t round16(size_t n) { return (n + 15) / 16 * 16; }

}  // namespace

extern "C" {

int symcomm_ar_rmsnorm(symcomm_ar_t ctx, symcomm_ar_algo_t algo, const void* x, int slot, uint64_t in_offset,
                       int stage, const symcomm_rmsnorm_args_t* args, cudaStream_t stream) {
  if (args == nullptr) return cudaErrorInvalidValue;
  const symcomm_dtype_t dtype = args->dtype;
  const void *residual = args->residual, *weight = args->weight, *scale_ptr = args->scale_ptr;
  const int64_t rows = args->rows, cols = args->cols;
  const float eps = args->eps, scale_value = args->scale_value;
  void *residual_out = args->residual_out, *out = args->out, *scales = args->scales;
  const symcomm_norm_quant_t quant = args->quant;
  const int swizzle = args->swizzle;
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  const int q = static_cast<int>(quant);
  const int64_t nvec = cols / norm::kVec;
  const size_t nbytes = size_t(rows) * size_t(cols) * 2;  // bf16 / fp16
  const size_t y_row = q == norm::kQuantNone ? size_t(cols) * 2 : q == norm::kQuantFp8 ? size_t(cols) : size_t(cols) / 2;
  ScratchLayout lay{round16(nbytes), round16(nbytes) + round16(size_t(rows) * y_row), y_row};
  const size_t scratch_need = lay.scales_offset + (q == norm::kQuantNvfp4 ? size_t(rows) * size_t(cols) / 16 : 0);
  if (rows < 0 || rows > INT32_MAX || cols <= 0 || cols % 16 || nvec > 4 * norm::kThreads || slot < 0 ||
      slot >= c->max_slots || (dtype != SYMCOMM_FLOAT16 && dtype != SYMCOMM_BFLOAT16) ||
      (q != norm::kQuantNone && q != norm::kQuantFp8 && q != norm::kQuantNvfp4) || residual_out == nullptr ||
      (algo == SYMCOMM_AR_FLAGFREE ? nbytes > c->flagfree_bytes : nbytes > c->staging_bytes) ||
      (algo == SYMCOMM_AR_TWOSHOT && scratch_need > c->staging_bytes))
    return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (stage && algo != SYMCOMM_AR_FLAGFREE && (err = stage_input(c, x, nbytes, &slot, &in_offset, stream)) != cudaSuccess)
    return err;
  if (q == norm::kQuantNvfp4 && swizzle) {
    // The padding of the 128x4 tiles reads as zero scales, as symcomm.fp4.quantize writes it.
    const size_t padded = size_t(symcomm::fp4::padded_rows(rows)) * symcomm::fp4::padded_cols(cols / 16);
    if ((err = cudaMemsetAsync(scales, 0, padded, stream)) != cudaSuccess) return err;
  }
  const norm::Output o{q, out, static_cast<uint8_t*>(scales), static_cast<const float*>(scale_ptr), scale_value,
                       swizzle, symcomm::fp4::padded_cols(cols / 16)};
  const uint4* xv = static_cast<const uint4*>(x);
  return for_dtype(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    if constexpr (std::is_same<T, float>::value) {
      return cudaErrorInvalidValue;  // refused above; no fp32 instantiation
    } else {
      const NormRows<T> a{static_cast<const T*>(residual), static_cast<T*>(residual_out), static_cast<const T*>(weight),
                          eps, int(rows), int(nvec), 1, o};
      return for_world(c->world, [&](auto w) {
        constexpr int W = decltype(w)::value;
        const int iters = int((nvec + norm::kThreads - 1) / norm::kThreads);
        if (iters <= 1) return launch_norm<T, W, 1>(c, algo, xv, slot, in_offset, a, lay, stream);
        if (iters <= 2) return launch_norm<T, W, 2>(c, algo, xv, slot, in_offset, a, lay, stream);
        return launch_norm<T, W, 4>(c, algo, xv, slot, in_offset, a, lay, stream);
      });
    }
  });
}

}  // extern "C"
