// MoE expert-parallel dispatch and combine over peer-mapped symmetric memory
// (symcomm/backends/ep_push.py). symcomm/ep/layout.py defines where every row lands and how
// combine adds; csrc/ep.cuh holds the per-entry and per-row math shared with the CPU twin.
//
// Dispatch is two launches. ep_layout (one block): this rank's valid entries are counted per
// expert and numbered in token order; each rank writes its counts row into every rank's counts
// table (context memory, in the Signal blocks), and the ranks meet (end barrier: every row has
// landed, its writer released it before arriving, and every rank got here only after
// finishing its earlier work, so the pool buffers the push writes are free). The block then
// turns the table into rows: each entry's row on its destination (send_rows), this rank's
// receive layout, a copy of the table in the handle, and -1 in the padding rows of its
// recv_src. ep_push (many blocks) writes every token, quantized on the way, into the receive
// buffers of its entries' ranks, with its origin in their recv_src, then meets the peers: when
// it completes on a rank, every peer's block b has arrived after its writes for every b, so
// everything sent there has landed.
//
// Combine is one launch, ep_combine (many blocks). It meets the peers first, because the owners of
// the tokens must have finished adding the previous combine's rows, which they read from the buffer
// this call writes; that start barrier is skipped when a dispatch ran since the last combine, since
// the dispatch's barriers already proved it (every rank reached them only after finishing the
// combine before). The mark is the peer-push paths' own: an a2a dispatch leaves it alone, and an
// a2a combine never reads `returned`. It writes each used received row of expert_out (FP8-quantized
// on the way) into the owner's returned buffer at the entry's slot and meets the peers again; then
// every block of the grid meets (grid_barrier: block b's barrier only covers the peers' block b),
// and the grid adds each token's returned rows in slot order, weighted, in fp32.
//
// No count ever reaches the host: the grids follow max_tokens and capacity, equal on every rank,
// and the kernels read the counts on the device, so every launch can be captured in a graph.
#include "ep.cuh"
#include "peer.cuh"
#include "symcomm_testing.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <set>
#include <vector>

namespace {
using namespace symcomm::ar;
using symcomm::launch;
namespace ep = symcomm::ep;
namespace fp4 = symcomm::fp4;

constexpr int kLayoutInts = 8192;  // ep_layout's shared [warps][experts] counters (32 KiB)
constexpr int kMaxExperts = SYMCOMM_EP_MAX_EXPERTS;
constexpr unsigned kFull = 0xFFFFFFFFu;
static_assert(SYMCOMM_EP_MAX_TOPK <= 32, "one lane per top-k slot");
static_assert(kLayoutInts / kMaxExperts >= 1, "at least one warp's counters fit");

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
  int64_t rows, cols, max_tokens, capacity;
  int topk, experts, local, align, swizzle;
  const float* gs_ptr;
  float gs_value;
  Buf recv, scales, src, table;
  int32_t* send_rows;
  int32_t* expert_counts;
  int32_t* expert_offsets;
  int64_t units;      // lane units per token row (16 bytes, an NVFP4 block, or 8 FP8 values)
  int64_t row_bytes;  // bytes of one received row
};

struct Combine {
  const void* expert_out;
  int64_t cols, capacity, max_tokens, rows;
  int topk, num_local;
  const int32_t* recv_src;
  const int32_t* expert_offsets;
  Buf returned;
  const int32_t* send_rows;
  const void* weights;
  symcomm_dtype_t weights_dtype;
  void* out;
  int64_t units;  // lane units per row sent back: 16 bytes, or 8 FP8 values
};

// ------------------------------------------------------------------ dispatch: layout
// Decode calls (a handful of entries) are latency-bound here, one memory round trip after another,
// so the kernel keeps them few: only as many warps count as there are 32-entry chunks, the slot
// check runs in the last warp (one that does not count unless every warp does), the fingerprints
// and counts come in one pass, and each entry's position stays in its lane from counting to the
// final rows.
template <typename Id, int W>
__global__ void __launch_bounds__(1024) ep_layout(Sync s, const Peers* slots, Dispatch job) {
  __shared__ int32_t table[kLayoutInts];  // [warp][expert]: counts, then exclusive prefix over warps
  __shared__ int32_t counts[kMaxExperts];
  __shared__ int32_t base[kMaxExperts];
  __shared__ int32_t starts[kMaxExperts];  // segment scan: every expert's start over all ranks
  __shared__ int32_t warp_sum[32];
  __shared__ bool mapped;
  __shared__ Signal* signal_at[kMaxRanks];  // every rank's Signal block, which holds its counts table
  const int E = job.experts, warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Id* ids = static_cast<const Id*>(job.ids);
  const int64_t entries = job.rows * job.topk;
  const int64_t chunks = (entries + 31) / 32;
  const int counting = int(chunks < 1 ? 1 : chunks < warps ? chunks : warps);
  // Counting warp w numbers entries [lo, hi).
  const int64_t run = (entries + counting - 1) / counting;
  const int64_t lo = warp < counting ? warp * run : entries;
  const int64_t hi = lo + run < entries ? lo + run : entries;
  const uint64_t epoch = next_epoch(s);
  if (epoch == 0) return;
  // Addresses now, so that no later phase waits for a load from the slot table; none is
  // dereferenced before slots_ready has passed.
  if (threadIdx.x < W) signal_at[threadIdx.x] = reinterpret_cast<Signal*>(s.signals.ptr[threadIdx.x]);
  int32_t* const src_here = reinterpret_cast<int32_t*>(at(slots, job.src, s.rank));
  int32_t* const table_here = reinterpret_cast<int32_t*>(at(slots, job.table, s.rank));
  for (int i = threadIdx.x; i < counting * E; i += blockDim.x) table[i] = 0;
  if (warp == warps - 1) {  // counts too when every warp does
    const Peers* const used[] = {slots + job.table.slot, slots + job.src.slot, slots + job.recv.slot,
                                 slots + job.scales.slot};
    const bool ready = slots_ready(s, used, W);
    if (lane == 0) mapped = ready;
  }
  __syncthreads();
  if (!mapped) return;
  // Each counting warp numbers one run of entries, 32 at a time: lanes naming the same expert
  // rank themselves by lane (match_any) after what the warp counted so far, and the lowest of
  // them adds their number. So a run keeps token order, and the runs follow warp order (the
  // prefix below), which is the token order of the whole rank. A lane keeps its first chunk's
  // key and position; later chunks go through send_rows.
  int first_key = -1;
  int32_t first_pos = -1;
  for (int64_t first = lo; first < hi; first += 32) {
    const int64_t e = first + lane;
    const int key = e < hi ? ep::entry_key(ids, e, job.topk, E) : -1;
    const unsigned same = __match_any_sync(kFull, key);
    const int32_t before = key >= 0 ? table[warp * E + key] : 0;
    __syncwarp();
    if (key >= 0 && lane == __ffs(same) - 1) table[warp * E + key] = before + __popc(same);
    __syncwarp();
    const int32_t pos = key >= 0 ? before + __popc(same & ((1u << lane) - 1)) : -1;
    if (first == lo) {
      first_key = key;
      first_pos = pos;
    } else if (e < hi) {
      job.send_rows[e] = pos;
    }
  }
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
  // This rank's row of every rank's counts table: its counts, then its fingerprint (one more
  // column). The tables are context memory, in the Signal blocks, so no barrier comes first: a
  // rank reads its table only in its own layout, and a peer can be here, writing it, only after
  // its previous dispatch's push met this rank's push, which this rank began after that
  // layout ended. A pool buffer could have served some other use on this rank until this
  // call, so writing one needed a start barrier. The end barrier still proves every rank got
  // here after all its earlier work, before any row moves into its pool buffers.
  const int row = E + 1;
  const int32_t mark = ep::fingerprint(job.capacity, job.row_bytes, job.topk, job.align, job.max_tokens, E);
  for (int i = threadIdx.x; i < W * row; i += blockDim.x) {
    const int q = (s.rank + i / row) % W;  // ranks do not all start on one peer
    const int col = i % row;
    // The fingerprint sits in the last column whatever E is, so a rank reads a peer's current
    // one even where the peer passed another expert count.
    signal_at[q]->ep_table[s.rank][col < E ? col : kMaxExperts] = col < E ? counts[col] : mark;
  }
  if (!barrier(s, kEnd, W, epoch)) return;
  const auto& all = signal_at[s.rank]->ep_table;
  // Every rank sees every fingerprint, so every rank stops alike, before any row moves. The
  // fingerprints are read in the same pass as the counts, which also go to the handle's table.
  bool agree = true;
  if (threadIdx.x < W) {
    const int32_t theirs = all[threadIdx.x][kMaxExperts];
    table_here[threadIdx.x * row + E] = theirs;
    if (theirs != mark) {
      give_up(s, abort_code(SYMCOMM_AR_ABORT_MISMATCH, kEnd, int(threadIdx.x)));
      agree = false;
    }
  }
  for (int id = threadIdx.x; id < E; id += blockDim.x) {
    int32_t total = 0, before = 0;
#pragma unroll
    for (int q = 0; q < W; ++q) {
      const int32_t c = all[q][id];
      table_here[q * row + id] = c;
      before += q < s.rank ? c : 0;
      total += c;
    }
    counts[id] = total;
    base[id] = before;
  }
  if (!__syncthreads_and(agree)) return;
  // Segment starts: one block-wide exclusive scan of every expert's aligned total, each rank's
  // segment then measured from its first expert. A thread scans `per` consecutive experts, each
  // warp its threads' sums, warp 0 the warps' sums: three short steps, where a warp per rank
  // walking its experts 32 at a time was the slowest phase of a decode call.
  const int L = job.local, align = job.align;
  const auto aligned = [align](int32_t n) { return (n + align - 1) / align * align; };
  const int per = (E + int(blockDim.x) - 1) / int(blockDim.x), first_id = int(threadIdx.x) * per;
  int32_t mine = 0;
  for (int k = 0; k < per && first_id + k < E; ++k) mine += aligned(counts[first_id + k]);
  int32_t inclusive = mine;
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
  int32_t running = warp_sum[warp] + inclusive - mine;
  for (int k = 0; k < per && first_id + k < E; ++k) {
    starts[first_id + k] = running;
    running += aligned(counts[first_id + k]);
  }
  __syncthreads();
  for (int id = threadIdx.x; id < E; id += blockDim.x) {
    const int p = id / L, e = id % L;
    const int32_t start = starts[id] - starts[p * L];
    base[id] += start;
    if (p == s.rank) {
      const int32_t filled = counts[id], end = start + aligned(filled);
      job.expert_counts[e] = filled;
      job.expert_offsets[e] = start;
      for (int32_t r = start + filled; r < end; ++r) src_here[r] = -1;  // padding rows
      if (e == L - 1) job.expert_offsets[L] = end;
    }
  }
  __syncthreads();
  // Each entry's row on its destination, by the lane that numbered it.
  for (int64_t first = lo; first < hi; first += 32) {
    const int64_t e = first + lane;
    if (e >= hi) break;
    const int key = first == lo ? first_key : ep::entry_key(ids, e, job.topk, E);
    const int32_t pos = first == lo ? first_pos : job.send_rows[e];
    job.send_rows[e] = key >= 0 ? base[key] + table[warp * E + key] + pos : -1;  // < capacity: the fingerprints agree
  }
  // The next combine may skip its start barrier: this dispatch's barriers already ordered it
  // after every owner's previous combine (ep_combine).
  if (threadIdx.x == 0) own_signal(s)->ep_dispatched = 1;
}

// ------------------------------------------------------------------ dispatch: rows
// Every lane's unit of one token row (chunk c of 32 units), encoded once, then stored into each
// valid entry's destination row. Q: SYMCOMM_EP_NONE copies 16 bytes; NVFP4 encodes one 16-value
// block; FP8 encodes 8 values of a 128-value block held by 16 lanes.
template <int Q, typename T, typename Id, int W>
__global__ void __launch_bounds__(kThreads) ep_push(Sync s, const Peers* slots, Dispatch job) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, per_block = blockDim.x / 32;
  const Id* ids = static_cast<const Id*>(job.ids);
  const int64_t chunks = (job.units + 31) / 32, items = job.rows * chunks;
  const uint64_t epoch = next_epoch(s);
  if (epoch == 0) return;
  const float gs = Q == SYMCOMM_EP_NVFP4 ? (job.gs_ptr != nullptr ? *job.gs_ptr : job.gs_value) : 0.0f;
  const int64_t padded_cols = fp4::padded_cols(job.cols / fp4::kBlock);
  // Lane r < W holds rank r's buffers; a lane takes its destination's by shuffle. Loaded once,
  // beside the first row's loads, instead of one dependent load per row through `slots`.
  const Buf buffers[] = {job.recv, job.src, job.scales};
  char* lane_buf[3];
#pragma unroll
  for (int k = 0; k < 3; ++k) lane_buf[k] = lane < W ? at(slots, buffers[k], lane) : nullptr;
  // No has_given_up() here: next_epoch() read it after the layout kernel ended, and the layout
  // is what stops every rank whose peers passed other sizes.
  for (int64_t item = int64_t(blockIdx.x) * per_block + warp; item < items; item += int64_t(gridDim.x) * per_block) {
    const int64_t t = item / chunks, u = (item % chunks) * 32 + lane;
    int dest = -1;
    int32_t row = -1;
    if (lane < job.topk) {  // both loads at once: ids[t, lane] exists whether or not it is sent
      row = job.send_rows[t * job.topk + lane];
      const int64_t id = int64_t(ids[t * job.topk + lane]);
      if (row >= 0) dest = int(id / job.local);
    }
    const bool mine = u < job.units;
    uint4 plain{};
    uint2 payload{};
    uint8_t scale8 = 0;
    float scale = 0.0f;
    if constexpr (Q == SYMCOMM_EP_NONE) {
      if (mine) plain = __ldg(static_cast<const uint4*>(job.x) + t * job.units + u);
    } else if constexpr (Q == SYMCOMM_EP_NVFP4) {
      if (mine) {
        alignas(16) T v[fp4::kBlock];
        const uint4* p = reinterpret_cast<const uint4*>(static_cast<const T*>(job.x) + t * job.cols + u * fp4::kBlock);
#pragma unroll
        for (int k = 0; k < int(fp4::kBlock * sizeof(T) / 16); ++k) reinterpret_cast<uint4*>(v)[k] = __ldg(p + k);
        scale8 = ep::nvfp4_block(v, gs, &payload);
      }
    } else {
      float v[ep::kFp8Unit] = {};
      uint32_t amax = 0;
      if (mine) {
        alignas(16) T raw[ep::kFp8Unit];
        *reinterpret_cast<uint4*>(raw) =
            __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(job.x) + t * job.cols + u * ep::kFp8Unit));
#pragma unroll
        for (int i = 0; i < ep::kFp8Unit; ++i) amax = fp4::amax_step(amax, v[i] = symcomm::to_f32(raw[i]));
      }
#pragma unroll
      for (int m = 8; m >= 1; m >>= 1) amax = max(amax, __shfl_xor_sync(kFull, amax, m));  // the 16 lanes of a block
      scale = ep::fp8_scale(amax);
      payload = ep::fp8_codes8(v, scale);
    }
    // After the row's load is issued, so that it does not wait behind send_rows and ids.
    char* const src_at = peer_buffer(lane_buf[1], dest);
    if (u == lane && row >= 0)
      reinterpret_cast<int32_t*>(src_at)[row] = ep::origin(s.rank, job.max_tokens, t, job.topk, lane);
    for (int j = 0; j < job.topk; ++j) {
      const int d = __shfl_sync(kFull, dest, j);
      const int64_t r = __shfl_sync(kFull, row, j);
      char* const recv_at = peer_buffer(lane_buf[0], d);
      char* const scales_at = peer_buffer(lane_buf[2], d);
      if (d < 0 || !mine) continue;
      char* out = recv_at + r * job.row_bytes;
      if constexpr (Q == SYMCOMM_EP_NONE) {
        reinterpret_cast<uint4*>(out)[u] = plain;
      } else if constexpr (Q == SYMCOMM_EP_NVFP4) {
        reinterpret_cast<uint2*>(out)[u] = payload;
        const int64_t si = job.swizzle ? fp4::swizzled_index(r, u, padded_cols) : r * job.units + u;
        reinterpret_cast<uint8_t*>(scales_at)[si] = scale8;
      } else {
        reinterpret_cast<uint2*>(out)[u] = payload;
        if (lane % 16 == 0) reinterpret_cast<float*>(scales_at)[r * (job.cols / ep::kFp8Block) + u / 16] = scale;
      }
    }
  }
  barrier(s, kEnd, W, epoch);
}

// ------------------------------------------------------------------ combine
template <int Q, typename T, int W>
__global__ void __launch_bounds__(kThreads) ep_combine(Sync s, const Peers* slots, Combine job) {
  const uint64_t epoch = next_epoch(s);
  if (epoch == 0) return;
  // Every load the prologue needs at once, in one round trip: the owners' buffers (checked by
  // slot_ready before use), the dispatch mark, and expert_offsets, which this rank's own layout
  // wrote in an earlier kernel.
  __shared__ char* returned_at[kMaxRanks];
  __shared__ bool after_dispatch;
  if (threadIdx.x < W) returned_at[threadIdx.x] = at(slots, job.returned, int(threadIdx.x));
  if (threadIdx.x == 0) after_dispatch = *reinterpret_cast<volatile uint32_t*>(&own_signal(s)->ep_dispatched) != 0;
  int64_t used = job.expert_offsets[job.num_local];
  if (!slot_ready(s, slots + job.returned.slot, W)) return;
  __syncthreads();
  if (!after_dispatch && !barrier(s, kStart, W, epoch)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, per_block = blockDim.x / 32;
  used = used < job.capacity ? used : job.capacity;
  const int64_t chunks = (job.units + 31) / 32, slots_back = job.max_tokens * job.topk;
  const int64_t items = used * chunks, stride = int64_t(gridDim.x) * per_block;
  int64_t item = int64_t(blockIdx.x) * per_block + warp;
  if constexpr (Q == SYMCOMM_EP_NONE) {
    // kUnroll pieces per warp per pass, every load issued before any store. Dispatch stores each
    // loaded piece topk times; combine stores each once, so with one piece at a time it paid a
    // load round trip (and recv_src's before it) per 16 bytes sent and ran at about a third of
    // dispatch's bandwidth (bench/results/2026-11-28_nvidia-h200-x4_w2_grid_unroll, moe.log).
    // A piece's row is loaded beside its recv_src, not after it: rows below `used` lie inside
    // expert_out, so a padding row's load is harmless and the pass waits for one round trip.
    constexpr int kUnroll = 4;
    for (; item < items; item += kUnroll * stride) {
      uint4 value[kUnroll];
      int32_t origin[kUnroll];
      int64_t unit[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        origin[k] = -1;
        const int64_t at_item = item + k * stride;
        if (at_item >= items) continue;
        const int64_t r = at_item / chunks;
        unit[k] = (at_item % chunks) * 32 + lane;
        origin[k] = job.recv_src[r];  // the same for every lane of the row
        if (unit[k] < job.units) value[k] = __ldg(static_cast<const uint4*>(job.expert_out) + r * job.units + unit[k]);
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        if (origin[k] < 0 || unit[k] >= job.units) continue;
        const int64_t slot = origin[k] % slots_back;
        reinterpret_cast<uint4*>(returned_at[origin[k] / slots_back])[slot * job.units + unit[k]] = value[k];
      }
    }
  } else {
    for (; item < items; item += stride) {
      const int64_t r = item / chunks, u = (item % chunks) * 32 + lane;
      const int32_t origin = job.recv_src[r];
      const bool mine = u < job.units;
      alignas(16) T raw[ep::kFp8Unit];
      if (mine)  // beside recv_src, as above
        *reinterpret_cast<uint4*>(raw) = __ldg(reinterpret_cast<const uint4*>(
            static_cast<const T*>(job.expert_out) + r * job.cols + u * ep::kFp8Unit));
      if (origin < 0) continue;  // the same for every lane: one row per warp
      const int owner = int(origin / slots_back);
      const int64_t slot = origin % slots_back;
      char* back = returned_at[owner];
      float v[ep::kFp8Unit] = {};
      uint32_t amax = 0;
      if (mine) {
#pragma unroll
        for (int i = 0; i < ep::kFp8Unit; ++i) amax = fp4::amax_step(amax, v[i] = symcomm::to_f32(raw[i]));
      }
#pragma unroll
      for (int m = 8; m >= 1; m >>= 1) amax = max(amax, __shfl_xor_sync(kFull, amax, m));
      const float scale = ep::fp8_scale(amax);
      const uint2 codes = ep::fp8_codes8(v, scale);
      if (mine) {
        reinterpret_cast<uint2*>(back + slot * job.cols)[u] = codes;
        if (lane % 16 == 0)
          reinterpret_cast<float*>(back + slots_back * job.cols)[slot * (job.cols / ep::kFp8Block) + u / 16] = scale;
      }
    }
  }
  // Rows came back from every peer's every block: the peers' block b, then this grid's blocks.
  // A rank that gave up leaves out unwritten.
  if (!barrier(s, kEnd, W, epoch) || !grid_barrier(s)) return;
  if (blockIdx.x == 0 && threadIdx.x == 0) own_signal(s)->ep_dispatched = 0;  // every block has read it
  // One thread per 8 values of a token: its entries' rows in slot order, weighted, in fp32.
  const int64_t per_row = job.cols / ep::kCombineUnit;
  const char* back = returned_at[s.rank];
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < job.rows * per_row;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / per_row, u = i % per_row;
    float acc[ep::kCombineUnit];
    ep::sum_unit<T, Q>(back, job.send_rows, job.weights, job.weights_dtype, t, u, job.cols, job.topk, slots_back,
                       acc);
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
      a.src_offset % 4 || a.table_offset % 4)
    return false;
  Dispatch& j = *job;
  j = Dispatch{};
  j.x = a.x, j.ids = a.topk_ids, j.rows = a.rows, j.cols = a.cols, j.max_tokens = a.max_tokens;
  j.capacity = a.capacity, j.topk = a.topk, j.experts = a.num_experts, j.local = a.num_experts / world;
  j.align = a.align, j.swizzle = a.swizzle, j.gs_ptr = static_cast<const float*>(a.gs_ptr), j.gs_value = a.gs_value;
  j.recv = {a.recv_slot, a.recv_offset}, j.scales = {a.scales_slot, a.scales_offset};
  j.src = {a.src_slot, a.src_offset}, j.table = {a.table_slot, a.table_offset};
  j.send_rows = a.send_rows, j.expert_counts = a.expert_counts, j.expert_offsets = a.expert_offsets;
  switch (a.quant) {
    case SYMCOMM_EP_NONE:
      if (a.cols * itemsize(a.dtype) % 16) return false;
      j.row_bytes = a.cols * int64_t(itemsize(a.dtype));
      j.units = j.row_bytes / 16;
      return !a.swizzle;
    case SYMCOMM_EP_NVFP4:
      if (a.dtype == SYMCOMM_FLOAT32 || a.cols % fp4::kBlock) return false;
      j.row_bytes = a.cols / 2;
      j.units = a.cols / fp4::kBlock;
      return true;
    case SYMCOMM_EP_FP8:
      if (a.dtype == SYMCOMM_FLOAT32 || a.cols % ep::kFp8Block || a.swizzle) return false;
      j.row_bytes = a.cols;
      j.units = a.cols / ep::kFp8Unit;
      return true;
    default:
      return false;
  }
}

bool combine_job(const symcomm_ep_combine_args_t& a, Combine* job) {
  if (!known_dtype(a.dtype) || !known_dtype(a.weights_dtype) || a.cols <= 0 || a.cols % ep::kCombineUnit ||
      a.topk < 1 || a.topk > SYMCOMM_EP_MAX_TOPK || a.rows < 0 || a.rows > a.max_tokens || a.num_local < 1)
    return false;
  if (a.recv_src == nullptr || a.expert_offsets == nullptr || (a.rows && (a.send_rows == nullptr ||
      a.weights == nullptr || a.out == nullptr)))
    return false;
  if ((reinterpret_cast<uintptr_t>(a.expert_out) | reinterpret_cast<uintptr_t>(a.out)) % 16 || a.returned_offset % 16)
    return false;
  Combine& j = *job;
  j = Combine{};
  j.expert_out = a.expert_out, j.cols = a.cols, j.capacity = a.capacity, j.max_tokens = a.max_tokens;
  j.rows = a.rows, j.topk = a.topk, j.num_local = a.num_local, j.recv_src = a.recv_src;
  j.expert_offsets = a.expert_offsets, j.returned = {a.returned_slot, a.returned_offset};
  j.send_rows = a.send_rows, j.weights = a.weights, j.weights_dtype = a.weights_dtype, j.out = a.out;
  if (a.quant == SYMCOMM_EP_NONE) {
    j.units = a.cols * int64_t(itemsize(a.dtype)) / 16;
    return true;
  }
  if (a.quant != SYMCOMM_EP_FP8 || a.dtype == SYMCOMM_FLOAT32 || a.cols % ep::kFp8Block) return false;
  j.units = a.cols / ep::kFp8Unit;
  return true;
}

bool bad_slot(const Context* c, int slot) { return slot < 1 || slot >= c->max_slots; }

int blocks_for_items(const Context* c, int64_t items) {
  const int64_t warps = kThreads / 32;
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

// Both kernels, on every call, in this order, even on a rank with no rows: the layout writes
// peers' counts tables without a start barrier because each dispatch's push end barrier stands
// in for the next layout's (see ep_layout).
template <int W, typename Id>
cudaError_t launch_dispatch(const Context* c, const Dispatch& job, symcomm_ep_quant_t quant, symcomm_dtype_t dtype,
                            cudaStream_t stream) {
  const Sync s = make_sync(c);
  int warps = kLayoutInts / job.experts;
  warps = warps < 1 ? 1 : warps > 32 ? 32 : warps;
  cudaError_t err = launch(c->overlap, ep_layout<Id, W>, 1, unsigned(warps * 32), stream, s, c->slots, job);
  if (err != cudaSuccess) return err;
  const int blocks = blocks_for_items(c, job.max_tokens * ((job.units + 31) / 32));
  if (quant == SYMCOMM_EP_NONE)
    return launch(c->overlap, ep_push<SYMCOMM_EP_NONE, uint8_t, Id, W>, blocks, kThreads, stream, s, c->slots, job);
  return for_half(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    if (quant == SYMCOMM_EP_NVFP4)
      return launch(c->overlap, ep_push<SYMCOMM_EP_NVFP4, T, Id, W>, blocks, kThreads, stream, s, c->slots, job);
    return launch(c->overlap, ep_push<SYMCOMM_EP_FP8, T, Id, W>, blocks, kThreads, stream, s, c->slots, job);
  });
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
      reinterpret_cast<const void*>(ep_layout<int32_t, W>), reinterpret_cast<const void*>(ep_layout<int64_t, W>),
      reinterpret_cast<const void*>(ep_push<SYMCOMM_EP_NONE, uint8_t, int32_t, W>),
      reinterpret_cast<const void*>(ep_push<SYMCOMM_EP_NONE, uint8_t, int64_t, W>),
      reinterpret_cast<const void*>(ep_push<SYMCOMM_EP_NVFP4, __nv_bfloat16, int32_t, W>),
      reinterpret_cast<const void*>(ep_push<SYMCOMM_EP_NVFP4, __nv_bfloat16, int64_t, W>),
      reinterpret_cast<const void*>(ep_push<SYMCOMM_EP_NVFP4, __half, int32_t, W>),
      reinterpret_cast<const void*>(ep_push<SYMCOMM_EP_NVFP4, __half, int64_t, W>),
      reinterpret_cast<const void*>(ep_push<SYMCOMM_EP_FP8, __nv_bfloat16, int32_t, W>),
      reinterpret_cast<const void*>(ep_push<SYMCOMM_EP_FP8, __nv_bfloat16, int64_t, W>),
      reinterpret_cast<const void*>(ep_push<SYMCOMM_EP_FP8, __half, int32_t, W>),
      reinterpret_cast<const void*>(ep_push<SYMCOMM_EP_FP8, __half, int64_t, W>),
      reinterpret_cast<const void*>(ep_combine<SYMCOMM_EP_NONE, __nv_bfloat16, W>),
      reinterpret_cast<const void*>(ep_combine<SYMCOMM_EP_NONE, __half, W>),
      reinterpret_cast<const void*>(ep_combine<SYMCOMM_EP_NONE, float, W>),
      reinterpret_cast<const void*>(ep_combine<SYMCOMM_EP_FP8, __nv_bfloat16, W>),
      reinterpret_cast<const void*>(ep_combine<SYMCOMM_EP_FP8, __half, W>)};
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

template <typename T>
void return_row_host(const symcomm_ep_combine_args_t& a, const Combine& j, int64_t r, int64_t slot, char* back) {
  const int64_t slots_back = a.max_tokens * a.topk;
  if (a.quant == SYMCOMM_EP_NONE) {
    const int64_t bytes = j.units * 16;
    std::memcpy(back + slot * bytes, static_cast<const char*>(a.expert_out) + r * bytes, size_t(bytes));
    return;
  }
  const T* x = static_cast<const T*>(a.expert_out) + r * a.cols;
  for (int64_t b = 0; b < a.cols / ep::kFp8Block; ++b) {
    uint32_t amax = 0;
    for (int i = 0; i < ep::kFp8Block; ++i) amax = fp4::amax_step(amax, symcomm::to_f32(x[b * ep::kFp8Block + i]));
    const float scale = ep::fp8_scale(amax);
    std::memcpy(back + slots_back * a.cols + (slot * (a.cols / ep::kFp8Block) + b) * 4, &scale, 4);
    for (int u = 0; u < ep::kFp8Block / ep::kFp8Unit; ++u) {
      float v[ep::kFp8Unit];
      for (int i = 0; i < ep::kFp8Unit; ++i) v[i] = symcomm::to_f32(x[b * ep::kFp8Block + u * ep::kFp8Unit + i]);
      const uint2 codes = ep::fp8_codes8(v, scale);
      std::memcpy(back + slot * a.cols + b * ep::kFp8Block + u * ep::kFp8Unit, &codes, 8);
    }
  }
}

template <typename T>
void sum_rows_host(const symcomm_ep_combine_args_t& a, const char* back) {
  const int64_t slots_back = a.max_tokens * a.topk;
  for (int64_t t = 0; t < a.rows; ++t) {
    for (int64_t u = 0; u < a.cols / ep::kCombineUnit; ++u) {
      float acc[ep::kCombineUnit];
      if (a.quant == SYMCOMM_EP_FP8)
        ep::sum_unit<T, SYMCOMM_EP_FP8>(back, a.send_rows, a.weights, a.weights_dtype, t, u, a.cols, a.topk,
                                        slots_back, acc);
      else
        ep::sum_unit<T, SYMCOMM_EP_NONE>(back, a.send_rows, a.weights, a.weights_dtype, t, u, a.cols, a.topk,
                                         slots_back, acc);
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
      (args->quant != SYMCOMM_EP_NONE && bad_slot(c, args->scales_slot)))
    return cudaErrorInvalidValue;
  if (args->quant == SYMCOMM_EP_NONE) job.scales = job.recv;  // never written: any mapped slot
  return for_world(c->world, [&](auto w) {
    constexpr int W = decltype(w)::value;
    const cudaError_t loaded = preload<W>(c->device);
    if (loaded != cudaSuccess) return loaded;
    return args->ids_int64 ? launch_dispatch<W, int64_t>(c, job, args->quant, args->dtype, stream)
                           : launch_dispatch<W, int32_t>(c, job, args->quant, args->dtype, stream);
  });
}

int symcomm_ep_combine(symcomm_ar_t ctx, const symcomm_ep_combine_args_t* args, cudaStream_t stream) {
  if (args == nullptr) return cudaErrorInvalidValue;
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  Combine job;
  if (!combine_job(*args, &job) || bad_slot(c, args->returned_slot)) return cudaErrorInvalidValue;
  const Sync s = make_sync(c);
  // One grid returns the rows, then sums them: as many blocks as the larger half wants. Both
  // follow sizes equal on every rank (capacity, max_tokens, never this rank's rows), since block
  // b meets block b.
  const int64_t sums = args->max_tokens * (args->cols / ep::kCombineUnit);
  const int blocks = std::max(blocks_for_items(c, args->capacity * ((job.units + 31) / 32)),
                              blocks_for_items(c, (sums + 31) / 32));
  return for_world(c->world, [&](auto w) {
    constexpr int W = decltype(w)::value;
    const cudaError_t loaded = preload<W>(c->device);
    if (loaded != cudaSuccess) return loaded;
    return for_dtype(args->dtype, [&](auto type) {
      using T = typename decltype(type)::type;
      if (args->quant == SYMCOMM_EP_NONE)
        return launch(c->overlap, ep_combine<SYMCOMM_EP_NONE, T, W>, blocks, kThreads, stream, s, c->slots, job);
      if constexpr (std::is_same<T, float>::value) {
        return cudaErrorInvalidValue;  // combine_job refuses FP8 from fp32 rows
      } else {
        return launch(c->overlap, ep_combine<SYMCOMM_EP_FP8, T, W>, blocks, kThreads, stream, s, c->slots, job);
      }
    });
  });
}

int symcomm_ep_dispatch_host(int world, const symcomm_ep_dispatch_args_t* args, void* const* recv,
                             void* const* scales, int32_t* const* src, int32_t* const* table) {
  if (args == nullptr || recv == nullptr || src == nullptr || table == nullptr || world < 1 || world > kMaxRanks)
    return cudaErrorInvalidValue;
  std::vector<Dispatch> jobs(world);
  for (int r = 0; r < world; ++r) {
    if (!dispatch_job(args[r], world, &jobs[r]) || args[r].num_experts != args[0].num_experts)
      return cudaErrorInvalidValue;
    if (args[r].quant != SYMCOMM_EP_NONE && (scales == nullptr || scales[r] == nullptr)) return cudaErrorInvalidValue;
  }
  const int E = args[0].num_experts, L = E / world;
  for (int r = 0; r < world; ++r)  // the kernels stop ranks whose sizes differ; the twin refuses them
    if (ep::fingerprint(args[r].capacity, jobs[r].row_bytes, args[r].topk, args[r].align, args[r].max_tokens, E) !=
        ep::fingerprint(args[0].capacity, jobs[0].row_bytes, args[0].topk, args[0].align, args[0].max_tokens, E))
      return cudaErrorInvalidValue;
  // Counts and positions, entry by entry in token order; every rank's row into every table.
  for (int r = 0; r < world; ++r) {
    const symcomm_ep_dispatch_args_t& a = args[r];
    std::vector<int32_t> counts(E, 0);
    for (int64_t e = 0; e < a.rows * a.topk; ++e) {
      const int key = entry_key_host(a, e);
      a.send_rows[e] = key < 0 ? -1 : counts[key]++;
    }
    counts.push_back(ep::fingerprint(a.capacity, jobs[r].row_bytes, a.topk, a.align, a.max_tokens, E));
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
  // Every token into its entries' rows, with its origin.
  for (int r = 0; r < world; ++r) {
    const symcomm_ep_dispatch_args_t& a = args[r];
    for (int64_t t = 0; t < a.rows; ++t) {
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
  for (int r = 0; r < world; ++r)
    if (!combine_job(args[r], &jobs[r])) return cudaErrorInvalidValue;
  for (int p = 0; p < world; ++p) {
    const symcomm_ep_combine_args_t& a = args[p];
    int64_t used = a.expert_offsets[a.num_local];
    used = used < a.capacity ? used : a.capacity;
    for (int64_t r = 0; r < used; ++r) {
      const int32_t origin = a.recv_src[r];
      if (origin < 0) continue;
      const int64_t slots_back = a.max_tokens * a.topk;
      const int owner = int(origin / slots_back);
      if (owner >= world) return cudaErrorInvalidValue;
      for_dtype_host(a.dtype, [&](auto type) {
        using T = typename decltype(type)::type;
        return_row_host<T>(a, jobs[p], r, origin % slots_back, static_cast<char*>(returned[owner]));
      });
    }
  }
  for (int q = 0; q < world; ++q) {
    for_dtype_host(args[q].dtype, [&](auto type) {
      using T = typename decltype(type)::type;
      sum_rows_host<T>(args[q], static_cast<const char*>(returned[q]));
    });
  }
  return cudaSuccess;
}

}  // extern "C"
