// Uneven all-gather by push (symcomm/backends/peer_gather.py) and the fused NVFP4 dispatch
// (symcomm/operations/all_gatherv_fp4.py): their kernels and entry points, over the peer machinery of peer.cuh
// and, for the dispatch, the codec of fp4.cuh.
#include "peer.cuh"
#include "symcomm_testing.h"
#include "fp4.cuh"

#include <cstring>

namespace {
using namespace symcomm::ar;
using symcomm::launch;

// The tensors one gather_push launch writes: this rank's rows of each (src, nvec vectors) go to
// byte dst_offset of slot `slot` on every rank.
constexpr int kMaxPieces = SYMCOMM_AR_MAX_PIECES;
struct Pieces {
  const uint4* src[kMaxPieces];
  uint64_t dst_offset[kMaxPieces];
  uint64_t nvec[kMaxPieces];
  int slot[kMaxPieces];
  int count;
};

// Uneven all-gather by push. Every rank's output sits at the same offset of a symmetric region
// mapped by all (a slot), so each rank writes its own rows straight into every peer's output,
// several tensors (pieces) in one launch, then meets the peers. Start barrier: a peer may
// still be reading its output from the previous use, and nothing else tells us it finished.
// End barrier: after it, every peer's rows have landed here (their writes precede their
// release of our flag). Peers are visited from rank+1 on, so ranks do not all write one peer
// at once.
// Copies each piece's vectors into every rank's slot, this thread's share of them (grid stride).
// `first_v` is the first piece's first vector of this thread, loaded by the caller before its
// start barrier (first_vector).
template <int W>
__device__ __forceinline__ void push_pieces(const Sync& s, const Peers* slots, const Pieces& pieces, uint4 first_v) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int k = 0; k < pieces.count; ++k) {
    uint4* dst[W];
#pragma unroll
    for (int q = 0; q < W; ++q) dst[q] = reinterpret_cast<uint4*>(slots[pieces.slot[k]].ptr[(s.rank + q) % W] + pieces.dst_offset[k]);
    const uint4* src = pieces.src[k];
    for (size_t i = first; i < pieces.nvec[k]; i += stride) {
      const uint4 v = k == 0 && i == first ? first_v : src[i];
#pragma unroll
      for (int q = 0; q < W; ++q) dst[q][i] = v;
    }
  }
}

// This thread's first vector of the first piece: local input, so it is loaded in the prologue's
// round trip, before the start barrier (which guards only the peers' outputs).
__device__ __forceinline__ uint4 first_vector(const Pieces& pieces) {
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  return pieces.count > 0 && first < pieces.nvec[0] ? pieces.src[0][first] : uint4{};
}

// Whether every piece's slot is mapped on every rank (slot_ready), folded with & rather than &&
// so that no piece's check waits for the one before to pass. (Loading all kMaxPieces slots'
// pointers up front, unused ones as slot 0, took gather_push to 128 registers and spills at
// world 8; the pieces' pointers come a round trip after the first slots' instead.)
template <int W>
__device__ __forceinline__ bool pieces_ready(const Sync& s, const Peers* slots, const Pieces& pieces) {
  bool ready = true;
#pragma unroll
  for (int k = 0; k < kMaxPieces; ++k)
    if (k < pieces.count) ready &= slot_ready(s, slots + pieces.slot[k], W);
  return ready;
}

// The prologue's loads (the epoch's words, the slots' pointers, the first input vector) share one
// round trip: at the sizes where push serves first (tens of KiB), the kernel is a chain of them.
template <int W>
__global__ void __launch_bounds__(kThreads) gather_push(Sync s, const Peers* slots, Pieces pieces) {
  const EpochWords words = begin_epoch(s);
  const uint4 first_v = first_vector(pieces);
  const bool ready = pieces_ready<W>(s, slots, pieces);
  const uint64_t epoch = end_epoch(s, words);
  if (epoch == 0 || !ready) return;
  if (!barrier(s, kStart, W, epoch)) return;
  push_pieces<W>(s, slots, pieces, first_v);
  barrier(s, kEnd, W, epoch);
}


// ------------------------------------------------------------------ fused NVFP4 dispatch
// Where one rank's NVFP4 rows land in the gathered payload and block scales: byte offsets from
// the gathered tensors' row 0 (linear scales: one byte per block, blocks in row order, so this
// rank's blocks are one run starting at its first row). The kernel and its host twin share it,
// so CPU CI checks the addressing along with the encoding.
struct Fp4Rows {
  int64_t blocks;       // this rank's 16-value blocks: rows * cols / 16
  int64_t first_block;  // row_offset * cols / 16: where they start in the gathered output
  SYMCOMM_HD uint64_t payload_at(int64_t b) const { return uint64_t(first_block + b) * 8; }
  SYMCOMM_HD uint64_t scale_at(int64_t b) const { return uint64_t(first_block + b); }
};

// One block of 16 values, encoded by the codec's own fp4::encode_block: the kernel and
// symcomm_ar_gatherv_fp4_host both come through here, so the bytes symcomm_fp4_quantize
// writes are the bytes the fused kernel writes (tests/test_fp4_dispatch.py checks the host
// twin against fp4.quantize_host).
template <typename T>
SYMCOMM_HD uint8_t encode16(const T* x, float gs, uint32_t (&words)[2]) {
  float v[symcomm::fp4::kBlock];
#pragma unroll
  for (int i = 0; i < symcomm::fp4::kBlock; ++i) v[i] = symcomm::to_f32(x[i]);
  return symcomm::fp4::encode_block(v, gs, words);
}

struct Fp4Push {
  const void* x;          // this rank's rows, 16-byte aligned
  const float* gs_ptr;    // the global scale on the device, or null: gs_value
  float gs_value;
  Fp4Rows rows;
  int payload_slot, scales_slot;
  uint64_t payload_offset, scales_offset;  // the gathered tensors' row 0, in their slots' regions
};

// Fused FP4 dispatch: gather_push's pattern, with the payload and block scales produced on the
// way. Each thread encodes one block of 16 values of this rank's rows and stores its 8 payload
// bytes and its scale byte straight into every peer's gathered outputs, then the extras move as
// gather_push's pieces. The barriers are gather_push's, for the same reasons: start, a peer
// may still be reading its outputs from the previous use; end, every peer's rows have landed.
// A warp stores 256 consecutive payload bytes and 32 consecutive scale bytes per peer, which
// the memory system merges into whole sectors, so byte-sized scales cost no extra transactions.
//
// Everything the prologue can load without the peers (the epoch's words, the slots' pointers,
// the global scale, this thread's first block of values and the extras' first vector) is loaded
// in one round trip before the start barrier, as gather_push does.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads) gather_fp4_push(Sync s, const Peers* slots, Fp4Push job, Pieces extras) {
  constexpr int kLoads = symcomm::fp4::kBlock * sizeof(T) / 16;
  const uint4* x = static_cast<const uint4*>(job.x);
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const EpochWords epoch_words = begin_epoch(s);
  const float gs = job.gs_ptr != nullptr ? *job.gs_ptr : job.gs_value;
  alignas(16) T first_block[symcomm::fp4::kBlock];
  if (first < size_t(job.rows.blocks)) {
#pragma unroll
    for (int j = 0; j < kLoads; ++j) reinterpret_cast<uint4*>(first_block)[j] = __ldg(x + first * kLoads + j);
  }
  const uint4 first_extra = first_vector(extras);
  const Peers* const used[] = {slots + job.payload_slot, slots + job.scales_slot};
  const bool ready = slots_ready(s, used, W) & pieces_ready<W>(s, slots, extras);
  const uint64_t epoch = end_epoch(s, epoch_words);
  if (epoch == 0 || !ready) return;
  if (!barrier(s, kStart, W, epoch)) return;
  uint8_t* payload[W];
  uint8_t* scales[W];
#pragma unroll
  for (int q = 0; q < W; ++q) {
    const int peer = (s.rank + q) % W;
    payload[q] = reinterpret_cast<uint8_t*>(slots[job.payload_slot].ptr[peer] + job.payload_offset);
    scales[q] = reinterpret_cast<uint8_t*>(slots[job.scales_slot].ptr[peer] + job.scales_offset);
  }
  for (size_t b = first; b < size_t(job.rows.blocks); b += stride) {
    alignas(16) T v[symcomm::fp4::kBlock];
    if (b == first) {
#pragma unroll
      for (int j = 0; j < kLoads; ++j) reinterpret_cast<uint4*>(v)[j] = reinterpret_cast<const uint4*>(first_block)[j];
    } else {
#pragma unroll
      for (int j = 0; j < kLoads; ++j) reinterpret_cast<uint4*>(v)[j] = __ldg(x + b * kLoads + j);
    }
    uint32_t words[2];
    const uint8_t scale = encode16(v, gs, words);
    const uint2 packed = make_uint2(words[0], words[1]);
    const uint64_t at = job.rows.payload_at(int64_t(b)), sat = job.rows.scale_at(int64_t(b));
#pragma unroll
    for (int q = 0; q < W; ++q) {
      *reinterpret_cast<uint2*>(payload[q] + at) = packed;
      scales[q][sat] = scale;
    }
  }
  push_pieces<W>(s, slots, extras, first_extra);
  barrier(s, kEnd, W, epoch);
}

bool fp4_shape(int64_t rows, int64_t cols, int64_t row_offset, int64_t total_rows, Fp4Rows* out) {
  if (rows < 0 || row_offset < 0 || cols <= 0 || cols % symcomm::fp4::kBlock || row_offset + rows > total_rows)
    return false;
  out->blocks = rows * (cols / symcomm::fp4::kBlock);
  out->first_block = row_offset * (cols / symcomm::fp4::kBlock);
  return true;
}

template <typename T>
void gatherv_fp4_on_host(const void* x, const Fp4Rows& rows, float gs, uint8_t* payload, uint8_t* scales) {
  const T* xt = static_cast<const T*>(x);
  for (int64_t b = 0; b < rows.blocks; ++b) {
    uint32_t words[2];
    scales[rows.scale_at(b)] = encode16(xt + b * symcomm::fp4::kBlock, gs, words);
    std::memcpy(payload + rows.payload_at(b), words, 8);  // little-endian, as the kernel's uint2 store
  }
}

}  // namespace

extern "C" {

int symcomm_ar_gatherv(symcomm_ar_t ctx, int npieces, const uint64_t* srcs, const int* slots,
                       const uint64_t* dst_offsets, const uint64_t* nbytes, uint64_t total_bytes,
                       cudaStream_t stream) {
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  if (npieces < 0 || npieces > kMaxPieces) return cudaErrorInvalidValue;
  Pieces pieces{};
  pieces.count = npieces;
  for (int k = 0; k < npieces; ++k) {
    // An empty piece is never read: its address may be anything a 0-row view has.
    if (((nbytes[k] ? srcs[k] : 0) | dst_offsets[k] | nbytes[k]) % 16 || slots[k] < 1 || slots[k] >= c->max_slots)
      return cudaErrorInvalidValue;
    pieces.src[k] = reinterpret_cast<const uint4*>(srcs[k]);
    pieces.slot[k] = slots[k];
    pieces.dst_offset[k] = dst_offsets[k];
    pieces.nvec[k] = nbytes[k] / 16;
  }
  // The grid must be the same on every rank (block b meets block b), so it follows the total,
  // which every rank knows, not this rank's share.
  const int blocks = blocks_for(c, total_bytes / 16 / size_t(c->world));
  const Sync s = make_sync(c);
  return for_world(c->world, [&](auto w) {
    return launch(c->overlap, gather_push<decltype(w)::value>, blocks, kThreads, stream, s, c->slots, pieces);
  });
}

int symcomm_ar_gatherv_fp4(symcomm_ar_t ctx, const symcomm_gatherv_fp4_args_t* args, cudaStream_t stream) {
  if (args == nullptr) return cudaErrorInvalidValue;
  const symcomm_gatherv_fp4_args_t& g = *args;
  const void* x = g.x;
  const symcomm_dtype_t dtype = g.dtype;
  const int64_t rows = g.rows, cols = g.cols, row_offset = g.row_offset, total_rows = g.total_rows;
  const int payload_slot = g.payload_slot, scales_slot = g.scales_slot, nextra = g.nextra;
  const uint64_t payload_offset = g.payload_offset, scales_offset = g.scales_offset;
  const uint64_t *extra_srcs = g.extra_srcs, *extra_offsets = g.extra_offsets, *extra_row_bytes = g.extra_row_bytes;
  const int* extra_slots = g.extra_slots;
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  Fp4Push job{};
  if (!fp4_shape(rows, cols, row_offset, total_rows, &job.rows)) return cudaErrorInvalidValue;
  if (dtype != SYMCOMM_BFLOAT16 && dtype != SYMCOMM_FLOAT16) return cudaErrorInvalidValue;
  if (nextra < 0 || nextra > kMaxPieces - 2) return cudaErrorInvalidValue;
  const auto bad_slot = [&](int slot) { return slot < 1 || slot >= c->max_slots; };
  // The payload goes out as 8-byte stores, the input comes in as 16-byte loads.
  if ((rows > 0 && reinterpret_cast<uintptr_t>(x) % 16) || payload_offset % 8 || bad_slot(payload_slot) ||
      bad_slot(scales_slot))
    return cudaErrorInvalidValue;
  job.x = x;
  job.gs_ptr = static_cast<const float*>(g.gs_ptr);
  job.gs_value = g.gs_value;
  job.payload_slot = payload_slot;
  job.scales_slot = scales_slot;
  job.payload_offset = payload_offset;
  job.scales_offset = scales_offset;
  Pieces extras{};
  extras.count = nextra;
  uint64_t total_vectors = uint64_t(total_rows) * uint64_t(cols / symcomm::fp4::kBlock);  // one thread per block
  for (int k = 0; k < nextra; ++k) {
    if (((rows ? extra_srcs[k] : 0) | extra_offsets[k] | extra_row_bytes[k]) % 16 || bad_slot(extra_slots[k]))
      return cudaErrorInvalidValue;
    extras.src[k] = reinterpret_cast<const uint4*>(extra_srcs[k]);
    extras.slot[k] = extra_slots[k];
    extras.dst_offset[k] = extra_offsets[k] + uint64_t(row_offset) * extra_row_bytes[k];
    extras.nvec[k] = uint64_t(rows) * extra_row_bytes[k] / 16;
    total_vectors += uint64_t(total_rows) * extra_row_bytes[k] / 16;
  }
  // Equal on every rank (block b meets block b): it follows the totals, which every rank knows.
  const int blocks = blocks_for(c, total_vectors / size_t(c->world));
  const Sync s = make_sync(c);
  return for_world(c->world, [&](auto w) {
    constexpr int W = decltype(w)::value;
    if (dtype == SYMCOMM_BFLOAT16)
      return launch(c->overlap, gather_fp4_push<__nv_bfloat16, W>, blocks, kThreads, stream, s, c->slots, job, extras);
    return launch(c->overlap, gather_fp4_push<__half, W>, blocks, kThreads, stream, s, c->slots, job, extras);
  });
}

int symcomm_ar_gatherv_fp4_host(const symcomm_gatherv_fp4_args_t* args, void* payload, void* scales) {
  if (args == nullptr) return cudaErrorInvalidValue;
  const void* x = args->x;
  const int64_t rows = args->rows, cols = args->cols, row_offset = args->row_offset, total_rows = args->total_rows;
  const float global_scale = args->gs_value;
  Fp4Rows where{};
  if (!fp4_shape(rows, cols, row_offset, total_rows, &where)) return cudaErrorInvalidValue;
  auto* p = static_cast<uint8_t*>(payload);
  auto* sc = static_cast<uint8_t*>(scales);
  switch (args->dtype) {
    case SYMCOMM_BFLOAT16: gatherv_fp4_on_host<__nv_bfloat16>(x, where, global_scale, p, sc); break;
    case SYMCOMM_FLOAT16: gatherv_fp4_on_host<__half>(x, where, global_scale, p, sc); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

}  // extern "C"
