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
constexpr unsigned kFullMask = 0xFFFFFFFFu;  // every lane of a warp, for shuffles

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

// ------------------------------------------------------------------ flag-free NVFP4 gather
// The flag-free all-gather (custom_ar.cu's flag_free_gather: the same receive buffers, turn and
// clear, so it may follow any flag-free kernel) carrying NVFP4 rows quantized on the way. No
// barrier and no peer mapping of the outputs: a rank pushes its chunk into its peers' receive
// slots and copies theirs out of its own, where each vector is its own flag.
//
// A rank's chunk on the wire: its payload, two blocks (16 bytes) a vector, then its block scales,
// 16 a vector, each part zero-padded to whole vectors. No wire word may be the sentinel
// 0xFFFFFFFF, and neither part needs a swap to ensure it (tests/test_fp4_flagfree.py checks
// both facts of the codec on the CPU, tests/gpu_sim/test_sim_flagfree_fp4.py on the device):
// - payload: the codec never writes code 8 (-0; a value that rounds to zero is +0), so no
//   payload word is 0x88888888. Sent XORed with 0x77777777, a word reads as the sentinel only
//   if it was 0x88888888: never.
// - scales: a scale byte is e4m3 of a value in [0, 448] or the NaN 0x7F (a negative or NaN
//   global scale gives 0 or 0x7F), so its top bit is clear and no scale word is 0xFFFFFFFF.
struct Fp4Wire {
  static constexpr uint32_t kPayloadMask = 0x77777777u;
  SYMCOMM_HD static int64_t payload_vecs(int64_t blocks) { return (blocks + 1) / 2; }
  SYMCOMM_HD static int64_t scale_vecs(int64_t blocks) { return (blocks + 15) / 16; }
  SYMCOMM_HD static int64_t vecs(int64_t blocks) { return payload_vecs(blocks) + scale_vecs(blocks); }
};

// The first n (<= 16) bytes of v to dst, whatever dst's alignment: one store where it allows.
SYMCOMM_HD void put_bytes(uint8_t* dst, const uint4& v, int n) {
#ifdef __CUDA_ARCH__
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst);
  if (n == 16 && a % 16 == 0) {
    *reinterpret_cast<uint4*>(dst) = v;
  } else if (n % 8 == 0 && a % 8 == 0) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(v.x, v.y);
    if (n == 16) *reinterpret_cast<uint2*>(dst + 8) = make_uint2(v.z, v.w);
  } else if (n == 4 && a % 4 == 0) {
    *reinterpret_cast<uint32_t*>(dst) = v.x;
  } else {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 16; ++k)  // unrolled, so w stays in registers
      if (k < n) dst[k] = uint8_t(w[k / 4] >> (8 * (k % 4)));
  }
#else
  std::memcpy(dst, &v, size_t(n));  // little-endian, as the device's stores
#endif
}

// Vector i of the chunk of a rank holding `blocks` blocks from block `first_block` of the
// gathered outputs, as received, into those outputs. The kernel's receivers and its host twin
// both decode through here.
SYMCOMM_HD void unpack_fp4_wire(uint4 v, int64_t i, int64_t blocks, int64_t first_block, uint8_t* payload,
                                uint8_t* scales) {
  const int64_t pay = Fp4Wire::payload_vecs(blocks);
  if (i < pay) {
    v.x ^= Fp4Wire::kPayloadMask, v.y ^= Fp4Wire::kPayloadMask, v.z ^= Fp4Wire::kPayloadMask,
        v.w ^= Fp4Wire::kPayloadMask;
    const int n = blocks - 2 * i >= 2 ? 16 : 8;
    put_bytes(payload + (first_block + 2 * i) * 8, v, n);
  } else {
    const int64_t j = i - pay, left = blocks - 16 * j;
    put_bytes(scales + first_block + 16 * j, v, left >= 16 ? 16 : int(left));
  }
}

struct Fp4FlagFree {
  const void* x;  // this rank's rows, 16-byte aligned
  const float* gs_ptr;
  float gs_value;
  uint8_t* payload;  // this rank's gathered outputs (local memory)
  uint8_t* scales;
  int64_t blocks[kMaxRanks];       // every rank's 16-value blocks
  int64_t first_block[kMaxRanks];  // where each rank's blocks start in the gathered outputs
  bool block_major;                // lanes numbered block by block rather than spread (measurements only)
};

// Where the sending lanes put what they encode: this rank's own outputs, every peer's slot.
struct Fp4Send {
  uint8_t* payload;  // this rank's own outputs at its first block
  uint8_t* scales;
  int64_t blocks, pay;  // this rank's blocks and payload vectors
};

// The sending half, one thread per half-block t (8 values, one 16-byte load): the block's amax
// comes from the partner lane by one shuffle (the split encoding csrc/rmsnorm.cuh also uses: the
// same bits as encode_block), and the thread stores its payload word, word t of the chunk, into
// every peer's slot. A receiver consumes a vector only once none of its words is the sentinel,
// so its four words may come from four stores. A warp holds 16 blocks, one scale vector, whose
// four words lanes 0, 8, 16 and 24 assemble by shuffles.
template <typename T, int W>
__device__ __forceinline__ void send_half_blocks(const Sync& s, const Peers& recv, uint32_t buf, size_t slot_vecs,
                                                 const uint4* x, float gs, const Fp4Send& me, size_t first,
                                                 uint4 first_in) {
  const int lane = threadIdx.x % 32;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const int64_t halves = 2 * me.blocks;
  // Payload words run to 4 * pay: an odd block count's last vector ends in two padding words,
  // sent like any other so that the receiver's vector completes.
  for (size_t base = first - lane; int64_t(base) < 4 * me.pay; base += stride) {  // the same in every lane
    const int64_t t = int64_t(base) + lane;
    const bool valid = t < halves;
    alignas(16) T v16[8];
    *reinterpret_cast<uint4*>(v16) = !valid ? uint4{} : base == first - lane ? first_in : __ldg(x + t);
    float v[8];
    uint32_t amax = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      v[k] = symcomm::to_f32(v16[k]);
      amax = symcomm::fp4::amax_step(amax, v[k]);
    }
    const uint32_t other = __shfl_xor_sync(kFullMask, amax, 1);
    amax = other > amax ? other : amax;
    const uint8_t scale = valid ? symcomm::fp4::block_scale(amax, gs) : 0;
    uint32_t code = 0u;
    if (valid && !symcomm::fp4::scale_is_nan(scale)) code = symcomm::fp4::pack8(v, symcomm::fp4::block_inv(scale, gs));
    if (valid) {
      put_bytes(me.payload + t * 4, make_uint4(code, 0u, 0u, 0u), 4);
      if (t % 2 == 0) me.scales[t / 2] = scale;
    }
    if (t < 4 * me.pay) {  // past it the chunk's scale vectors begin
#pragma unroll
      for (int p = 0; p < W; ++p)
        if (p != s.rank)
          reinterpret_cast<uint32_t*>(flagfree_slot<W>(recv, p, buf, s.rank, slot_vecs))[t] = code ^ Fp4Wire::kPayloadMask;
    }
    // Scale word lane / 8 of this warp's scale vector: the bytes of the blocks of lanes +0, +2,
    // +4 and +6 (a block's two lanes hold the same byte; padding blocks hold 0).
    const uint32_t b = scale;
    const uint32_t word = b | __shfl_down_sync(kFullMask, b, 2) << 8 | __shfl_down_sync(kFullMask, b, 4) << 16 |
                          __shfl_down_sync(kFullMask, b, 6) << 24;
    if (lane % 8 == 0 && int64_t(base) < halves) {
      const int64_t at = 4 * (me.pay + int64_t(base) / 32) + lane / 8;  // the word's index in the chunk
#pragma unroll
      for (int p = 0; p < W; ++p)
        if (p != s.rank) reinterpret_cast<uint32_t*>(flagfree_slot<W>(recv, p, buf, s.rank, slot_vecs))[at] = word;
    }
  }
}

// The flag-free NVFP4 gather's largest block. fp4_launch takes kThreads; symcomm_fp4_debug_grid
// may force up to this many, to measure what larger blocks do.
constexpr int kFp4MaxThreads = 1024;

// One lane per half-block. Warps take work spread over the grid's blocks (warp w of block b is
// the grid's warp w * gridDim.x + b), so that a small chunk's encoding runs on every SM rather
// than queueing on the first few: at 84 KiB of bf16 rows, block-major lanes of two blocks each
// put it on 3 SMs and took 6.0 us where the bf16 gather takes 4.1 (bench/NOTES.md, seventeenth
// session). This rank's own blocks go straight into its outputs. A thread's first values and the
// global scale are loaded in the round trip of the turn's words.
template <typename T, int W>
__global__ void __launch_bounds__(kFp4MaxThreads) flag_free_gather_fp4(Sync s, Peers recv, Fp4FlagFree job,
                                                                       size_t slot_vecs) {
  static_assert(sizeof(T) == 2, "a half-block of 16-bit values is one 16-byte load");
  const int rank = s.rank, lane = threadIdx.x % 32;
  const int64_t mine = of_rank<W>(job.blocks, rank), my_first = of_rank<W>(job.first_block, rank);
  const Fp4Send me{job.payload + my_first * 8, job.scales + my_first, mine, Fp4Wire::payload_vecs(mine)};
  size_t received = 0;  // the longest chunk a peer writes into our slots
#pragma unroll
  for (int r = 0; r < W; ++r) {
    const size_t theirs = sent(size_t(Fp4Wire::vecs(job.blocks[r])));
    if (r != rank && theirs > received) received = theirs;
  }
  __shared__ uint32_t buf, prev;
  __shared__ bool stopped;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t first = job.block_major ? size_t(blockIdx.x) * blockDim.x + threadIdx.x
                                       : (size_t(threadIdx.x / 32) * gridDim.x + blockIdx.x) * 32 + lane;  // spread
  const uint4* x = static_cast<const uint4*>(job.x);
  const FlagFreeWords words = flagfree_begin(s);
  const float gs = job.gs_ptr != nullptr ? *job.gs_ptr : job.gs_value;
  const uint4 first_in = int64_t(first) < 2 * mine ? __ldg(x + first) : uint4{};  // this lane's first half-block
  flagfree_end(s, words, received, &buf, &prev, &stopped);
  if (stopped) return;
  if (mine == 0 && blockIdx.x == 0 && threadIdx.x == 0) {  // the placeholder of an empty chunk
#pragma unroll
    for (int p = 0; p < W; ++p)
      if (p != rank) flagfree_slot<W>(recv, p, buf, rank, slot_vecs)[0] = uint4{};
  }
  send_half_blocks<T, W>(s, recv, buf, slot_vecs, x, gs, me, first, first_in);
  flagfree_clear<W>(s, recv, slot_vecs, buf, prev);
  for (size_t i = first; i < received; i += stride) {
    unsigned senders = 0;
#pragma unroll
    for (int r = 0; r < W; ++r)
      if (r != rank && i < sent(size_t(Fp4Wire::vecs(job.blocks[r])))) senders |= 1u << r;
    uint4 v[W];
    if (!flagfree_receive<W>(s, recv, buf, slot_vecs, i, uint4{}, v, senders)) return;
#pragma unroll
    for (int r = 0; r < W; ++r)
      if (r != rank && int64_t(i) < Fp4Wire::vecs(job.blocks[r]))
        unpack_fp4_wire(v[r], int64_t(i), job.blocks[r], job.first_block[r], job.payload, job.scales);
  }
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

// Every rank's blocks and where they start, from the row counts (the same on every rank).
bool fp4_chunks(const int64_t* rows, int world, int64_t cols, Fp4FlagFree* job, int64_t* total_blocks) {
  if (rows == nullptr || cols <= 0 || cols % symcomm::fp4::kBlock) return false;
  int64_t at = 0;
  for (int r = 0; r < world; ++r) {
    if (rows[r] < 0) return false;
    job->blocks[r] = rows[r] * (cols / symcomm::fp4::kBlock);
    job->first_block[r] = at;
    at += job->blocks[r];
  }
  *total_blocks = at;
  return true;
}

// The sending half of flag_free_gather_fp4 on the CPU: rank `rank`'s chunk as its wire vectors
// (per block, where the kernel gathers scale bytes by shuffle), then decoded by unpack_fp4_wire.
template <typename T>
void flagfree_fp4_on_host(const T* x, const Fp4FlagFree& job, int rank, float gs, uint8_t* wire, uint8_t* payload,
                          uint8_t* scales) {
  const int64_t blocks = job.blocks[rank], pay = Fp4Wire::payload_vecs(blocks);
  std::memset(wire, 0, size_t(Fp4Wire::vecs(blocks)) * 16);
  for (int64_t b = 0; b < blocks; ++b) {
    uint32_t words[2];
    const uint8_t scale = encode16(x + b * symcomm::fp4::kBlock, gs, words);
    std::memcpy(wire + b * 8, words, 8);
    wire[pay * 16 + b] = scale;
  }
  for (int64_t i = 0; i < pay; ++i) {  // the padding half of an odd last vector is sent XORed too
    uint32_t w[4];
    std::memcpy(w, wire + i * 16, 16);
    for (uint32_t& word : w) word ^= Fp4Wire::kPayloadMask;
    std::memcpy(wire + i * 16, w, 16);
  }
  for (int64_t i = 0; i < Fp4Wire::vecs(blocks); ++i) {
    uint4 v;
    std::memcpy(&v, wire + i * 16, 16);
    unpack_fp4_wire(v, i, blocks, job.first_block[rank], payload, scales);
  }
}

// The flag-free NVFP4 gather's launch for a call whose largest chunk holds `most` blocks (every
// rank's blocks decide, so alike on every rank): the narrowest of N, 2N and 4N blocks of kThreads
// that covers the chunk's half-blocks in one pass, else the widest. A lane encodes before it
// stores, so a pass costs an encoding's latency, more than the blocks a wider grid adds to the
// turn: at world 2 on H200 (bench/results/2026-12-01_nvidia-h200-x2_w2_fp4_lanes)
// the widest grid took 1 MiB of bf16 rows in 4.71 us against 5.75 on N, and 16 MiB in 13.26
// against 42.22; two blocks a lane (a quarter of the passes, four loads each) lost to it at every
// size from 8 KiB.
struct Fp4Launch {
  int blocks, threads;
};

Fp4Launch fp4_launch(const Context* c, int64_t most) {
  const int widest = 4 * c->flagfree_blocks < c->flagfree_max_blocks ? 4 * c->flagfree_blocks : c->flagfree_max_blocks;
  if (c->fp4_debug_blocks > 0)
    return {c->fp4_debug_blocks < widest ? c->fp4_debug_blocks : widest, c->fp4_debug_threads};
  for (int k = 1; k < 4; k *= 2)
    if (2 * most <= int64_t(k) * c->flagfree_blocks * kThreads && k * c->flagfree_blocks < widest)
      return {k * c->flagfree_blocks, kThreads};
  return {widest, kThreads};
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
  const int blocks = push_blocks_for(c, total_bytes / 16 / size_t(c->world));
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

int symcomm_ar_flagfree_gatherv_fp4(symcomm_ar_t ctx, const symcomm_flagfree_fp4_args_t* args, cudaStream_t stream) {
  if (args == nullptr) return cudaErrorInvalidValue;
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  Fp4FlagFree job{};
  int64_t total = 0;
  if (!fp4_chunks(args->rows, c->world, args->cols, &job, &total)) return cudaErrorInvalidValue;
  if (args->dtype != SYMCOMM_BFLOAT16 && args->dtype != SYMCOMM_FLOAT16) return cudaErrorInvalidValue;
  const int64_t mine = job.blocks[c->rank];
  if ((mine > 0 && reinterpret_cast<uintptr_t>(args->x) % 16) ||
      (total > 0 && (args->payload == nullptr || args->scales == nullptr)))
    return cudaErrorInvalidValue;
  for (int r = 0; r < c->world; ++r)
    if (uint64_t(Fp4Wire::vecs(job.blocks[r])) * 16 > c->flagfree_bytes) return cudaErrorInvalidValue;
  if (total == 0) return cudaSuccess;
  job.x = args->x;
  job.gs_ptr = static_cast<const float*>(args->gs_ptr);
  job.gs_value = args->gs_value;
  job.payload = static_cast<uint8_t*>(args->payload);
  job.scales = static_cast<uint8_t*>(args->scales);
  job.block_major = c->fp4_debug_block_major;
  int64_t most = 0;
  for (int r = 0; r < c->world; ++r) most = job.blocks[r] > most ? job.blocks[r] : most;
  const Fp4Launch grid = fp4_launch(c, most);
  const Sync s = make_sync(c);
  return for_world(c->world, [&](auto w) {
    constexpr int W = decltype(w)::value;
    const size_t slot_vecs = c->flagfree_bytes / 16;
    if (args->dtype == SYMCOMM_BFLOAT16)
      return launch(c->overlap, flag_free_gather_fp4<__nv_bfloat16, W>, grid.blocks, grid.threads, stream, s,
                    c->flagfree, job, slot_vecs);
    return launch(c->overlap, flag_free_gather_fp4<__half, W>, grid.blocks, grid.threads, stream, s, c->flagfree, job,
                  slot_vecs);
  });
}

int symcomm_fp4_debug_grid(symcomm_ar_t ctx, int blocks, int threads, int block_major) {
  // At least kFlagFreeRecords threads a block, so that any grid advances every record (flagfree_end).
  if (blocks < 0 || (blocks > 0 && (threads < kFlagFreeRecords || threads > kFp4MaxThreads || threads % 32)))
    return cudaErrorInvalidValue;
  ctx->impl.fp4_debug_blocks = blocks;
  ctx->impl.fp4_debug_threads = threads;
  ctx->impl.fp4_debug_block_major = block_major != 0;
  return cudaSuccess;
}

int symcomm_flagfree_fp4_wire_host(const symcomm_flagfree_fp4_args_t* args, int world, int rank, void* wire,
                                   void* payload, void* scales) {
  if (args == nullptr || world < 1 || world > kMaxRanks || rank < 0 || rank >= world) return cudaErrorInvalidValue;
  Fp4FlagFree job{};
  int64_t total = 0;
  if (!fp4_chunks(args->rows, world, args->cols, &job, &total)) return cudaErrorInvalidValue;
  auto* w = static_cast<uint8_t*>(wire);
  auto* p = static_cast<uint8_t*>(payload);
  auto* sc = static_cast<uint8_t*>(scales);
  switch (args->dtype) {
    case SYMCOMM_BFLOAT16:
      flagfree_fp4_on_host(static_cast<const __nv_bfloat16*>(args->x), job, rank, args->gs_value, w, p, sc);
      break;
    case SYMCOMM_FLOAT16:
      flagfree_fp4_on_host(static_cast<const __half*>(args->x), job, rank, args->gs_value, w, p, sc);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
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
