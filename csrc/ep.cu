// MoE expert-parallel dispatch and combine over peer-mapped symmetric memory
// (symcomm/backends/ep_push.py). symcomm/ep/layout.py defines where every row lands and how
// combine adds; csrc/ep.cuh holds the per-entry and per-row math shared with the CPU twin.
//
// Dispatch is one launch, ep_dispatch (many blocks). Every block counts this rank's valid entries
// per expert and numbers them in token order, writes this rank's counts row into every rank's
// counts table of its block index (context memory, in the Signal blocks), each word stamped with
// the call's number, and waits until every peer's row of its own table carries the stamp (the
// meeting, kMid: every rank got here only after finishing its earlier work, so the pool buffers the
// rows go to are free). Each block then turns the table into rows: each entry's row on its
// destination (send_rows), and, in block 0, this rank's receive layout, a copy of the table in the
// handle, and -1 in the padding rows of its recv_src. Then the blocks write every token, quantized
// on the way, into the receive buffers of its entries' ranks, with its origin in their recv_src,
// and meet the peers again (kEnd): when that completes on a rank, every peer's block b has arrived
// after its writes for every b, so everything sent there has landed. Past kDedupFromBytes of rows a
// token's row crosses once to each peer rank instead, and after a meeting of every block the
// receiver copies it into that token's other rows there (expand_duplicates).
//
// Dispatch also lists, on every rank, each source token's rows there with their top-k weights
// (recv_group, symcomm/ep/layout.py's groups). Combine is one launch, ep_combine (many blocks). It
// meets the peers first, because the owners of the tokens must have finished adding the previous
// combine's partials, which they read from the buffer this call writes; that start barrier is
// skipped when a dispatch ran since the last combine, since the dispatch's meetings with the peers
// already proved it (every rank reached them only after finishing the combine before). The flag
// that records a dispatch (ep_dispatched) is the peer-push paths' own: an a2a dispatch leaves it
// alone, and an a2a combine never reads `returned`. It adds up each listed group of expert_out rows
// in slot order, weighted, in fp32, and writes the rounded partial (FP8-quantized on the way) into
// the owner's returned buffer, one row a token and rank; meets every block of every peer
// (meet_all_blocks: a block sums tokens whose partials any peer block may have sent; the meeting's
// flags carry each rank's combine_mark, so ranks that passed another quant or dtype stop there,
// before any sum); and adds each token's partials in rank order, in fp32.
//
// No count ever reaches the host: the grids follow max_tokens and capacity, equal on every rank,
// and the kernels read the counts on the device, so every launch can be captured in a graph.
#include "ep.cuh"
#include "peer.cuh"
#include "symcomm_testing.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <set>
#include <vector>

namespace {
using namespace symcomm::ar;
using symcomm::launch;
namespace ep = symcomm::ep;
namespace fp4 = symcomm::fp4;

constexpr int kLayoutInts = 8192;  // ep_dispatch's shared [warps][experts] counters (32 KiB)
// ep_dispatch's largest block (launch_dispatch picks 512 or 1024 threads): 32 warps.
constexpr int kDispatchThreads = 1024;
constexpr int kMaxExperts = SYMCOMM_EP_MAX_EXPERTS;
constexpr unsigned kFull = 0xFFFFFFFFu;
// Dispatch sends a token once per peer rank, not once per entry, from this many bytes of valid
// rows per rank on average (every rank sums the same counts table, and the row size is in the
// fingerprint, so all decide alike). Below it the expansion's extra meeting and round trips cost
// more than the NVLink bytes saved. Bytes, not entries: at world 2 (bench/NOTES.md, twelfth and
// thirteenth sessions) 512 bf16 rows of hidden 7168 (7 MiB) gained 5 us while 512 NVFP4 rows of
// the same hidden (1.75 MiB) lost 1.6; the break-even by a fixed cost plus a per-byte saving is
// near 4 MiB.
constexpr int64_t kDedupFromBytes = int64_t(4) << 20;
static_assert(SYMCOMM_EP_MAX_TOPK <= 32, "one lane per top-k slot");
static_assert(kLayoutInts / kMaxExperts >= 1, "at least one warp's counters fit");
static_assert(2 * kDispatchThreads <= kLayoutInts, "expand_duplicates' list fits in the layout's table");

struct Buf {
  int slot;
  uint64_t offset;
};

__device__ __forceinline__ char* at(const Peers* slots, Buf b, int rank) { return slots[b.slot].ptr[rank] + b.offset; }

// Rank `rank`'s buffer from a warp whose lane r holds rank r's (`mine`); every lane of the warp
// must call it. nullptr for rank -1.
__device__ __forceinline__ char* peer_buffer(char* mine, int rank) {
  const auto p = __shfl_sync(kFull, reinterpret_cast<unsigned long long>(mine), rank < 0 ? 0 : rank);
  return rank < 0 ? nullptr : reinterpret_cast<char*>(p);
}

struct Dispatch {
  const void* x;
  const void* ids;
  int64_t rows, cols, max_tokens;
  int topk, experts, local, align, swizzle;
  const float* gs_ptr;
  float gs_value;
  const void* weights;
  symcomm_dtype_t weights_dtype;
  Buf recv, scales, src, table, group;
  int32_t* send_rows;
  int32_t* expert_counts;
  int32_t* expert_offsets;
  int64_t units;      // lane units per token row (16 bytes, an NVFP4 block, or 8 FP8 values)
  int64_t row_bytes;  // bytes of one received row
  int32_t mark;       // this rank's fingerprint (ep.cuh)
  bool dedup_ok;      // a row number times topk fits the marker (see expand_duplicates)
  int64_t dedup_from;  // valid entries per rank from which tokens cross once per peer (kDedupFromBytes)
};

struct Combine {
  const void* expert_out;
  int64_t cols, max_tokens, rows;
  int topk, num_local;
  const int32_t* recv_group;
  Buf returned;
  const int32_t* send_rows;
  const void* ids;
  void* out;
  int64_t units;  // 16-byte units of T per row: a lane's piece of a partial
  uint32_t mark;  // what the ranks must agree on (ep.cuh's combine_mark), checked at the meeting
};

// ------------------------------------------------------------------ dispatch
// One launch, ep_dispatch, in two phases that a meeting with the peers separates.
//
// Layout, in every block. This rank's valid entries are counted per expert and numbered in token
// order; block b writes this rank's counts row (the same values from every block) into every
// rank's table b, its words stamped, and waits for the peers' rows of its own (kMid). That proves
// only that the peers' block b got there, which is why every block writes the whole row: any
// block past the wait holds every peer's counts, and turns the table into rows itself, with the
// same arithmetic as every other block. That costs each block a few shared-memory passes, where
// a layout kernel of its own cost a launch, a prologue, and the row phase's wait for both; a
// decode call is latency-bound, one memory round trip after another, so the phase keeps them few:
// only as many warps count as there are 32-entry chunks, the slot check runs in the last warp
// (one that does not count unless every warp does), the stamped words carry the meeting, the
// fingerprints and the counts in one pass, and the first row unit each warp sends is loaded
// before the layout starts.
//
// Rows. Every lane's unit of one token row (chunk c of 32 units), encoded once, is stored into
// each valid entry's destination row with its origin in the destination's recv_src; then the
// blocks meet again (kEnd): when that completes on a rank, every peer's block b has arrived
// after its writes for every b, so everything sent there has landed.
//
// Q: SYMCOMM_EP_NONE copies 16 bytes a lane; NVFP4 encodes one 16-value block; FP8 encodes 8
// values of a 128-value block that 16 lanes hold.

// A lane's unit of a token row as loaded: 16 bytes, or the 32 of an NVFP4 block of half values.
struct RowUnit {
  uint4 v[2];
};

// What a lane sends for its unit: the bytes as is, or codes and their block's scale.
struct Encoded {
  uint4 plain;
  uint2 payload;
  uint8_t scale8;  // NVFP4
  float scale;     // FP8
};

template <int Q, typename T>
__device__ __forceinline__ RowUnit load_unit(const Dispatch& job, int64_t t, int64_t u) {
  RowUnit r{};  // zeros past the row: FP8's block scale takes every lane of the block
  if (u >= job.units) return r;
  if constexpr (Q == SYMCOMM_EP_NONE) {
    r.v[0] = __ldg(static_cast<const uint4*>(job.x) + t * job.units + u);
  } else {
    const int values = Q == SYMCOMM_EP_NVFP4 ? fp4::kBlock : ep::kFp8Unit;
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const T*>(job.x) + t * job.cols + u * values);
#pragma unroll
    for (int k = 0; k < int(values * sizeof(T) / 16); ++k) r.v[k] = __ldg(p + k);
  }
  return r;
}

// Every lane of the warp calls it: FP8's block scale is a shuffle over 16 lanes.
template <int Q, typename T>
__device__ __forceinline__ Encoded encode_unit(const RowUnit& r, bool mine, float gs) {
  Encoded out{};
  if constexpr (Q == SYMCOMM_EP_NONE) {
    out.plain = r.v[0];
  } else if constexpr (Q == SYMCOMM_EP_NVFP4) {
    if (mine) {
      alignas(16) T v[fp4::kBlock];
#pragma unroll
      for (int k = 0; k < int(fp4::kBlock * sizeof(T) / 16); ++k) reinterpret_cast<uint4*>(v)[k] = r.v[k];
      out.scale8 = ep::nvfp4_block(v, gs, &out.payload);
    }
  } else {
    float v[ep::kFp8Unit] = {};
    uint32_t amax = 0;
    if (mine) {
      alignas(16) T raw[ep::kFp8Unit];
      *reinterpret_cast<uint4*>(raw) = r.v[0];
#pragma unroll
      for (int i = 0; i < ep::kFp8Unit; ++i) amax = fp4::amax_step(amax, v[i] = symcomm::to_f32(raw[i]));
    }
#pragma unroll
    for (int m = 8; m >= 1; m >>= 1) amax = max(amax, __shfl_xor_sync(kFull, amax, m));  // the 16 lanes of a block
    out.scale = ep::fp8_scale(amax);
    out.payload = ep::fp8_codes8(v, out.scale);
  }
  return out;
}

// Entry e's expert as this entry's own id says: the expert, or -1 past the entries or out of range.
template <typename Id>
__device__ __forceinline__ int raw_key(const Id* ids, int64_t e, int64_t entries, int experts) {
  if (e < 0 || e >= entries) return -1;
  const int64_t id = static_cast<int64_t>(ids[e]);
  return id >= 0 && id < experts ? int(id) : -1;
}

// ep::entry_key of lane l's entry e (chunk base + l) from the raw keys of its chunk (`here`) and
// of the 32 entries before it (`before`): -1 where an earlier slot of the same token names the
// same expert. The earlier slots come by shuffle (top-k <= 32, so they lie in these 64 entries);
// entry_key loads them one after another, a round trip each, and every block counts and numbers
// every entry of the rank (bench/NOTES.md, thirtieth and thirty-eighth sessions). Every lane of
// the warp calls it.
__device__ __forceinline__ int first_slot_key(int here, int before, int64_t e, int topk) {
  const int lane = threadIdx.x % 32, slot = int(e % topk);
  bool repeated = false;
  for (int d = 1; d < topk; ++d) {  // the same trip count in every lane
    const int from = (lane - d) & 31;
    const int in_chunk = __shfl_sync(kFull, here, from), in_before = __shfl_sync(kFull, before, from);
    repeated |= d <= slot && (lane >= d ? in_chunk : in_before) == here;
  }
  return repeated ? -1 : here;
}

// The raw keys of a counting warp's first chunk and of the 32 entries before it, loaded once.
struct FirstChunk {
  int here, before;
};

// Runs `step(e, key)` over a counting warp's 32-entry chunks of [lo, hi), in token order, with
// every lane of the warp (e = this lane's entry, key = ep::entry_key of it, or -1 past hi). The
// first chunk's raw keys are passed in (`first`, loaded once); later chunks' are read again, 4
// chunks' at a time, each group's loads issued before the group ahead of it is stepped through.
template <typename Id, typename Step>
__device__ __forceinline__ void each_chunk(const Dispatch& job, int64_t lo, int64_t hi, FirstChunk first, Step&& step) {
  constexpr int kAhead = 4;
  const int lane = threadIdx.x % 32;
  const Id* ids = static_cast<const Id*>(job.ids);
  const int64_t entries = job.rows * job.topk;
  int before = first.before;  // the raw keys of the 32 entries before the group's first chunk
  int raw[kAhead];             // the group's raw keys, loaded while the group before was stepped through
#pragma unroll
  for (int k = 0; k < kAhead; ++k)
    raw[k] = k == 0 ? first.here : lo + 32 * k < hi ? raw_key(ids, lo + 32 * k + lane, entries, job.experts) : -1;
  for (int64_t group = lo; group < hi; group += 32 * kAhead) {
    int next[kAhead];
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      const int64_t chunk = group + 32 * (kAhead + k);
      next[k] = chunk < hi ? raw_key(ids, chunk + lane, entries, job.experts) : -1;
    }
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      if (group + 32 * k >= hi) break;  // the same in every lane
      const int64_t e = group + 32 * k + lane;
      const int key = first_slot_key(raw[k], k == 0 ? before : raw[k - 1], e, job.topk);
      step(e, e < hi ? key : -1);
    }
    before = raw[kAhead - 1];
#pragma unroll
    for (int k = 0; k < kAhead; ++k) raw[k] = next[k];
  }
}

// The counting pass: each entry adds one to its expert's counter of this warp (`running`,
// [expert], this warp's row of the shared table). Only the totals matter here, so a shared-memory
// atomic does it; numbering in token order (number_entries) costs several times the instructions,
// and every block counts every entry of the rank.
template <typename Id>
__device__ __forceinline__ void count_entries(const Dispatch& job, int64_t lo, int64_t hi, FirstChunk first,
                                              int32_t* running) {
  each_chunk<Id>(job, lo, hi, first, [&](int64_t, int key) {
    if (key >= 0) atomicAdd(running + key, 1);
  });
}

// The numbering pass over the same chunks. Lanes naming the same expert rank themselves by lane
// (match_any) after what the warp numbered so far (`running`), and the lowest of them adds their
// number. `visit(e, key, before)` gets each entry of the run, `before` the entries of its expert
// ahead of it in the warp's run plus the row's starting value.
template <typename Id, typename Visit>
__device__ __forceinline__ void number_entries(const Dispatch& job, int64_t lo, int64_t hi, FirstChunk first,
                                               int32_t* running, Visit&& visit) {
  const int lane = threadIdx.x % 32;
  each_chunk<Id>(job, lo, hi, first, [&](int64_t e, int key) {
    const unsigned same = __match_any_sync(kFull, key);
    const int32_t before_here = key >= 0 ? running[key] : 0;
    __syncwarp();
    if (key >= 0 && lane == __ffs(same) - 1) running[key] = before_here + __popc(same);
    __syncwarp();
    if (e < hi) visit(e, key, key >= 0 ? before_here + __popc(same & ((1u << lane) - 1)) : -1);
  });
}

// The scales of expand_duplicates' n listed rows (`list`: marked row, lead row), copied from the
// lead's. Where a row's NVFP4 scale count is a multiple of 4, every 4 consecutive scales from a
// multiple of 4 lie together in both layouts (the swizzled one keeps a row's 4 columns of a tile
// in one word, fp4.cuh), and FP8's scales are fp32: those go in 4-byte words, kAhead in flight a
// thread. Other counts (hidden not a multiple of 64) go byte by byte, so only a row's own scales
// are written, as the dispatch writes them. One byte a thread at a time, the NVFP4 copy was a
// chain of dependent loads, 448 a row at hidden 7168 (bench/NOTES.md, thirty-eighth session: 7%
// of the NVFP4 dispatch at 2048 tokens on two simulated ranks, 11% at four). Only a word and its
// destination stay live across the loads: with the byte counts as well, the 1024-thread dispatch
// spilled (bench/NOTES.md, thirty-ninth session).
template <int Q>
__device__ __forceinline__ void copy_scales(const Dispatch& job, char* scales, const int32_t* list, int n) {
  if constexpr (Q != SYMCOMM_EP_NONE) {
    constexpr int kAhead = 4;
    const int threads = int(blockDim.x);
    const int64_t units = job.units;
    const int64_t padded_cols = fp4::padded_cols(job.cols / fp4::kBlock);
    // Words of one row's scales: groups of 4 NVFP4 scales, or FP8's fp32 scales one a word.
    const int per_row = int(Q == SYMCOMM_EP_NVFP4 ? (units + 3) / 4 : job.cols / ep::kFp8Block);
    const bool whole_words = Q == SYMCOMM_EP_FP8 || (units % 4 == 0 && reinterpret_cast<uintptr_t>(scales) % 4 == 0);
    // Byte offset of word w of row r, and the scales it holds (4 but for a last NVFP4 group).
    const auto word_at = [&](int64_t r, int w) -> int64_t {
      if constexpr (Q == SYMCOMM_EP_FP8) return (r * per_row + w) * 4;
      return job.swizzle ? fp4::swizzled_index(r, 4 * w, padded_cols) : r * units + 4 * w;
    };
    const auto width = [&](int w) { return Q == SYMCOMM_EP_FP8 ? 4 : int(units - 4 * w < 4 ? units - 4 * w : 4); };
    const int items = n * per_row;
    if (whole_words) {
      for (int i0 = threadIdx.x; i0 < items; i0 += kAhead * threads) {
        uint32_t v[kAhead];
        int64_t to[kAhead];
#pragma unroll
        for (int k = 0; k < kAhead; ++k) {
          const int i = i0 + k * threads, m = i / per_row, w = i - m * per_row;
          to[k] = -1;
          if (i >= items) continue;
          v[k] = *reinterpret_cast<const uint32_t*>(scales + word_at(list[2 * m + 1], w));
          to[k] = word_at(list[2 * m], w);
        }
#pragma unroll
        for (int k = 0; k < kAhead; ++k)
          if (to[k] >= 0) *reinterpret_cast<uint32_t*>(scales + to[k]) = v[k];
      }
    } else {
      for (int i = threadIdx.x; i < items; i += threads) {
        const int m = i / per_row, w = i - m * per_row;
        const int64_t from = word_at(list[2 * m + 1], w), to = word_at(list[2 * m], w);
        for (int j = 0; j < width(w); ++j)
          reinterpret_cast<uint8_t*>(scales)[to + j] = reinterpret_cast<const uint8_t*>(scales)[from + j];
      }
    }
  }
}

// A token bound for several experts of one peer crosses NVLink once (dispatch's sending lanes,
// past kDedupFromBytes): its first entry for that rank (the lead) gets the row, each other entry
// gets only a marker in recv_src, -2 - (lead row * topk + slot), and once every block of every
// rank has met, the receiving rank copies the lead's row (and scales) into each marked row and
// puts the entry's origin back in recv_src. At world 2 with top-8 a token's rows for the peer
// fall from about 4 to 1.
//
// Each block takes blockDim rows spread over the grid at a time: every thread loads one recv_src
// word, a thread that finds a marker lists its row in shared memory and loads the lead's origin,
// and then the whole block copies the listed rows, 4 pieces a thread in flight, so that a decode
// call's few rows take a round trip or two rather than one per 4 x 512 bytes of a row. The thread
// that listed a row restores its word after the block's copies, so no thread reads a half-restored
// one; lead rows hold origins and are never marked, so the origin loaded early is final.
// `list` is shared memory for 2 * blockDim ints (the layout's table, no longer used by then).
template <int Q>
__device__ void expand_duplicates(const Dispatch& job, char* recv, char* scales, int32_t* src, int64_t used,
                                  int32_t* list) {
  __shared__ int listed;
  constexpr int kAhead = 4;
  const int threads = int(blockDim.x);
  const bool wide = job.row_bytes % 16 == 0;
  const int pieces = int(wide ? job.row_bytes / 16 : job.row_bytes / 8);
  for (int64_t round = 0; round * threads * gridDim.x < used; ++round) {
    if (threadIdx.x == 0) listed = 0;
    __syncthreads();
    const int64_t row = blockIdx.x + int64_t(gridDim.x) * (round * threads + threadIdx.x);
    const int32_t word = row < used ? *reinterpret_cast<volatile int32_t*>(src + row) : -1;
    int32_t lead_origin = 0;
    int slot = 0;
    if (word <= -2) {
      const int64_t code = -2 - int64_t(word);
      const int32_t lead = int32_t(code / job.topk);
      slot = int(code % job.topk);
      lead_origin = src[lead];  // used after the copies: its round trip overlaps them
      const int at = atomicAdd(&listed, 1);
      list[2 * at] = int32_t(row);
      list[2 * at + 1] = lead;
    }
    __syncthreads();
    const int n = listed;
    const int items = n * pieces;
    for (int i0 = threadIdx.x; i0 < items; i0 += kAhead * threads) {
      int64_t from[kAhead], to[kAhead];  // byte offsets of the piece in the lead's row and the marked one
#pragma unroll
      for (int k = 0; k < kAhead; ++k) {
        const int i = i0 + k * threads, m = i / pieces, piece = i - m * pieces;
        const int64_t at = int64_t(piece) * (wide ? 16 : 8);
        from[k] = i < items ? int64_t(list[2 * m + 1]) * job.row_bytes + at : 0;
        to[k] = i < items ? int64_t(list[2 * m]) * job.row_bytes + at : 0;
      }
      if (wide) {
        uint4 v[kAhead];
#pragma unroll
        for (int k = 0; k < kAhead; ++k)
          if (i0 + k * threads < items) v[k] = *reinterpret_cast<const uint4*>(recv + from[k]);
#pragma unroll
        for (int k = 0; k < kAhead; ++k)
          if (i0 + k * threads < items) *reinterpret_cast<uint4*>(recv + to[k]) = v[k];
      } else {
        uint2 v[kAhead];
#pragma unroll
        for (int k = 0; k < kAhead; ++k)
          if (i0 + k * threads < items) v[k] = *reinterpret_cast<const uint2*>(recv + from[k]);
#pragma unroll
        for (int k = 0; k < kAhead; ++k)
          if (i0 + k * threads < items) *reinterpret_cast<uint2*>(recv + to[k]) = v[k];
      }
    }
    copy_scales<Q>(job, scales, list, n);
    __syncthreads();
    if (word <= -2) src[row] = lead_origin - lead_origin % job.topk + slot;
  }
}

template <int Q, typename T, typename Id, int W>
__global__ void __launch_bounds__(kDispatchThreads) ep_dispatch(Sync s, const Peers* slots, Dispatch job) {
  // [warp][expert]: counts, then each warp's running row numbers; then each counting warp's first
  // chunk's rows and keys, by entry, for the row phase (kRowCache entries).
  __shared__ int32_t table[kLayoutInts];
  __shared__ int32_t counts[kMaxExperts];
  __shared__ int32_t base[kMaxExperts];
  __shared__ int32_t starts[kMaxExperts];  // segment scan: every expert's start over all ranks
  __shared__ int32_t warp_sum[32];
  __shared__ bool mapped;
  __shared__ bool dedup;           // this call sends a token once per peer (expand_duplicates)
  __shared__ int32_t used_rows;    // rows of this rank's receive layout
  __shared__ int32_t valid_total;  // valid entries of every rank: what the dedup decision reads
  __shared__ uint64_t meeting;     // meet_all_blocks' number, for a call that dedups
  __shared__ uint32_t call;        // this block's dispatch number: the stamp of its counts-table words
  __shared__ Signal* signal_at[kMaxRanks];  // every rank's Signal block, which holds its counts table
  constexpr int64_t kRowCache = kLayoutInts / 2;
  const int E = job.experts, warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Id* ids = static_cast<const Id*>(job.ids);
  const int64_t entries = job.rows * job.topk;
  const int64_t entry_chunks = (entries + 31) / 32;
  const int most = kLayoutInts / E < warps ? kLayoutInts / E : warps;
  const int counting = int(entry_chunks < 1 ? 1 : entry_chunks < most ? entry_chunks : most);
  // Counting warp w numbers entries [lo, hi) = [w * run, ...).
  const int64_t run = (entries + counting - 1) / counting;
  const int64_t lo = warp < counting ? warp * run : entries;
  const int64_t hi = lo + run < entries ? lo + run : entries;
  const int64_t unit_chunks = (job.units + 31) / 32, items = job.rows * unit_chunks;
  const int64_t first_item = int64_t(blockIdx.x) * warps + warp;
  // Loads that need nothing from the layout, issued in one round trip with the epoch's and first
  // used after the layout: this warp's first row unit, the raw keys of its first chunk and of the
  // 32 entries before it (each_chunk), the global scale, the peers' buffers (lane r < W holds rank
  // r's; a lane takes its destination's by shuffle) and every Signal block. The kernels that wrote
  // them have completed once begin_epoch's wait returns (launch.cuh); no peer pointer is
  // dereferenced before slots_ready has passed.
  const EpochWords epoch_words = begin_epoch(s);
  const float gs = Q == SYMCOMM_EP_NVFP4 ? (job.gs_ptr != nullptr ? *job.gs_ptr : job.gs_value) : 0.0f;
  RowUnit first_unit{};
  if (first_item < items)
    first_unit = load_unit<Q, T>(job, first_item / unit_chunks, (first_item % unit_chunks) * 32 + lane);
  const Buf buffers[] = {job.recv, job.src, job.scales, job.group};
  char* lane_buf[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) lane_buf[k] = lane < W ? at(slots, buffers[k], lane) : nullptr;
  if (threadIdx.x < W) signal_at[threadIdx.x] = reinterpret_cast<Signal*>(of_rank<W>(s.signals.ptr, int(threadIdx.x)));
  uint32_t calls_before = 0;
  if (threadIdx.x == 0) {
    meeting = next_meeting(s);
    valid_total = 0;
    calls_before = *reinterpret_cast<volatile uint32_t*>(&own_signal(s)->ep_calls[blockIdx.x]);
  }
  int32_t* const src_here = reinterpret_cast<int32_t*>(at(slots, job.src, s.rank));
  int32_t* const table_here = reinterpret_cast<int32_t*>(at(slots, job.table, s.rank));
  const FirstChunk first_chunk{lo < hi ? raw_key(ids, lo + lane, entries, E) : -1,
                               lo < hi ? raw_key(ids, lo - 32 + lane, entries, E) : -1};
  for (int i = threadIdx.x; i < counting * E; i += blockDim.x) table[i] = 0;
  if (warp == warps - 1) {  // counts too when every warp does
    const Peers* const used[] = {slots + job.table.slot, slots + job.src.slot, slots + job.recv.slot,
                                 slots + job.scales.slot, slots + job.group.slot};
    const bool ready = slots_ready(s, used, W);
    if (lane == 0) mapped = ready;
  }
  if (threadIdx.x == 0) {
    // Never 0, the tables' first contents; a stale word holds the previous call's number, but for
    // a column past the experts of every call since it was written: after 2^32 - 1 calls of this
    // block its number can come round, and a call with more experts would read it as current
    // (bench/NOTES.md, thirty-ninth session, names the fix: rewrite every column once written).
    call = calls_before + 1 == 0 ? 1 : calls_before + 1;
    own_signal(s)->ep_calls[blockIdx.x] = call;
  }
  const uint64_t epoch = end_epoch(s, epoch_words);  // its CTA barrier publishes the zeros, `mapped`, `call`
  if (epoch == 0 || !mapped) return;
  // Counts: each warp's run, then the exclusive prefix over warps, which is the token order of the
  // whole rank since the runs follow warp order.
  if (warp < counting) count_entries<Id>(job, lo, hi, first_chunk, table + warp * E);
  __syncthreads();
  for (int id = threadIdx.x; id < E; id += blockDim.x) {
    int32_t sum = 0;
    for (int w = 0; w < counting; ++w) {
      const int32_t c = table[w * E + id];
      table[w * E + id] = sum;
      sum += c;
    }
    counts[id] = sum;
  }
  __syncthreads();
  // This rank's row of every rank's counts table for this block: its counts, then its fingerprint
  // (one more column), each word stamped with the call's number (every rank's block b has run the
  // same dispatches, so the numbers agree), 8 bytes stored at once so that a reader never sees a
  // stamp with another call's value. Block b of each rank writes into table b of every rank and
  // reads its own table b, waiting only for words not yet stamped: that is the meeting with the
  // peers' block b, with no flag, no release fence and no second round trip for the table
  // (bench/NOTES.md, thirty-ninth session). A stamped row proves its writer began this call after
  // all its earlier work completed (begin_epoch), so the pool buffers the rows go to are free.
  // The tables are context memory, in the Signal blocks, so no barrier comes first: a peer writes
  // table b again only in its next dispatch, which begins (griddepcontrol.wait) after the whole
  // previous dispatch grid of that peer completed; its block b met this rank's block b at kEnd
  // (the grids are equal), or every block of it at a dedup call's meeting, and this rank's block b
  // reached either after reading the table. Every block writes the whole row, W * (E + 1) words
  // to the peers: 16 KiB a block at 256 experts and world 8.
  const int row = E + 1;
  const int32_t mark = job.mark;
  const uint32_t stamp = call;
  for (int i = threadIdx.x; i < W * row; i += blockDim.x) {
    const int q = (s.rank + i / row) % W;  // ranks do not all start on one peer
    const int col = i % row;
    // The fingerprint sits in the last column whatever E is, so a rank reads a peer's current
    // one even where the peer passed another expert count.
    const uint32_t value = col < E ? uint32_t(counts[col]) : uint32_t(mark);
    *reinterpret_cast<volatile uint64_t*>(&signal_at[q]->ep_table[blockIdx.x][s.rank][col < E ? col : kMaxExperts]) =
        uint64_t(stamp) << 32 | value;
  }
  __syncthreads();  // counts[] is rewritten below, and this block's own row is read back
  const auto& all = signal_at[s.rank]->ep_table[blockIdx.x];
  const bool writer = blockIdx.x == 0;  // of the outputs the handle keeps; every block computes them
  // Every rank sees every fingerprint, so every rank stops alike, before any row moves. The
  // fingerprints are read in the same pass as the counts, which also go to the handle's table.
  // A block of this rank that gave up (a peer's block never came) stops the others here, in the
  // same round trip, before they send rows into the peers that did come.
  bool agree = !(threadIdx.x == 0 && has_given_up(s));
  uint64_t since = 0;  // when this thread began waiting: one bound for all its words
  int32_t my_valid = 0;
  for (int id = threadIdx.x; id < E; id += blockDim.x) {
    // Every rank's word of this expert, and for threads below W (each has an expert: E >= W) rank
    // id's fingerprint, loaded in one round trip; again only while one is not yet stamped. Only
    // the values and a bit per stale word stay live (bit W: the fingerprint): with the whole words
    // kept, the 1024-thread NVFP4 dispatch spilled more and took 1.03x at 2048 tokens (bench/NOTES.md,
    // thirty-ninth session).
    int32_t c[W], theirs = 0;
    unsigned stale = 0;
    for (bool first = true;; first = false) {
      if (!first) {
        if (since == 0) since = now_ns();
        if (has_given_up(s)) {
          agree = false;
        } else if (now_ns() - since > s.timeout_ns) {
          give_up(s, abort_code(SYMCOMM_AR_ABORT_TIMEOUT, kMid, stale >> W ? id : __ffs(stale) - 1));
          agree = false;
        }
        if (!agree) break;
      }
      stale = 0;
#pragma unroll
      for (int q = 0; q < W; ++q) {
        const uint64_t word = *reinterpret_cast<const volatile uint64_t*>(&all[q][id]);
        c[q] = int32_t(uint32_t(word));
        stale |= unsigned(uint32_t(word >> 32) != stamp) << q;
      }
      if (id < W) {
        const uint64_t word = *reinterpret_cast<const volatile uint64_t*>(&all[id][kMaxExperts]);
        theirs = int32_t(uint32_t(word));
        stale |= unsigned(uint32_t(word >> 32) != stamp) << W;
      }
      if (stale == 0 || !agree) break;
    }
    if (id < W && agree) {
      if (writer) table_here[id * row + E] = theirs;
      if (theirs != mark) {
        give_up(s, abort_code(SYMCOMM_AR_ABORT_MISMATCH, kMid, id));
        agree = false;
      }
    }
    int32_t total = 0, before = 0;
#pragma unroll
    for (int q = 0; q < W; ++q) {
      if (writer) table_here[q * row + id] = c[q];
      before += q < s.rank ? c[q] : 0;
      total += c[q];
    }
    counts[id] = total;
    base[id] = before;
    my_valid += total;
  }
  if (my_valid) atomicAdd(&valid_total, my_valid);
  if (!__syncthreads_and(agree)) return;
  // Segment starts: one block-wide exclusive scan of every expert's aligned total, each rank's
  // segment then measured from its first expert. A thread scans `per` consecutive experts, each
  // warp its threads' sums, warp 0 the warps' sums: three short steps.
  const int L = job.local, align = job.align;
  const auto aligned = [align](int32_t n) { return (n + align - 1) / align * align; };
  const int per = (E + int(blockDim.x) - 1) / int(blockDim.x), first_id = int(threadIdx.x) * per;
  int32_t own_sum = 0;
  for (int k = 0; k < per && first_id + k < E; ++k) own_sum += aligned(counts[first_id + k]);
  int32_t inclusive = own_sum;
  for (int d = 1; d < 32; d <<= 1) {
    const int32_t up = __shfl_up_sync(kFull, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) warp_sum[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int32_t w = lane < warps ? warp_sum[lane] : 0;
    int32_t upto = w;
    for (int d = 1; d < 32; d <<= 1) {
      const int32_t up = __shfl_up_sync(kFull, upto, d);
      if (lane >= d) upto += up;
    }
    if (lane < warps) warp_sum[lane] = upto - w;
  }
  __syncthreads();
  int32_t running = warp_sum[warp] + inclusive - own_sum;
  for (int k = 0; k < per && first_id + k < E; ++k) {
    starts[first_id + k] = running;
    running += aligned(counts[first_id + k]);
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // the same in every block of every rank: all read one table
    const int32_t total = starts[E - 1] + aligned(counts[E - 1]);
    dedup = W > 1 && job.dedup_ok && valid_total >= job.dedup_from * W;
    used_rows = (s.rank + 1 < W ? starts[(s.rank + 1) * L] : total) - starts[s.rank * L];
  }
  for (int id = threadIdx.x; id < E; id += blockDim.x) {
    const int p = id / L, e = id % L;
    const int32_t start = starts[id] - starts[p * L];
    base[id] += start;
    if (writer && p == s.rank) {
      const int32_t filled = counts[id], end = start + aligned(filled);
      job.expert_counts[e] = filled;
      job.expert_offsets[e] = start;
      for (int32_t r = start + filled; r < end; ++r) src_here[r] = -1;  // padding rows
      if (e == L - 1) job.expert_offsets[L] = end;
    }
  }
  __syncthreads();
  // Each entry's row on its destination: the warp numbers its run again from its prefix. Every
  // block writes send_rows (the same values); the first chunk's rows and keys stay in lanes for the
  // cache.
  int32_t first_row = -1;
  int first_key = -1;
  if (warp < counting)
    number_entries<Id>(job, lo, hi, first_chunk, table + warp * E, [&](int64_t e, int key, int32_t pos) {
      const int32_t r = key >= 0 ? base[key] + pos : -1;  // < capacity: the fingerprints agree
      job.send_rows[e] = r;
      if (e - lo < 32) first_row = r, first_key = key;
    });
  __syncthreads();
  if (warp < counting && lo + lane < hi && lo + lane < kRowCache) {
    table[2 * (lo + lane)] = first_row;
    table[2 * (lo + lane) + 1] = first_key;
  }
  // The next combine may skip its start barrier: this dispatch's barriers already ordered it
  // after every owner's previous combine (ep_combine).
  if (writer && threadIdx.x == 0) own_signal(s)->ep_dispatched = 1;
  __syncthreads();
  const int64_t padded_cols = fp4::padded_cols(job.cols / fp4::kBlock);
  RowUnit unit = first_unit;
  for (int64_t item = first_item; item < items; item += int64_t(gridDim.x) * warps) {
    const int64_t t = item / unit_chunks, u = (item % unit_chunks) * 32 + lane;
    int dest = -1;
    int32_t at_row = -1;
    if (lane < job.topk) {
      const int64_t e = t * job.topk + lane;
      if (e < kRowCache && e % run < 32) {  // the first chunk of its warp's run: cached above
        at_row = table[2 * e];
        const int key = table[2 * e + 1];
        dest = key >= 0 ? key / job.local : -1;
      } else {  // both loads at once: ids[t, lane] exists whether or not it is sent
        at_row = job.send_rows[e];  // this block's own write, before the CTA barrier above
        const int64_t id = int64_t(ids[e]);
        if (at_row >= 0) dest = int(id / job.local);
      }
    }
    if (item != first_item) unit = load_unit<Q, T>(job, t, u);
    const bool in_row = u < job.units;
    const Encoded piece = encode_unit<Q, T>(unit, in_row, gs);
    // The lead of a destination is its lowest slot; on a dedup call only leads carry the row to a
    // peer, the others a marker (expand_duplicates). Rows to this rank itself are stored whole.
    // The entries bound for one rank are a group there (symcomm/ep/layout.py): its lead, the lowest
    // slot, lists them with their weights in recv_group, where combine adds them up.
    const unsigned same = __match_any_sync(kFull, dest);
    const int lead = __ffs(same) - 1;
    const int32_t lead_row = __shfl_sync(kFull, at_row, lead);
    const bool carries = !dedup || lead == lane || dest == s.rank;
    if (item % unit_chunks == 0) {  // the token's first chunk (the same in every lane) writes its groups
      char* const src_at = peer_buffer(lane_buf[1], dest);
      int2* const group_at = reinterpret_cast<int2*>(peer_buffer(lane_buf[3], dest));
      const int64_t list = (int64_t(s.rank) * job.max_tokens + t) * job.topk;  // on every destination
      if (at_row >= 0) {
        reinterpret_cast<int32_t*>(src_at)[at_row] =
            carries ? ep::origin(s.rank, job.max_tokens, t, job.topk, lane)
                    : int32_t(-2 - (int64_t(lead_row) * job.topk + lane));
        const int members = __popc(same);
        const float weight = ep::weight_at(job.weights, job.weights_dtype, t * job.topk + lane);
        group_at[list + __popc(same & ((1u << lane) - 1))] = make_int2(at_row, int32_t(symcomm::bits_of(weight)));
        if (lane == lead && members < job.topk) group_at[list + members] = make_int2(-1, 0);
      }
      // The ranks this token sends nothing to: (-1, 0) first in its list there.
      const unsigned sent_to = __reduce_or_sync(kFull, at_row >= 0 ? 1u << dest : 0u);
      int2* const empty_at = reinterpret_cast<int2*>(peer_buffer(lane_buf[3], lane < W ? lane : -1));
      if (lane < W && !(sent_to >> lane & 1u)) empty_at[list] = make_int2(-1, 0);
    }
    for (int j = 0; j < job.topk; ++j) {
      const int d = __shfl_sync(kFull, dest, j);
      const int64_t r = __shfl_sync(kFull, at_row, j);
      const bool sent = __shfl_sync(kFull, carries, j);
      char* const recv_at = peer_buffer(lane_buf[0], d);
      char* const scales_at = peer_buffer(lane_buf[2], d);
      if (d < 0 || !in_row || !sent) continue;
      char* out = recv_at + r * job.row_bytes;
      if constexpr (Q == SYMCOMM_EP_NONE) {
        reinterpret_cast<uint4*>(out)[u] = piece.plain;
      } else if constexpr (Q == SYMCOMM_EP_NVFP4) {
        reinterpret_cast<uint2*>(out)[u] = piece.payload;
        const int64_t si = job.swizzle ? fp4::swizzled_index(r, u, padded_cols) : r * job.units + u;
        reinterpret_cast<uint8_t*>(scales_at)[si] = piece.scale8;
      } else {
        reinterpret_cast<uint2*>(out)[u] = piece.payload;
        if (lane % 16 == 0) reinterpret_cast<float*>(scales_at)[r * (job.cols / ep::kFp8Block) + u / 16] = piece.scale;
      }
    }
  }
  // This rank's token numbers past its last token sent nothing anywhere: (-1, 0) first in their
  // lists on every rank, so each rank's combine finds every group of the call without a count.
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (job.max_tokens - job.rows) * W;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = job.rows + i / W;
    reinterpret_cast<int2*>(at(slots, job.group, int(i % W)))[(int64_t(s.rank) * job.max_tokens + t) * job.topk] =
        make_int2(-1, 0);
  }
  if (!dedup) {
    barrier(s, kEnd, W, epoch);
    return;
  }
  // Marked rows copy rows that any peer block may have sent, so every block meets every block.
  if (!meet_all_blocks(s, W, meeting, uint32_t(job.mark))) return;
  expand_duplicates<Q>(job, at(slots, job.recv, s.rank), at(slots, job.scales, s.rank), src_here, used_rows, table);
}

// ------------------------------------------------------------------ combine
// Each group this rank holds (one token's entries on this rank: symcomm/ep/layout.py) is added up
// here and crosses NVLink once, as one partial row in its owner's returned buffer, where the
// per-entry combine sent every row: at world 2 with top-8 of 256 experts about four rows a token
// and rank. Work is (group, kCombineChunks chunks of 32 units) items over the grid's warps, every
// (rank, token) a group whether or not it holds rows (the grid follows max_tokens, equal on every
// rank); a warp loads the lists of kLookAhead items at once, lane i an item's pair i, then adds up
// each item's rows with every row of a group of slots loaded before any is added (ep.cuh).
// Chunks of 32 units a warp takes of one group's row at once: as many loads of a listed row in
// flight (ep.cuh's partial_units). On two simulated ranks (bench/NOTES.md, thirty-third session)
// four, with the lists by token, took 2048 tokens' combine from 689 us to 486; one chunk a warp
// where the grid had room for that did not speed up decode (8.5 against 8.2 us).
constexpr int kCombineChunks = 4;

template <int kLookAhead>
struct Lists {
  int2 pair[kLookAhead];

  // Items item + k * stride below `limit`; lanes past topk and items past the limit get (-1, 0).
  __device__ __forceinline__ void load(const Combine& job, int64_t item, int64_t limit, int64_t stride,
                                       int64_t spans) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int k = 0; k < kLookAhead; ++k) {
      const int64_t at_item = item + k * stride;
      pair[k] = make_int2(-1, 0);
      if (at_item < limit && lane < job.topk)
        pair[k] = reinterpret_cast<const int2*>(job.recv_group)[at_item / spans * job.topk + lane];
    }
  }
};

template <int Q, typename T, typename Id, int W>
__global__ void __launch_bounds__(kThreads) ep_combine(Sync s, const Peers* slots, Combine job) {
  constexpr int V = ep::kUnitValues<T>;
  constexpr int kLookAhead = 4;
  static_assert(Q != SYMCOMM_EP_FP8 || V == ep::kFp8Unit, "an FP8 lane encodes its own 16 bytes of T");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, per_block = blockDim.x / 32;
  // An item is kCombineChunks chunks of 32 units of one group's row; the grid follows max_tokens.
  const int64_t spans = (job.units + 32 * kCombineChunks - 1) / (32 * kCombineChunks);
  const int64_t items = int64_t(W) * job.max_tokens * spans;
  const int64_t stride = int64_t(gridDim.x) * per_block, first_item = int64_t(blockIdx.x) * per_block + warp;
  // Every load the prologue needs at once, in one round trip with the epoch: the owners' buffers
  // (checked by slot_ready before use), the dispatch mark, the meeting's number and the first
  // pass's lists (this rank's own dispatch wrote them). All were written by kernels before this
  // one, which begin_epoch's wait makes visible (launch.cuh).
  const EpochWords epoch_words = begin_epoch(s);
  __shared__ char* returned_at[kMaxRanks];
  __shared__ bool after_dispatch;
  __shared__ uint64_t meeting;
  __shared__ int2 listed[kThreads / 32][SYMCOMM_EP_MAX_TOPK];  // each warp's current group, for every lane
  if (threadIdx.x < W) returned_at[threadIdx.x] = at(slots, job.returned, int(threadIdx.x));
  if (threadIdx.x == 0) {
    after_dispatch = *reinterpret_cast<volatile uint32_t*>(&own_signal(s)->ep_dispatched) != 0;
    meeting = next_meeting(s);
  }
  Lists<kLookAhead> lists;
  lists.load(job, first_item, items, stride, spans);
  const T* const expert_out = static_cast<const T*>(job.expert_out);
  const int32_t* const list = reinterpret_cast<const int32_t*>(listed[warp]);
  // A group's list, for every lane of the warp (shared memory), and its partial at the item's chunks.
  const auto add_up = [&](int64_t at_item, int2 pair, float (&acc)[kCombineChunks][V]) {
    __syncwarp();  // every lane has read the previous group's list
    if (lane < job.topk) listed[warp][lane] = pair;
    __syncwarp();
    ep::partial_units<T, kCombineChunks>(expert_out, list, job.cols, job.units,
                                         (at_item % spans) * 32 * kCombineChunks + lane, job.topk, acc);
  };
  // The first item is added up before the epoch and the start barrier: its rows come from kernels
  // before this one (begin_epoch waited for them), and only its stores into the owner's buffer wait
  // for the barrier. A decode call, one item a warp, then pays no round trip between the barrier
  // and its stores.
  float first[kCombineChunks][V];
  const bool first_held = first_item < items && __shfl_sync(kFull, lists.pair[0].x, 0) >= 0;
  if (first_held) add_up(first_item, lists.pair[0], first);
  const bool mapped = slot_ready(s, slots + job.returned.slot, W);
  const uint64_t epoch = end_epoch(s, epoch_words);
  if (epoch == 0 || !mapped) return;
  if (!after_dispatch && !barrier(s, kStart, W, epoch)) return;
  const int64_t partial_rows = W * job.max_tokens;  // rows of a returned buffer
  // The partial of item `at_item` into its owner's returned buffer, rounded (and FP8-encoded).
  const auto send = [&](int64_t at_item, const float (&acc)[kCombineChunks][V]) {
    const int64_t group = at_item / spans;
    const int64_t slot = s.rank * job.max_tokens + group % job.max_tokens;
    char* const back = returned_at[group / job.max_tokens];
    const int64_t u0 = (at_item % spans) * 32 * kCombineChunks + lane;
#pragma unroll
    for (int m = 0; m < kCombineChunks; ++m) {
      const int64_t u = u0 + 32 * m;
      const bool mine = u < job.units;
      if (u - lane >= job.units) break;  // past the row: the same in every lane
      alignas(16) T rounded[V];
#pragma unroll
      for (int i = 0; i < V; ++i) rounded[i] = symcomm::from_f32<T>(acc[m][i]);
      if constexpr (Q == SYMCOMM_EP_NONE) {
        if (mine) reinterpret_cast<uint4*>(back)[slot * job.units + u] = *reinterpret_cast<const uint4*>(rounded);
      } else {
        float v[ep::kFp8Unit];
        uint32_t amax = 0;
#pragma unroll
        for (int i = 0; i < ep::kFp8Unit; ++i) amax = fp4::amax_step(amax, v[i] = symcomm::to_f32(rounded[i]));
#pragma unroll
        for (int b = 8; b >= 1; b >>= 1) amax = max(amax, __shfl_xor_sync(kFull, amax, b));  // the block's 16 lanes
        const float scale = ep::fp8_scale(amax);
        const uint2 codes = ep::fp8_codes8(v, scale);
        if (mine) {
          reinterpret_cast<uint2*>(back + slot * job.cols)[u] = codes;
          if (lane % 16 == 0)
            reinterpret_cast<float*>(back + partial_rows * job.cols)[slot * (job.cols / ep::kFp8Block) + u / 16] =
                scale;
        }
      }
    }
  };
  if (first_held) send(first_item, first);
  for (int64_t item = first_item; item < items; item += kLookAhead * stride) {
    if (item != first_item) lists.load(job, item, items, stride, spans);
    // Rolled, the pair picked by selects (lists.pair[k] with a run-time k would be in local
    // memory): unrolled, add_up and send were inlined five times, and the FP8 combine's kernel
    // grew to 11,000 instructions and took 1.7x as long at 2048 tokens (bench/NOTES.md,
    // thirty-sixth session).
#pragma unroll 1
    for (int k = 0; k < kLookAhead; ++k) {
      const int64_t at_item = item + k * stride;
      int2 pair = lists.pair[0];
#pragma unroll
      for (int j = 1; j < kLookAhead; ++j) pair = k == j ? lists.pair[j] : pair;
      // The same in every lane: one group per warp. A group that holds no row here has nothing to
      // send; the first item went before the loop.
      if ((k == 0 && item == first_item) || at_item >= items || __shfl_sync(kFull, pair.x, 0) < 0) continue;
      float acc[kCombineChunks][V];
      add_up(at_item, pair, acc);
      send(at_item, acc);
    }
  }
  // Partials came back from every block of every peer. A rank that gave up leaves out unwritten.
  if (!meet_all_blocks(s, W, meeting, job.mark)) return;
  if (blockIdx.x == 0 && threadIdx.x == 0) own_signal(s)->ep_dispatched = 0;  // every block has read it
  // One thread per 8 values of a token: the partials of the ranks holding its entries, in rank order.
  const int64_t per_row = job.cols / ep::kCombineUnit;
  const char* back = returned_at[s.rank];
  const Id* ids = static_cast<const Id*>(job.ids);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < job.rows * per_row;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / per_row, u = i % per_row;
    float acc[ep::kCombineUnit];
    ep::owner_unit<T, Q, W>(back, ids, job.send_rows, job.topk, job.num_local, W, t, u, job.cols, job.max_tokens, acc);
    ep::store8(static_cast<T*>(job.out) + t * job.cols + u * ep::kCombineUnit, acc);
  }
}

// ------------------------------------------------------------------ argument rules
size_t itemsize(symcomm_dtype_t dtype) { return dtype == SYMCOMM_FLOAT32 ? 4 : 2; }

bool known_dtype(symcomm_dtype_t d) { return d == SYMCOMM_FLOAT32 || d == SYMCOMM_FLOAT16 || d == SYMCOMM_BFLOAT16; }

int64_t capacity_for(int world, const symcomm_ep_dispatch_args_t& a) {
  const int64_t local = a.num_experts / world;
  return world * a.max_tokens * (a.topk < local ? a.topk : local) + local * (a.align - 1);
}

// The rules both symcomm_ep_dispatch and its host twin apply; fills what the kernels need.
bool dispatch_job(const symcomm_ep_dispatch_args_t& a, int world, Dispatch* job) {
  if (!known_dtype(a.dtype) || a.cols <= 0 || a.rows < 0 || a.rows > a.max_tokens || a.max_tokens < 1) return false;
  if (a.topk < 1 || a.topk > SYMCOMM_EP_MAX_TOPK || a.num_experts < world || a.num_experts > kMaxExperts ||
      a.num_experts % world || a.align < 1 || a.capacity != capacity_for(world, a))
    return false;
  if (a.topk_ids == nullptr && a.rows) return false;
  if (a.send_rows == nullptr || a.expert_counts == nullptr || a.expert_offsets == nullptr) return false;
  if ((a.rows && reinterpret_cast<uintptr_t>(a.x) % 16) || a.recv_offset % 16 || a.scales_offset % 4 ||
      a.src_offset % 4 || a.table_offset % 4 || a.group_offset % 8)
    return false;
  if (a.rows && (a.weights == nullptr || !known_dtype(a.weights_dtype))) return false;
  Dispatch& j = *job;
  j = Dispatch{};
  j.x = a.x, j.ids = a.topk_ids, j.rows = a.rows, j.cols = a.cols, j.max_tokens = a.max_tokens;
  j.topk = a.topk, j.experts = a.num_experts, j.local = a.num_experts / world;
  j.align = a.align, j.swizzle = a.swizzle, j.gs_ptr = static_cast<const float*>(a.gs_ptr), j.gs_value = a.gs_value;
  j.recv = {a.recv_slot, a.recv_offset}, j.scales = {a.scales_slot, a.scales_offset};
  j.src = {a.src_slot, a.src_offset}, j.table = {a.table_slot, a.table_offset};
  j.group = {a.group_slot, a.group_offset}, j.weights = a.weights, j.weights_dtype = a.weights_dtype;
  j.send_rows = a.send_rows, j.expert_counts = a.expert_counts, j.expert_offsets = a.expert_offsets;
  switch (a.quant) {
    case SYMCOMM_EP_NONE:
      if (a.cols * itemsize(a.dtype) % 16 || a.swizzle) return false;
      j.row_bytes = a.cols * int64_t(itemsize(a.dtype));
      j.units = j.row_bytes / 16;
      break;
    case SYMCOMM_EP_NVFP4:
      if (a.dtype == SYMCOMM_FLOAT32 || a.cols % fp4::kBlock) return false;
      j.row_bytes = a.cols / 2;
      j.units = a.cols / fp4::kBlock;
      break;
    case SYMCOMM_EP_FP8:
      if (a.dtype == SYMCOMM_FLOAT32 || a.cols % ep::kFp8Block || a.swizzle) return false;
      j.row_bytes = a.cols;
      j.units = a.cols / ep::kFp8Unit;
      break;
    default:
      return false;
  }
  j.mark = ep::fingerprint(a.capacity, j.row_bytes, a.topk, a.align, a.max_tokens, a.num_experts, a.quant, a.cols,
                           a.dtype);
  j.dedup_ok = a.capacity * a.topk < int64_t(INT32_MAX) - 2;  // equal on every rank: the fingerprint has both
  return true;
}

bool combine_job(const symcomm_ep_combine_args_t& a, Combine* job) {
  if (!known_dtype(a.dtype) || a.cols <= 0 || a.cols % ep::kCombineUnit || a.topk < 1 ||
      a.topk > SYMCOMM_EP_MAX_TOPK || a.rows < 0 || a.rows > a.max_tokens || a.num_local < 1)
    return false;
  if (a.recv_group == nullptr ||
      (a.rows && (a.send_rows == nullptr || a.topk_ids == nullptr || a.out == nullptr)))
    return false;
  if ((reinterpret_cast<uintptr_t>(a.expert_out) | reinterpret_cast<uintptr_t>(a.out)) % 16 || a.returned_offset % 16 ||
      reinterpret_cast<uintptr_t>(a.recv_group) % 8 || a.cols * int64_t(itemsize(a.dtype)) % 16)
    return false;
  if (a.quant == SYMCOMM_EP_FP8 && (a.dtype == SYMCOMM_FLOAT32 || a.cols % ep::kFp8Block)) return false;
  if (a.quant != SYMCOMM_EP_NONE && a.quant != SYMCOMM_EP_FP8) return false;
  Combine& j = *job;
  j = Combine{};
  j.expert_out = a.expert_out, j.cols = a.cols, j.max_tokens = a.max_tokens;
  j.rows = a.rows, j.topk = a.topk, j.num_local = a.num_local;
  j.recv_group = a.recv_group, j.returned = {a.returned_slot, a.returned_offset};
  j.send_rows = a.send_rows, j.ids = a.topk_ids, j.out = a.out;
  j.mark = ep::combine_mark(a.quant, a.dtype, a.cols, a.capacity, a.max_tokens, a.topk);
  j.units = a.cols * int64_t(itemsize(a.dtype)) / 16;
  return true;
}

bool bad_slot(const Context* c, int slot) { return slot < 1 || slot >= c->max_slots; }

int blocks_for_items(const Context* c, int64_t items, int threads = kThreads) {
  const int64_t warps = threads / 32;
  const int64_t b = (items + warps - 1) / warps;
  return int(b < 1 ? 1 : b < c->grid_blocks ? b : c->grid_blocks);
}

// Runs f(Type<T>{}) for the element type quantization reads (bf16 or fp16).
template <typename F>
cudaError_t for_half(symcomm_dtype_t dtype, F&& f) {
  if (dtype == SYMCOMM_BFLOAT16) return f(Type<__nv_bfloat16>{});
  if (dtype == SYMCOMM_FLOAT16) return f(Type<__half>{});
  return cudaErrorInvalidValue;
}

// One launch on every call, even on a rank with no rows: the dispatch writes peers' counts tables
// without a start barrier because each dispatch's end barrier stands in for the next one's (see
// ep_dispatch). The grid follows max_tokens, equal on every rank, since block b meets block b.
template <int W, typename Id>
cudaError_t launch_dispatch(const Context* c, const Dispatch& job, symcomm_ep_quant_t quant, symcomm_dtype_t dtype,
                            cudaStream_t stream) {
  const Sync s = make_sync(c);
  // Blocks of 512 threads while the grid at its cap covers every row unit in one pass, of 1024
  // past that. On simulated ranks (bench/NOTES.md, 2026-11-29 ninth session) 1024 made dispatch
  // 0.72-0.76x at 512-2048 tokens, twice the warps keeping stores in flight, and 1.5 µs slower at
  // 1-8 tokens, where a block has work for 28 warps or fewer.
  const int64_t items = job.max_tokens * ((job.units + 31) / 32);
  const int threads = items > int64_t(c->grid_blocks) * (kThreads / 32) ? kDispatchThreads : kThreads;
  const int blocks = blocks_for_items(c, items, threads);
  if (quant == SYMCOMM_EP_NONE)
    return launch(c->overlap, ep_dispatch<SYMCOMM_EP_NONE, uint8_t, Id, W>, blocks, unsigned(threads), stream, s,
                  c->slots, job);
  return for_half(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    if (quant == SYMCOMM_EP_NVFP4)
      return launch(c->overlap, ep_dispatch<SYMCOMM_EP_NVFP4, T, Id, W>, blocks, unsigned(threads), stream, s,
                    c->slots, job);
    return launch(c->overlap, ep_dispatch<SYMCOMM_EP_FP8, T, Id, W>, blocks, unsigned(threads), stream, s, c->slots,
                  job);
  });
}

template <int W, typename T, typename Id>
cudaError_t launch_combine(const Context* c, const Combine& job, symcomm_ep_quant_t quant, int blocks,
                           cudaStream_t stream) {
  const Sync s = make_sync(c);
  if (quant == SYMCOMM_EP_NONE)
    return launch(c->overlap, ep_combine<SYMCOMM_EP_NONE, T, Id, W>, blocks, kThreads, stream, s, c->slots, job);
  if constexpr (std::is_same<T, float>::value) {
    return cudaErrorInvalidValue;  // combine_job refuses FP8 from fp32 rows
  } else {
    return launch(c->overlap, ep_combine<SYMCOMM_EP_FP8, T, Id, W>, blocks, kThreads, stream, s, c->slots, job);
  }
}

// Loads every EP kernel of world W on this device, once. With lazy module loading (CUDA's
// default) a kernel is loaded at its first launch, and loading may wait for the device to be
// idle; a rank whose previous EP kernel spins waiting for a peer is not idle while the host sits
// in that load, and simulated ranks driven by one host thread would never launch the peer it
// waits for. So the first EP call of a world loads them all before it launches anything.
template <int W>
cudaError_t preload(int device) {
  static std::mutex mutex;
  static std::set<int> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  if (loaded.count(device)) return cudaSuccess;
  const void* kernels[] = {
      reinterpret_cast<const void*>(ep_dispatch<SYMCOMM_EP_NONE, uint8_t, int32_t, W>),
      reinterpret_cast<const void*>(ep_dispatch<SYMCOMM_EP_NONE, uint8_t, int64_t, W>),
      reinterpret_cast<const void*>(ep_dispatch<SYMCOMM_EP_NVFP4, __nv_bfloat16, int32_t, W>),
      reinterpret_cast<const void*>(ep_dispatch<SYMCOMM_EP_NVFP4, __nv_bfloat16, int64_t, W>),
      reinterpret_cast<const void*>(ep_dispatch<SYMCOMM_EP_NVFP4, __half, int32_t, W>),
      reinterpret_cast<const void*>(ep_dispatch<SYMCOMM_EP_NVFP4, __half, int64_t, W>),
      reinterpret_cast<const void*>(ep_dispatch<SYMCOMM_EP_FP8, __nv_bfloat16, int32_t, W>),
      reinterpret_cast<const void*>(ep_dispatch<SYMCOMM_EP_FP8, __nv_bfloat16, int64_t, W>),
      reinterpret_cast<const void*>(ep_dispatch<SYMCOMM_EP_FP8, __half, int32_t, W>),
      reinterpret_cast<const void*>(ep_dispatch<SYMCOMM_EP_FP8, __half, int64_t, W>),
      reinterpret_cast<const void*>(ep_combine<SYMCOMM_EP_NONE, __nv_bfloat16, int32_t, W>),
      reinterpret_cast<const void*>(ep_combine<SYMCOMM_EP_NONE, __half, int32_t, W>),
      reinterpret_cast<const void*>(ep_combine<SYMCOMM_EP_NONE, float, int32_t, W>),
      reinterpret_cast<const void*>(ep_combine<SYMCOMM_EP_FP8, __nv_bfloat16, int32_t, W>),
      reinterpret_cast<const void*>(ep_combine<SYMCOMM_EP_FP8, __half, int32_t, W>),
      reinterpret_cast<const void*>(ep_combine<SYMCOMM_EP_NONE, __nv_bfloat16, int64_t, W>),
      reinterpret_cast<const void*>(ep_combine<SYMCOMM_EP_NONE, __half, int64_t, W>),
      reinterpret_cast<const void*>(ep_combine<SYMCOMM_EP_NONE, float, int64_t, W>),
      reinterpret_cast<const void*>(ep_combine<SYMCOMM_EP_FP8, __nv_bfloat16, int64_t, W>),
      reinterpret_cast<const void*>(ep_combine<SYMCOMM_EP_FP8, __half, int64_t, W>)};
  for (const void* kernel : kernels) {
    cudaFuncAttributes attributes;
    const cudaError_t err = cudaFuncGetAttributes(&attributes, kernel);  // loads it
    if (err != cudaSuccess) return err;
  }
  loaded.insert(device);
  return cudaSuccess;
}

// ------------------------------------------------------------------ CPU twin
template <typename T>
void encode_rows_host(const symcomm_ep_dispatch_args_t& a, const Dispatch& j, int64_t t, int dest, int64_t row,
                      void* recv, void* scales) {
  char* out = static_cast<char*>(recv) + row * j.row_bytes;
  if (a.quant == SYMCOMM_EP_NONE) {
    std::memcpy(out, static_cast<const char*>(a.x) + t * j.row_bytes, size_t(j.row_bytes));
    return;
  }
  const T* x = static_cast<const T*>(a.x) + t * a.cols;
  if (a.quant == SYMCOMM_EP_NVFP4) {
    const int64_t padded_cols = fp4::padded_cols(a.cols / fp4::kBlock);
    for (int64_t u = 0; u < j.units; ++u) {
      uint2 payload;
      const uint8_t scale = ep::nvfp4_block(x + u * fp4::kBlock, a.gs_value, &payload);
      std::memcpy(out + u * 8, &payload, 8);
      const int64_t si = a.swizzle ? fp4::swizzled_index(row, u, padded_cols) : row * j.units + u;
      static_cast<uint8_t*>(scales)[si] = scale;
    }
    return;
  }
  for (int64_t b = 0; b < a.cols / ep::kFp8Block; ++b) {
    uint32_t amax = 0;
    for (int i = 0; i < ep::kFp8Block; ++i) amax = fp4::amax_step(amax, symcomm::to_f32(x[b * ep::kFp8Block + i]));
    const float scale = ep::fp8_scale(amax);
    static_cast<float*>(scales)[row * (a.cols / ep::kFp8Block) + b] = scale;
    for (int u = 0; u < ep::kFp8Block / ep::kFp8Unit; ++u) {
      float v[ep::kFp8Unit];
      for (int i = 0; i < ep::kFp8Unit; ++i) v[i] = symcomm::to_f32(x[b * ep::kFp8Block + u * ep::kFp8Unit + i]);
      const uint2 codes = ep::fp8_codes8(v, scale);
      std::memcpy(out + b * ep::kFp8Block + u * ep::kFp8Unit, &codes, 8);
    }
  }
}

template <typename Id>
int key_of(const symcomm_ep_dispatch_args_t& a, int64_t e) {
  return ep::entry_key(static_cast<const Id*>(a.topk_ids), e, a.topk, a.num_experts);
}

int entry_key_host(const symcomm_ep_dispatch_args_t& a, int64_t e) {
  return a.ids_int64 ? key_of<int64_t>(a, e) : key_of<int32_t>(a, e);
}

// Rank p's partial of a group (its recv_group `list`) of token t, into the owner's returned buffer
// (ep_combine's first half).
template <typename T>
void partial_host(const symcomm_ep_combine_args_t& a, int world, int p, const int32_t* list, int64_t t, char* back) {
  constexpr int V = ep::kUnitValues<T>;
  const int64_t units = a.cols * int64_t(sizeof(T)) / 16, slots = world * a.max_tokens, slot = p * a.max_tokens + t;
  std::vector<T> row(size_t(a.cols));
  for (int64_t u = 0; u < units; ++u) {
    float acc[1][V];
    ep::partial_units<T, 1>(static_cast<const T*>(a.expert_out), list, a.cols, units, u, a.topk, acc);
    for (int i = 0; i < V; ++i) row[size_t(u * V + i)] = symcomm::from_f32<T>(acc[0][i]);
  }
  if (a.quant == SYMCOMM_EP_NONE) {
    std::memcpy(back + slot * a.cols * int64_t(sizeof(T)), row.data(), size_t(a.cols) * sizeof(T));
    return;
  }
  for (int64_t b = 0; b < a.cols / ep::kFp8Block; ++b) {
    uint32_t amax = 0;
    for (int i = 0; i < ep::kFp8Block; ++i) amax = fp4::amax_step(amax, symcomm::to_f32(row[size_t(b * ep::kFp8Block + i)]));
    const float scale = ep::fp8_scale(amax);
    std::memcpy(back + slots * a.cols + (slot * (a.cols / ep::kFp8Block) + b) * 4, &scale, 4);
    for (int u = 0; u < ep::kFp8Block / ep::kFp8Unit; ++u) {
      float v[ep::kFp8Unit];
      for (int i = 0; i < ep::kFp8Unit; ++i) v[i] = symcomm::to_f32(row[size_t(b * ep::kFp8Block + u * ep::kFp8Unit + i)]);
      const uint2 codes = ep::fp8_codes8(v, scale);
      std::memcpy(back + slot * a.cols + b * ep::kFp8Block + u * ep::kFp8Unit, &codes, 8);
    }
  }
}

constexpr int kMaxWorld = kMaxRanks;

// Rank q's tokens from the partials in its returned buffer (ep_combine's second half).
template <typename T, typename Id>
void owner_host(const symcomm_ep_combine_args_t& a, int world, const char* back) {
  const Id* ids = static_cast<const Id*>(a.topk_ids);
  for (int64_t t = 0; t < a.rows; ++t) {
    for (int64_t u = 0; u < a.cols / ep::kCombineUnit; ++u) {
      float acc[ep::kCombineUnit];
      if (a.quant == SYMCOMM_EP_FP8)
        ep::owner_unit<T, SYMCOMM_EP_FP8, kMaxWorld>(back, ids, a.send_rows, a.topk, a.num_local, world, t, u, a.cols,
                                                     a.max_tokens, acc);
      else
        ep::owner_unit<T, SYMCOMM_EP_NONE, kMaxWorld>(back, ids, a.send_rows, a.topk, a.num_local, world, t, u, a.cols,
                                                      a.max_tokens, acc);
      ep::store8(static_cast<T*>(a.out) + t * a.cols + u * ep::kCombineUnit, acc);
    }
  }
}

template <typename F>
bool for_dtype_host(symcomm_dtype_t dtype, F&& f) {
  switch (dtype) {
    case SYMCOMM_BFLOAT16: f(Type<__nv_bfloat16>{}); return true;
    case SYMCOMM_FLOAT16: f(Type<__half>{}); return true;
    case SYMCOMM_FLOAT32: f(Type<float>{}); return true;
    default: return false;
  }
}

}  // namespace

extern "C" {

int symcomm_ep_dispatch(symcomm_ar_t ctx, const symcomm_ep_dispatch_args_t* args, cudaStream_t stream) {
  if (args == nullptr) return cudaErrorInvalidValue;
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  Dispatch job;
  if (!dispatch_job(*args, c->world, &job)) return cudaErrorInvalidValue;
  if (bad_slot(c, args->recv_slot) || bad_slot(c, args->src_slot) || bad_slot(c, args->table_slot) ||
      bad_slot(c, args->group_slot) ||
      (args->quant != SYMCOMM_EP_NONE && bad_slot(c, args->scales_slot)))
    return cudaErrorInvalidValue;
  if (args->quant == SYMCOMM_EP_NONE) job.scales = job.recv;  // never written: any mapped slot
  const int64_t builtin_from = (kDedupFromBytes + job.row_bytes - 1) / job.row_bytes;
  job.dedup_from = c->ep_dedup_from < 0 ? builtin_from : c->ep_dedup_from;
  // A threshold moved by the testing hook joins the fingerprint: ranks that use different ones
  // stop at kMid with the mismatch, before any row moves, where one that dedups and one that does
  // not would leave rows unexpanded and then time out.
  if (job.dedup_from != builtin_from)
    job.mark = int32_t((uint32_t(job.mark) ^ uint32_t((uint64_t(job.dedup_from) + 1) * 0x9E3779B97F4A7C15ull >> 33)) &
                       0x7FFFFFFFu);
  return for_world(c->world, [&](auto w) {
    constexpr int W = decltype(w)::value;
    const cudaError_t loaded = preload<W>(c->device);
    if (loaded != cudaSuccess) return loaded;
    return args->ids_int64 ? launch_dispatch<W, int64_t>(c, job, args->quant, args->dtype, stream)
                           : launch_dispatch<W, int32_t>(c, job, args->quant, args->dtype, stream);
  });
}

int symcomm_ep_debug_dedup_from(symcomm_ar_t ctx, int64_t entries) {
  if (entries < -1) return cudaErrorInvalidValue;
  ctx->impl.ep_dedup_from = entries < INT32_MAX ? entries : INT32_MAX;  // past any count, and W * it fits
  return cudaSuccess;
}

int symcomm_ep_combine(symcomm_ar_t ctx, const symcomm_ep_combine_args_t* args, cudaStream_t stream) {
  if (args == nullptr) return cudaErrorInvalidValue;
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  Combine job;
  if (!combine_job(*args, &job) || bad_slot(c, args->returned_slot)) return cudaErrorInvalidValue;
  // One grid adds up the groups, then the partials: as many blocks as the larger half wants. Both
  // follow sizes equal on every rank (max_tokens, never this rank's rows), since every
  // block waits for as many blocks of each peer as its own grid has.
  const int64_t sums = args->max_tokens * (args->cols / ep::kCombineUnit);
  const int64_t spans = (job.units + 32 * kCombineChunks - 1) / (32 * kCombineChunks);
  const int blocks = std::max(blocks_for_items(c, c->world * args->max_tokens * spans), blocks_for_items(c, (sums + 31) / 32));
  return for_world(c->world, [&](auto w) {
    constexpr int W = decltype(w)::value;
    const cudaError_t loaded = preload<W>(c->device);
    if (loaded != cudaSuccess) return loaded;
    return for_dtype(args->dtype, [&](auto type) {
      using T = typename decltype(type)::type;
      return args->ids_int64 ? launch_combine<W, T, int64_t>(c, job, args->quant, blocks, stream)
                             : launch_combine<W, T, int32_t>(c, job, args->quant, blocks, stream);
    });
  });
}

int symcomm_ep_dispatch_host(int world, const symcomm_ep_dispatch_args_t* args, void* const* recv,
                             void* const* scales, int32_t* const* src, int32_t* const* table, int32_t* const* group) {
  if (args == nullptr || recv == nullptr || src == nullptr || table == nullptr || group == nullptr || world < 1 ||
      world > kMaxRanks)
    return cudaErrorInvalidValue;
  std::vector<Dispatch> jobs(world);
  for (int r = 0; r < world; ++r) {
    if (!dispatch_job(args[r], world, &jobs[r]) || args[r].num_experts != args[0].num_experts)
      return cudaErrorInvalidValue;
    if (args[r].quant != SYMCOMM_EP_NONE && (scales == nullptr || scales[r] == nullptr)) return cudaErrorInvalidValue;
  }
  const int E = args[0].num_experts, L = E / world;
  for (int r = 0; r < world; ++r)  // the kernels stop ranks whose sizes differ; the twin refuses them
    if (jobs[r].mark != jobs[0].mark) return cudaErrorInvalidValue;
  // Counts and positions, entry by entry in token order; every rank's row into every table.
  for (int r = 0; r < world; ++r) {
    const symcomm_ep_dispatch_args_t& a = args[r];
    std::vector<int32_t> counts(E, 0);
    for (int64_t e = 0; e < a.rows * a.topk; ++e) {
      const int key = entry_key_host(a, e);
      a.send_rows[e] = key < 0 ? -1 : counts[key]++;
    }
    counts.push_back(jobs[r].mark);
    for (int q = 0; q < world; ++q) std::memcpy(table[q] + r * (E + 1), counts.data(), sizeof(int32_t) * (E + 1));
  }
  // Rows: segment starts per rank and expert, this rank's layout, each entry's row.
  for (int r = 0; r < world; ++r) {
    const symcomm_ep_dispatch_args_t& a = args[r];
    std::vector<int64_t> base(E);
    for (int p = 0; p < world; ++p) {
      int64_t start = 0;
      for (int e = 0; e < L; ++e) {
        const int id = p * L + e;
        int64_t total = 0, before = 0;
        for (int q = 0; q < world; ++q) {
          total += table[r][q * (E + 1) + id];
          before += q < r ? table[r][q * (E + 1) + id] : 0;
        }
        base[id] = start + before;
        if (p == r) {
          a.expert_counts[e] = int32_t(total);
          a.expert_offsets[e] = int32_t(start);
          for (int64_t row = start + total; row < start + ep::align_up(total, a.align); ++row) src[r][row] = -1;
        }
        start += ep::align_up(total, a.align);
      }
      if (p == r) a.expert_offsets[L] = int32_t(start);
    }
    for (int64_t e = 0; e < a.rows * a.topk; ++e)
      if (a.send_rows[e] >= 0) a.send_rows[e] = int32_t(base[entry_key_host(a, e)] + a.send_rows[e]);
  }
  // Every token into its entries' rows, with its origin, and each of its groups into recv_group;
  // the token numbers past the last sent nothing.
  for (int r = 0; r < world; ++r) {
    const symcomm_ep_dispatch_args_t& a = args[r];
    for (int64_t t = a.rows; t < a.max_tokens; ++t)
      for (int dest = 0; dest < world; ++dest) {
        int32_t* const list = group[dest] + (r * a.max_tokens + t) * a.topk * ep::kGroupPairs;
        list[0] = -1, list[1] = 0;
      }
    for (int64_t t = 0; t < a.rows; ++t) {
      for (int dest = 0; dest < world; ++dest) {
        int32_t* const list = group[dest] + (r * a.max_tokens + t) * a.topk * ep::kGroupPairs;
        int members = 0;
        for (int jj = 0; jj < a.topk; ++jj) {
          const int64_t e = t * a.topk + jj;
          if (a.send_rows[e] < 0 || entry_key_host(a, e) / L != dest) continue;
          list[members * ep::kGroupPairs] = a.send_rows[e];
          list[members * ep::kGroupPairs + 1] = int32_t(symcomm::bits_of(ep::weight_at(a.weights, a.weights_dtype, e)));
          ++members;
        }
        if (members < a.topk) list[members * ep::kGroupPairs] = -1, list[members * ep::kGroupPairs + 1] = 0;
      }
      for (int jj = 0; jj < a.topk; ++jj) {
        const int64_t e = t * a.topk + jj;
        const int32_t row = a.send_rows[e];
        if (row < 0) continue;
        const int dest = entry_key_host(a, e) / L;
        src[dest][row] = ep::origin(r, a.max_tokens, t, a.topk, jj);
        void* sc = scales != nullptr ? scales[dest] : nullptr;
        const bool known = for_dtype_host(a.dtype, [&](auto type) {
          using T = typename decltype(type)::type;
          encode_rows_host<T>(a, jobs[r], t, dest, row, recv[dest], sc);
        });
        if (!known) return cudaErrorInvalidValue;
      }
    }
  }
  return cudaSuccess;
}

int symcomm_ep_combine_host(int world, const symcomm_ep_combine_args_t* args, void* const* returned) {
  if (args == nullptr || returned == nullptr || world < 1 || world > kMaxRanks) return cudaErrorInvalidValue;
  std::vector<Combine> jobs(world);
  for (int r = 0; r < world; ++r)  // the kernels stop ranks that disagree at the meeting; the twin refuses them
    if (!combine_job(args[r], &jobs[r]) || jobs[r].mark != jobs[0].mark) return cudaErrorInvalidValue;
  for (int p = 0; p < world; ++p) {
    const symcomm_ep_combine_args_t& a = args[p];
    for (int q = 0; q < world; ++q) {
      for (int64_t t = 0; t < a.max_tokens; ++t) {
        const int32_t* list = a.recv_group + (q * a.max_tokens + t) * a.topk * ep::kGroupPairs;
        if (list[0] < 0) continue;  // no row of this token here
        const bool known = for_dtype_host(a.dtype, [&](auto type) {
          using T = typename decltype(type)::type;
          partial_host<T>(a, world, p, list, t, static_cast<char*>(returned[q]));
        });
        if (!known) return cudaErrorInvalidValue;
      }
    }
  }
  for (int q = 0; q < world; ++q) {
    for_dtype_host(args[q].dtype, [&](auto type) {
      using T = typename decltype(type)::type;
      if (args[q].ids_int64)
        owner_host<T, int64_t>(args[q], world, static_cast<const char*>(returned[q]));
      else
        owner_host<T, int32_t>(args[q], world, static_cast<const char*>(returned[q]));
    });
  }
  return cudaSuccess;
}

}  // extern "C"
