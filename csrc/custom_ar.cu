// Custom all-reduce (sum) over peer-mapped GPU memory inside one NVLink domain.
//
// Four kernels, all summing in fp32 and in rank order 0..world-1, so every rank produces the
// same bits whatever the algorithm:
//   flag-free one-shot: each rank pushes its input into every peer's receive buffer; readers
//                       poll for a sentinel to disappear instead of meeting at a barrier.
//   one-shot:           barrier, every rank reads all peers' inputs and reduces, barrier.
//   two-shot:           barrier, rank r reduces chunk r into its scratch, barrier, every rank
//                       copies each chunk from its owner's scratch.
//   two-shot by stores: for an output in a symmetric pool region. Barrier, every rank stores
//                       chunk r of its input into rank r's memory, barrier, rank r sums chunk
//                       r and stores it into every rank's output, barrier.
//
// Peer memory is one cudaMalloc per rank, mapped by the others with CUDA IPC:
//   [Signal | staging | scratch | flag-free receive buffers x 3]
// Inputs of one-shot/two-shot are read from peers through a "slot": a device-resident table of
// the world's pointers. Slot 0 is the staging buffer (eager calls copy their input there);
// later slots hold buffers recorded during CUDA-graph capture, filled in after capture once
// their IPC handles have been exchanged, so a replay reads the captured tensors directly.
//
// Synchronisation: every barrier flag is written with st.release.sys and read with
// ld.acquire.sys, so the data a rank wrote before arriving is visible to a peer that saw it
// arrive. Flags carry a per-block 64-bit epoch that only ever increases, so no flag is ever
// reset and a late reader can never observe a reset. The epoch is 64-bit because a kernel may
// leave a flag array untouched for any number of calls (one-shot never writes `mid`, two-shot
// never writes `end`): a 32-bit wrap-safe comparison would read such a flag, 2^31 to 2^32
// epochs old, as "arrived" and let a barrier through early.
//
// Every wait is bounded by a timeout read from %globaltimer. On expiry the kernel gives up
// instead of trapping: a trap leaves the CUDA context of every waiting rank unusable, so one
// rank that compiles or checkpoints for longer than the bound would end the job. Giving up
// means: record why in the context's `aborted` word (device memory, first writer wins) and in
// its alarm word (mapped host memory, which the host reads before every call without any
// synchronisation), then return without waiting on peers again. Every later kernel of the
// context sees `aborted` in its prologue and returns at once, so graphs replayed after the
// failure finish too; their outputs are left unwritten. The host turns the alarm into
// CommTimeoutError on the next call and refuses every call after it.
//
// Plain C ABI, no libtorch: every entry point takes raw pointers and a cudaStream_t and
// returns a cudaError_t (csrc/symcomm.h declares them).
#include "peer.cuh"
#include "symcomm_testing.h"

#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace {
using namespace symcomm::ar;
using symcomm::launch;

// ------------------------------------------------------------------ kernels
template <typename T, int W>
__global__ void __launch_bounds__(kThreads) one_shot(Sync s, const Peers* in, size_t in_offset, uint4* out,
                                                     size_t nvec, uint4* copy_to) {
  constexpr int world = W;
  const uint64_t epoch = next_epoch(s);
  if (epoch == 0 || !slot_ready(s, in, world)) return;
  const uint4* src[kMaxRanks];
  for (int r = 0; r < world; ++r) src[r] = reinterpret_cast<const uint4*>(in->ptr[r] + in_offset);
  if (!barrier(s, kStart, world, epoch)) return;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  // kUnroll vectors per thread per pass, all loaded before any is stored: the compiler cannot
  // move a load above a store to `out` by itself, so one vector at a time kept only W loads in
  // flight per thread. World 2 only: 4 x 2 = 8 loads in flight, 59 registers and no spills
  // (ptxas -v); at world 4 the compiler spilled. Each element's sum is unchanged. Measured on
  // 2x H200 with the 64-block grid: 16 MiB 59.8 -> 58.3 us, 4 MiB 20.0 -> 19.8
  // (bench/results/2026-11-28_nvidia-h200-x4_w2_grid_unroll).
  constexpr int kUnroll = W == 2 ? 4 : 1;
  if constexpr (kUnroll > 1) {
    for (; i + (kUnroll - 1) * stride < nvec; i += kUnroll * stride) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = reduce_at<T, W>(src, i + u * stride);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) out[i + u * stride] = v[u];
    }
  }
  for (; i < nvec; i += stride) out[i] = reduce_at<T, W>(src, i);
  // Peers read this rank's input until they pass here; it must not be reused before then.
  if (!barrier(s, kEnd, world, epoch) || copy_to == nullptr) return;
  // In place on a pool input (symcomm_ar_oneshot_in_place, any size): `out` is scratch and
  // copy_to the input. Peer block b read exactly this block's indices of it (the same grid-stride on
  // every rank, whose grids are equal) and has passed the end barrier, so they may be overwritten
  // now. Each thread copies the vectors it wrote itself; a block that gave up writes nothing.
  // kCopyUnroll loads before any store, as above: a local copy needs about 4 MB in flight to
  // keep HBM busy (~5 TB/s x ~0.8 us), and one 16-byte load per thread of a 64-block grid
  // keeps 0.5 MB; eight keep 4. Measured in place at world 2 on H200, one load -> eight:
  // 64 MiB 278.84 -> 240.18 us, 256 MiB 1085.80 -> 938.37 (out of place 207.56 and 805.73;
  // bench/results/2026-11-30_nvidia-h200-x2_w2_verify_256f496).
  constexpr int kCopyUnroll = 8;
  size_t j = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; j + (kCopyUnroll - 1) * stride < nvec; j += kCopyUnroll * stride) {
    uint4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) v[u] = out[j + u * stride];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) copy_to[j + u * stride] = v[u];
  }
  for (; j < nvec; j += stride) copy_to[j] = out[j];
}

template <typename T, int W>
__global__ void __launch_bounds__(kThreads) two_shot(Sync s, Peers scratch, const Peers* in, size_t in_offset,
                                                     uint4* out, size_t nvec) {
  constexpr int world = W;
  const int rank = s.rank;
  const uint64_t epoch = next_epoch(s);
  if (epoch == 0 || !slot_ready(s, in, world)) return;
  const uint4* src[kMaxRanks];
  for (int r = 0; r < world; ++r) src[r] = reinterpret_cast<const uint4*>(in->ptr[r] + in_offset);
  const size_t chunk = (nvec + world - 1) / world;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!barrier(s, kStart, world, epoch)) return;
  // Reduce-scatter: this rank owns chunk `rank`. Both phases give block b the same offsets
  // within a chunk, so block b's barrier is the only one its data depends on.
  uint4* mine = reinterpret_cast<uint4*>(of_rank<W>(scratch.ptr, rank));
  const size_t lo = size_t(rank) * chunk;
  const size_t hi = lo + chunk < nvec ? lo + chunk : nvec;
  for (size_t i = lo + first; i < hi; i += stride) mine[i] = reduce_at<T, W>(src, i);
  // After this barrier every peer has finished reading our input (so `out` may alias it) and
  // every owner's chunk is in its scratch.
  if (!barrier(s, kMid, world, epoch)) return;
  // All-gather. Each thread loads the same offset of every owner's chunk before storing any:
  // W loads in flight per thread, where a load-then-store loop per owner kept one (the
  // compiler cannot move a load above a store to `out`, which may alias). Measured at world 4:
  // 4 MiB went from 33.1 to 28.3 us, 16 MiB from 102 to 91 us. Owners are staggered by rank so
  // the ranks don't all read one peer at once.
  const uint4* theirs[W];
  size_t base[W];
#pragma unroll
  for (int k = 0; k < W; ++k) {
    const int owner = (rank + k) % W;
    theirs[k] = reinterpret_cast<const uint4*>(of_rank<W>(scratch.ptr, owner));
    base[k] = size_t(owner) * chunk;
  }
  for (size_t j = first; j < chunk; j += stride) {
    uint4 v[W];
#pragma unroll
    for (int k = 0; k < W; ++k)
      if (base[k] + j < nvec) v[k] = theirs[k][base[k] + j];
#pragma unroll
    for (int k = 0; k < W; ++k)
      if (base[k] + j < nvec) out[base[k] + j] = v[k];
  }
  // No closing barrier: peers read our scratch until they finish, and we write it again only
  // after the next call's start barrier, which they reach only after finishing this call.
}

// Two-shot by stores: the same two phases with every NVLink transfer a remote store, for an
// output in a symmetric pool region mapped by all (`outs`, the output at out_offset on every
// rank). Remote stores move more of the link than remote loads: at world 2 on H200, the push
// all_gather reached 0.95 of a copy-engine peer copy where one-shot's loads reached 0.87
// (bench/results/2026-11-30_nvidia-h200-x2_w2_verify_256f496/grid_ab).
// - Reduce-scatter: rank q stores its input's chunk p into owner p's memory. The peer just
//   after p in rank order stores it into p's own output chunk, which nobody else writes before
//   p has summed it; the other W-2 peers store into areas of p's scratch. So at world 2 no
//   scratch is used and the size is unbounded.
// - After the middle barrier the owner sums its chunk in rank order (its own terms from `own`)
//   and stores the sum into its output and every peer's. A peer's chunk p of the output holds
//   nothing anyone still reads: contributions land only in their owner's chunk.
// - After the end barrier every peer's sums have landed here.
// In place (out == in), the host passes `own`, a copy of this rank's chunk taken before the
// launch, since a peer overwrites that chunk of the output (= input) in the first phase; every
// other chunk of the input is read in the first phase and overwritten by its owner only after
// the middle barrier. Block b handles the same offsets within a chunk in both phases on every
// rank, so block b's barriers are the only ones its data depends on. The start barrier: a peer
// still in its previous call may read its scratch or output, which we are about to store to.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads) two_shot_push(Sync s, Peers scratch, const Peers* outs, size_t out_offset,
                                                          const uint4* in, const uint4* own, uint4* out, size_t nvec) {
  const int rank = s.rank;
  const uint64_t epoch = next_epoch(s);
  if (epoch == 0 || !slot_ready(s, outs, W)) return;
  const size_t chunk = (nvec + W - 1) / W;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  // Where this rank's contribution to owner (rank + k) % W lands, k = 1..W-1: the owner's
  // output chunk for k == W-1 (this rank follows the owner), else scratch area W-2-k.
  uint4* dst[W];
  size_t at[W];
#pragma unroll
  for (int k = 1; k < W; ++k) {
    const int owner = (rank + k) % W;
    at[k] = size_t(owner) * chunk;
    dst[k] = k == W - 1 ? reinterpret_cast<uint4*>(outs->ptr[owner] + out_offset) + at[k]
                        : reinterpret_cast<uint4*>(of_rank<W>(scratch.ptr, owner)) + size_t(W - 2 - k) * chunk;
  }
  if (!barrier(s, kStart, W, epoch)) return;
  // kUnroll passes' loads before any store, as in one_shot: the compiler cannot move a load
  // above a store that may alias it, so one pass at a time kept one local load in flight per
  // thread and peer. World 2 only, where registers allow. Measured at world 2 on H200 with 64
  // blocks, one pass -> four: 256 MiB 815.5 -> 765.9 us, 64 MiB 208.2 -> 198.3, 16 MiB 55.2 ->
  // 54.7, with PyTorch's two-shot at 814.9 and 817.5 in the two calls
  // (bench/results/2026-11-30_nvidia-h200-x2_w2_twoshot_push, call1 and call2).
  constexpr int kUnroll = W == 2 ? 4 : 1;
  size_t j = first;
  for (; j + (kUnroll - 1) * stride < chunk; j += kUnroll * stride) {
    uint4 v[kUnroll][W];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int k = 1; k < W; ++k)
        if (at[k] + j + u * stride < nvec) v[u][k] = in[at[k] + j + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int k = 1; k < W; ++k)
        if (at[k] + j + u * stride < nvec) dst[k][j + u * stride] = v[u][k];
  }
  for (; j < chunk; j += stride) {
    uint4 v[W];
#pragma unroll
    for (int k = 1; k < W; ++k)
      if (at[k] + j < nvec) v[k] = in[at[k] + j];
#pragma unroll
    for (int k = 1; k < W; ++k)
      if (at[k] + j < nvec) dst[k][j] = v[k];
  }
  if (!barrier(s, kMid, W, epoch)) return;
  // Term r of this rank's chunk: its own from `own`, the follower's from the output chunk, the
  // rest from scratch area (r - rank + W) % W - 2, where peer r stored it.
  const size_t lo = size_t(rank) * chunk;
  const size_t mine = lo >= nvec ? 0 : lo + chunk < nvec ? chunk : nvec - lo;
  const uint4* term[W];
  uint4* to[W];
  to[0] = out + lo;
#pragma unroll
  for (int r = 0; r < W; ++r) {
    const int d = (r - rank + W) % W;
    term[r] = d == 0 ? own : d == 1 ? out + lo : reinterpret_cast<const uint4*>(of_rank<W>(scratch.ptr, rank)) + size_t(d - 2) * chunk;
    if (r > 0) to[r] = reinterpret_cast<uint4*>(outs->ptr[(rank + r) % W] + out_offset) + lo;  // peers from rank + 1 on
  }
  for (j = first; j + (kUnroll - 1) * stride < mine; j += kUnroll * stride) {
    uint4 v[kUnroll][W];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int r = 0; r < W; ++r) v[u][r] = term[r][j + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint4 sum = sum_in_rank_order<T, W>(v[u]);
#pragma unroll
      for (int r = 0; r < W; ++r) to[r][j + u * stride] = sum;
    }
  }
  for (; j < mine; j += stride) {
    uint4 v[W];
#pragma unroll
    for (int r = 0; r < W; ++r) v[r] = term[r][j];
    const uint4 sum = sum_in_rank_order<T, W>(v);
#pragma unroll
    for (int r = 0; r < W; ++r) to[r][j] = sum;
  }
  barrier(s, kEnd, W, epoch);
}

// Receive buffers rotate over three: call k writes buffer k%3 and clears buffer (k-1)%3.
// A peer writes buffer (k-1)%3 again only at its call k+2, which it can reach only after
// receiving our call k+1 data, sent after this clear finished; and nobody still writes it,
// since we consumed all of call k-1 before returning from it. Two buffers would not do: a
// peer that finished call k could start writing call k+1 into the buffer being cleared. Since
// nothing reads or writes buffer (k-1)%3 during call k, the clear comes between the sends and
// the receive: its stores drain while the peers' data is on its way, not after the output.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads) flag_free(Sync s, Peers recv, const uint4* in, uint4* out, size_t nvec,
                                                      size_t slot_vecs) {
  constexpr int world = W;
  const int rank = s.rank;
  __shared__ uint32_t buf, prev;
  __shared__ bool stopped;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const FlagFreeWords words = flagfree_begin(s);
  const uint4 first_in = first < nvec ? in[first] : uint4{};  // in the round trip of the turn's loads
  flagfree_end(s, words, nvec, &buf, &prev, &stopped);
  if (stopped) return;
  for (size_t i = first; i < nvec; i += stride) {
    const uint4 v = without_sentinel(i == first ? first_in : in[i]);
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      flagfree_slot<W>(recv, p, buf, rank, slot_vecs)[i] = v;
    }
  }
  flagfree_clear<W>(s, recv, slot_vecs, buf, prev);
  for (size_t i = first; i < nvec; i += stride) {
    uint4 v[W];
    if (!flagfree_receive<W>(s, recv, buf, slot_vecs, i, without_sentinel(i == first ? first_in : in[i]), v))
      return;
    out[i] = sum_in_rank_order<T, W>(v);
  }
}

// The flag-free all-gather and reduce-scatter are the all-reduce's protocol with other
// payloads: the same receive buffers, slot layout, turn (flagfree_begin/_end) and clear, so calls of
// all three may follow each other in any order. Each records as `prev` the most vectors any
// peer wrote into one of its slots (exact for the scatter, an upper bound for an uneven
// gather), which is what the clear two calls later resets, whichever kernel runs then.
//
// Both take every rank's chunk (Chunks), so the uneven all_gatherv / reduce_scatterv are the
// same kernels as the even collectives, whose chunks are equal. Each chunk is at most one
// receive slot (slot_vecs), and the counts are the same on every rank.
//
// The three-buffer rotation (see flag_free) holds only if every call carries data from every
// rank to every peer: a peer must not finish call k+1 before this rank has finished call k,
// whose clear it would otherwise race with its call k+2 writes. An empty chunk breaks that (a
// rank that sends nothing lets its peers run ahead), so a rank with no rows for a peer sends it
// one placeholder vector, which the peer waits for and drops (sent()).
struct Chunks {
  size_t count[kMaxRanks];  // rank r's chunk, in 16-byte vectors
  size_t start[kMaxRanks];  // where it starts: in the gathered output, or in the scattered input
};

// All-gather. A copy, so the sentinel rule costs exactness in one case only: a word of
// 0xFFFFFFFF arrives as kNotSentinel. The host serves only fp32/fp16/bf16 here, where that
// word is a NaN (both halves, for 16-bit types) and stays one; this rank's own chunk goes
// through the same swap so that every rank's output holds the same bits.
template <int W>
__global__ void __launch_bounds__(kThreads) flag_free_gather(Sync s, Peers recv, const uint4* in, uint4* out,
                                                             Chunks c, size_t slot_vecs) {
  const int rank = s.rank;
  size_t most = 0, received = 0;  // the longest send; the longest a peer writes into our slots
#pragma unroll
  for (int r = 0; r < W; ++r) {
    most = sent(c.count[r]) > most ? sent(c.count[r]) : most;
    if (r != rank) received = sent(c.count[r]) > received ? sent(c.count[r]) : received;
  }
  __shared__ uint32_t buf, prev;
  __shared__ bool stopped;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t mine = of_rank<W>(c.count, rank);
  const FlagFreeWords words = flagfree_begin(s);
  const uint4 first_in = first < mine ? in[first] : uint4{};  // in the round trip of the turn's loads
  flagfree_end(s, words, received, &buf, &prev, &stopped);
  if (stopped) return;
  for (size_t i = first; i < sent(mine); i += stride) {
    const uint4 v = i < mine ? without_sentinel(i == first ? first_in : in[i]) : uint4{};
#pragma unroll
    for (int p = 0; p < W; ++p)
      if (p != rank) flagfree_slot<W>(recv, p, buf, rank, slot_vecs)[i] = v;
  }
  flagfree_clear<W>(s, recv, slot_vecs, buf, prev);
  // In place (in == out + start[rank], the only overlap the host lets through), the thread
  // that stores out[start[rank] + i] is the one that loaded in[i], after loading it.
  for (size_t i = first; i < most; i += stride) {
    unsigned senders = 0;
#pragma unroll
    for (int r = 0; r < W; ++r)
      if (i < sent(c.count[r])) senders |= 1u << r;
    uint4 v[W];
    const uint4 own = i < mine ? without_sentinel(i == first ? first_in : in[i]) : uint4{};
    if (!flagfree_receive<W>(s, recv, buf, slot_vecs, i, own, v, senders)) return;
#pragma unroll
    for (int r = 0; r < W; ++r)
      if (i < c.count[r]) out[c.start[r] + i] = v[r];
  }
}

// Reduce-scatter (sum): rank r sends its input's chunk j to rank j's slot r, and rank j sums
// its W slots as flag_free sums vector start[rank] + i: same terms, same order, same rounding,
// so with equal chunks the output is bit for bit that all-reduce's chunk. In place (out == in +
// start[rank]), out[i] is written by the one thread that read in[start[rank] + i], after
// reading it, and no thread reads another's chunk-`rank` vector.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads) flag_free_scatter(Sync s, Peers recv, const uint4* in, uint4* out,
                                                              Chunks c, size_t slot_vecs) {
  const int rank = s.rank;
  size_t longest = 0;  // the longest send to a peer
#pragma unroll
  for (int p = 0; p < W; ++p)
    if (p != rank) longest = sent(c.count[p]) > longest ? sent(c.count[p]) : longest;
  __shared__ uint32_t buf, prev;
  __shared__ bool stopped;
  const size_t mine = of_rank<W>(c.count, rank), at = of_rank<W>(c.start, rank);
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  // The first pass's loads (every peer's chunk and this rank's own) in the round trip of the
  // turn's: W independent loads in flight per thread.
  const FlagFreeWords words = flagfree_begin(s);
  uint4 first_in[W];
#pragma unroll
  for (int p = 0; p < W; ++p) first_in[p] = first < c.count[p] ? in[c.start[p] + first] : uint4{};
  flagfree_end(s, words, sent(mine), &buf, &prev, &stopped);  // every peer sends us our chunk's length
  if (stopped) return;
  for (size_t i = first; i < longest; i += stride) {
    // Every chunk's load before any store: W-1 independent loads in flight per thread.
    uint4 v[W];
#pragma unroll
    for (int p = 0; p < W; ++p)
      if (p != rank) v[p] = i == first ? first_in[p] : i < c.count[p] ? in[c.start[p] + i] : uint4{};
#pragma unroll
    for (int p = 0; p < W; ++p)
      if (p != rank && i < sent(c.count[p])) flagfree_slot<W>(recv, p, buf, rank, slot_vecs)[i] = without_sentinel(v[p]);
  }
  flagfree_clear<W>(s, recv, slot_vecs, buf, prev);
  for (size_t i = first; i < sent(mine); i += stride) {
    uint4 v[W];
    uint4 own_in{};
#pragma unroll
    for (int p = 0; p < W; ++p)
      if (p == rank) own_in = first_in[p];  // a compile-time index: no local-memory copy
    const uint4 own = i < mine ? without_sentinel(i == first ? own_in : in[at + i]) : uint4{};
    if (!flagfree_receive<W>(s, recv, buf, slot_vecs, i, own, v)) return;
    if (i < mine) out[i] = sum_in_rank_order<T, W>(v);
  }
}

// P2P test: every rank writes a token into every rank's probe[rank] ...
__global__ void probe_write(Peers signals, int rank, int world, uint32_t token) {
  const int peer = threadIdx.x;
  if (peer < world) store_release(&reinterpret_cast<Signal*>(signals.ptr[peer])->probe[rank], token);
}

// ... then reads back what each peer wrote here, and what each peer wrote into its own copy.
__global__ void probe_read(Peers signals, int rank, int world, uint32_t* got) {
  const int peer = threadIdx.x;
  if (peer < world) {
    got[peer] = load_acquire(&reinterpret_cast<Signal*>(signals.ptr[rank])->probe[peer]);
    got[kMaxRanks + peer] = load_acquire(&reinterpret_cast<Signal*>(signals.ptr[peer])->probe[peer]);
  }
}

// Testing programmatic dependent launch: a predecessor that lets its dependents be scheduled
// at once, then writes its output only after delay_ns. A dependent that read before its
// griddepcontrol.wait would see the old bytes.
__global__ void late_copy(uint8_t* dst, const uint8_t* src, size_t nbytes, uint64_t delay_ns) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const uint64_t t0 = now_ns();
  while (now_ns() - t0 < delay_ns) {
  }
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < nbytes; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// Testing the other side: a programmatic dependent that never executes griddepcontrol.wait,
// as NCCL 2.28's symmetric kernels are (launch.cuh). It reads src as soon as it is scheduled.
__global__ void unwaiting_copy(uint8_t* dst, const uint8_t* src, size_t nbytes) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < nbytes; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

template <typename T, int W>
cudaError_t launch_world(Context* c, int algo, const uint4* in, int slot, size_t in_offset, uint4* out, size_t nvec,
                         cudaStream_t stream) {
  const Sync s = make_sync(c);
  switch (algo) {
    case kFlagFree:
      return launch(c->overlap, flag_free<T, W>, flagfree_grid(c, nvec), kThreads, stream, s, c->flagfree, in, out,
                    nvec, c->flagfree_bytes / 16);
    case kOneShot:
      return launch(c->overlap, one_shot<T, W>, blocks_for(c, nvec), kThreads, stream, s, c->slots + slot, in_offset,
                    out, nvec, static_cast<uint4*>(nullptr));
    case kTwoShot:
      return launch(c->overlap, two_shot<T, W>, blocks_for(c, (nvec + W - 1) / W), kThreads, stream, s, c->scratch,
                    c->slots + slot, in_offset, out, nvec);
    default:
      return cudaErrorInvalidValue;
  }
}

// Maps the allocation behind an IPC handle, or takes one more use of an existing mapping
// (CUDA refuses to open one handle twice in a process). Every successful call is paired with
// a drop_handle, or with symcomm_ar_destroy.
cudaError_t open_handle(Context* c, const std::string& key, char** mapped) {
  auto it = c->opened.find(key);
  if (it != c->opened.end()) {
    it->second.users += 1;
    *mapped = it->second.base;
    return cudaSuccess;
  }
  cudaIpcMemHandle_t h;
  std::memcpy(&h, key.data(), kHandleBytes);
  void* p = nullptr;
  cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) return err;
  c->opened[key] = {static_cast<char*>(p), 1};
  *mapped = static_cast<char*>(p);
  return cudaSuccess;
}

// Unmapping the last use matters beyond memory: a peer's allocator may free that buffer and
// hand the address to a new allocation, whose handle differs, so a mapping kept "just in
// case" only pins memory the peer no longer uses.
cudaError_t drop_handle(Context* c, const std::string& key) {
  auto it = c->opened.find(key);
  if (it == c->opened.end()) return cudaErrorInvalidValue;
  if (--it->second.users > 0) return cudaSuccess;
  cudaError_t err = cudaIpcCloseMemHandle(it->second.base);
  c->opened.erase(it);
  return err;
}

// Empties slot `slot`: drops its mappings and zeroes its device entry, so that a kernel that
// still reads it (a graph whose registration failed) finds null pointers and refuses them.
cudaError_t clear_slot(Context* c, int slot) {
  cudaError_t first = cudaSuccess;
  for (const std::string& key : c->slot_handles[slot]) {
    cudaError_t err = drop_handle(c, key);
    if (first == cudaSuccess) first = err;
  }
  c->slot_handles[slot].clear();
  cudaError_t err = cudaMemset(c->slots + slot, 0, sizeof(Peers));
  return first != cudaSuccess ? first : err;
}

// Driver entry points, looked up at run time so the library does not link libcuda (CI builds
// it on machines without a driver).
template <typename Fn>
cudaError_t driver_fn(const char* name, Fn* fn) {
  if (*fn != nullptr) return cudaSuccess;
  cudaDriverEntryPointQueryResult found;
  void* p = nullptr;
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found);
  if (err != cudaSuccess) return err;
  if (found != cudaDriverEntryPointSuccess || p == nullptr) return cudaErrorSymbolNotFound;
  *fn = reinterpret_cast<Fn>(p);
  return cudaSuccess;
}

struct Driver {
  PFN_cuMemRetainAllocationHandle_v11000 retain = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 export_handle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 import_handle = nullptr;
  PFN_cuMemAddressReserve_v10020 reserve = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
};

cudaError_t driver(Driver** out) {
  static Driver d;
  cudaError_t err;
  if ((err = driver_fn("cuMemRetainAllocationHandle", &d.retain)) != cudaSuccess ||
      (err = driver_fn("cuMemExportToShareableHandle", &d.export_handle)) != cudaSuccess ||
      (err = driver_fn("cuMemImportFromShareableHandle", &d.import_handle)) != cudaSuccess ||
      (err = driver_fn("cuMemAddressReserve", &d.reserve)) != cudaSuccess || (err = driver_fn("cuMemMap", &d.map)) != cudaSuccess ||
      (err = driver_fn("cuMemSetAccess", &d.set_access)) != cudaSuccess ||
      (err = driver_fn("cuMemRelease", &d.release)) != cudaSuccess || (err = driver_fn("cuMemUnmap", &d.unmap)) != cudaSuccess ||
      (err = driver_fn("cuMemAddressFree", &d.address_free)) != cudaSuccess)
    return err;
  *out = &d;
  return cudaSuccess;
}

// A driver failure as a runtime error code the Python side can name.
cudaError_t driver_error(CUresult r) { return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorUnknown; }

// The allocation that holds ptr: IPC handles name whole allocations, so a peer maps the base
// and adds the offset (cuMemGetAddressRange, a driver call: looked up like the others).
cudaError_t allocation_base(const void* ptr, uintptr_t* base) {
  static PFN_cuMemGetAddressRange_v3020 get_range = nullptr;
  const cudaError_t err = driver_fn("cuMemGetAddressRange", &get_range);
  if (err != cudaSuccess) return err;
  CUdeviceptr b = 0;
  size_t size = 0;
  if (get_range(&b, &size, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) return cudaErrorInvalidValue;
  *base = uintptr_t(b);
  return cudaSuccess;
}

}  // namespace

// launch.cuh's process-wide switch: whether kernels may signal their dependents early.
static std::atomic<bool> g_dependents_early{true};

namespace symcomm {
bool dependents_early() { return g_dependents_early.load(std::memory_order_relaxed); }
}  // namespace symcomm

extern "C" {

int symcomm_abi_version(void) { return SYMCOMM_ABI_VERSION; }

int symcomm_set_early_dependents(int enabled) {
  return int(g_dependents_early.exchange(enabled != 0));
}

// Allocates this rank's buffer (signals, staging, scratch, flag-free receive buffers) and the
// slot table. Not collective; symcomm_ar_open is.
int symcomm_ar_create(int rank, int world, int device, size_t staging_bytes, size_t flagfree_bytes, int max_slots,
                      double timeout_s, symcomm_ar_t* out) {
  if (world < 2 || world > kMaxRanks || world % 2 || rank < 0 || rank >= world || staging_bytes % 16 || flagfree_bytes % 16 ||
      max_slots < 1 || timeout_s <= 0)
    return cudaErrorInvalidValue;
  cudaError_t err = use_device(device);
  if (err != cudaSuccess) return err;
  symcomm_ar_t handle = new symcomm_ar_ctx();
  Context* c = &handle->impl;
  c->rank = rank, c->world = world, c->device = device;
  c->staging_bytes = staging_bytes, c->flagfree_bytes = flagfree_bytes, c->max_slots = max_slots;
  c->timeout_ns = uint64_t(timeout_s * 1e9);
  c->slot_handles.resize(size_t(max_slots));
  const size_t flagfree_total = 3 * size_t(world) * flagfree_bytes;
  c->total_bytes = kSignalBytes + 2 * staging_bytes + flagfree_total;
  void* p = nullptr;
  if ((err = cudaMalloc(&p, c->total_bytes)) != cudaSuccess) goto fail;
  c->base = static_cast<char*>(p);
  if ((err = cudaMemset(c->base, 0, kSignalBytes)) != cudaSuccess) goto fail;
  if ((err = cudaMemset(c->base + kSignalBytes + 2 * staging_bytes, 0xFF, flagfree_total)) != cudaSuccess) goto fail;
  if ((err = cudaMalloc(&p, sizeof(Peers) * size_t(max_slots))) != cudaSuccess) goto fail;
  c->slots = static_cast<Peers*>(p);
  if ((err = cudaMemset(c->slots, 0, sizeof(Peers) * size_t(max_slots))) != cudaSuccess) goto fail;
  if ((err = cudaHostAlloc(&p, sizeof(uint64_t), cudaHostAllocMapped)) != cudaSuccess) goto fail;
  c->alarm_host = static_cast<uint64_t*>(p);
  *c->alarm_host = 0;
  if ((err = cudaHostGetDevicePointer(&p, c->alarm_host, 0)) != cudaSuccess) goto fail;
  c->alarm_dev = static_cast<uint64_t*>(p);
  if ((err = cudaEventCreateWithFlags(&c->order, cudaEventDisableTiming)) != cudaSuccess) goto fail;
  if ((err = cudaDeviceSynchronize()) != cudaSuccess) goto fail;
  *out = handle;
  return cudaSuccess;
fail:
  if (c->base) cudaFree(c->base);
  if (c->slots) cudaFree(c->slots);
  if (c->alarm_host) cudaFreeHost(c->alarm_host);
  if (c->order) cudaEventDestroy(c->order);
  delete handle;
  return err;
}

int symcomm_ar_handle(symcomm_ar_t ctx, char* handle_out) {
  Context* c = &ctx->impl;
  cudaIpcMemHandle_t h;
  cudaError_t err = cudaIpcGetMemHandle(&h, c->base);
  if (err == cudaSuccess) std::memcpy(handle_out, &h, kHandleBytes);
  return err;
}

// Points c's peer tables and slot 0 at bases[r], rank r's allocation as addressable here.
// symcomm_ar_open passes IPC mappings, symcomm_ar_sim_link the other contexts' own pointers.
cudaError_t set_peer_tables(Context* c, char* const* bases) {
  for (int r = 0; r < c->world; ++r) {
    char* b = bases[r];
    c->bases.ptr[r] = b;
    c->signals.ptr[r] = b;
    c->scratch.ptr[r] = b + kSignalBytes + c->staging_bytes;
    c->flagfree.ptr[r] = b + kSignalBytes + 2 * c->staging_bytes;
  }
  Peers staging{};
  for (int r = 0; r < c->world; ++r) staging.ptr[r] = c->bases.ptr[r] + kSignalBytes;
  return cudaMemcpy(c->slots, &staging, sizeof(Peers), cudaMemcpyHostToDevice);
}

// handles: world x 64 bytes, every rank's symcomm_ar_handle in rank order.
int symcomm_ar_open(symcomm_ar_t ctx, const char* handles) {
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  char* bases[kMaxRanks] = {};
  for (int r = 0; r < c->world; ++r) {
    bases[r] = c->base;
    if (r != c->rank && (err = open_handle(c, std::string(handles + r * kHandleBytes, kHandleBytes), &bases[r])) != cudaSuccess)
      return err;
  }
  return set_peer_tables(c, bases);
}

// Testing only. In one process every context's cudaMalloc is directly addressable, so the
// peer tables take the other contexts' own pointers where symcomm_ar_open maps IPC handles.
// The grid cap is the point of the second half: every block spins on its peers' block of the
// same index, so all W ranks' blocks must be resident on the one GPU at once, or a spinning
// rank keeps another's blocks off the SMs until the bounded wait traps.
int symcomm_ar_sim_link(symcomm_ar_t* ctxs, int world, int max_blocks) {
  if (ctxs == nullptr || world < 2 || world > kMaxRanks || max_blocks < 1) return cudaErrorInvalidValue;
  char* bases[kMaxRanks] = {};
  for (int r = 0; r < world; ++r) {
    const Context* c = &ctxs[r]->impl;
    // Same world, rank r at index r, same buffer sizes and device: the offsets computed in
    // set_peer_tables assume every rank's allocation has this context's layout.
    if (c->world != world || c->rank != r || c->device != ctxs[0]->impl.device ||
        c->staging_bytes != ctxs[0]->impl.staging_bytes || c->flagfree_bytes != ctxs[0]->impl.flagfree_bytes)
      return cudaErrorInvalidValue;
    bases[r] = c->base;
  }
  cudaError_t err = use_device(ctxs[0]->impl.device);
  if (err != cudaSuccess) return err;
  for (int r = 0; r < world; ++r) {
    Context* c = &ctxs[r]->impl;
    // Only ever lowered: the constants are the kernels' barrier-slot limit (kMaxBlocks).
    c->grid_blocks = max_blocks < kGridBlocks ? max_blocks : kGridBlocks;
    c->wide_blocks = max_blocks < kWideGridBlocks ? max_blocks : kWideGridBlocks;
    // The narrow flag-free grid takes a quarter of the cap where it can, so that simulated ranks
    // run all three grids (flagfree_grid) and the bookkeeping that keeps them alike (flagfree_end).
    c->flagfree_blocks = std::max(1, std::min(kFlagFreeBlocks, max_blocks / 4));
    c->flagfree_max_blocks = std::min(kFlagFreeRecords, max_blocks);
    if ((err = set_peer_tables(c, bases)) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// Testing only. Sets every block's barrier epoch (Signal::epoch, local to this rank) to `epoch`,
// so a test reaches epochs like 2^31 or 2^32 without making that many calls. Block b meets
// block b of every peer at the same epoch, so every rank of the world must be seeded with the
// same value, and no kernel may be in flight on any rank (a running kernel would mix old and
// new epochs). Epochs may only move forward: the flags already written hold earlier epochs,
// and seeding below them would make those flags read as arrivals of calls not yet made, so a
// value below any block's current epoch is refused.
int symcomm_ar_debug_seed_epochs(symcomm_ar_t ctx, uint64_t epoch) {
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  uint64_t* dev = reinterpret_cast<Signal*>(c->base)->epoch;
  uint64_t cur[kMaxBlocks];
  if ((err = cudaMemcpy(cur, dev, sizeof(cur), cudaMemcpyDeviceToHost)) != cudaSuccess) return err;
  for (int b = 0; b < kMaxBlocks; ++b) {
    if (epoch < cur[b]) return cudaErrorInvalidValue;
    cur[b] = epoch;
  }
  return cudaMemcpy(dev, cur, sizeof(cur), cudaMemcpyHostToDevice);
}

// Testing only: how many meetings of every block (meet_all_blocks) this rank has completed, read
// from its Signal block. Tests use it to see that a kernel took the path that meets.
int symcomm_ar_debug_meetings(symcomm_ar_t ctx, uint64_t* meetings) {
  if (meetings == nullptr) return cudaErrorInvalidValue;
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  return cudaMemcpy(meetings, &reinterpret_cast<Signal*>(c->base)->meetings, sizeof(uint64_t),
                    cudaMemcpyDeviceToHost);
}

int symcomm_ar_set_overlap(symcomm_ar_t ctx, int enabled) {
  ctx->impl.overlap = enabled != 0;
  return cudaSuccess;
}

int symcomm_debug_late_copy(void* dst, const void* src, uint64_t nbytes, uint64_t delay_ns, cudaStream_t stream) {
  late_copy<<<4, 256, 0, stream>>>(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), nbytes, delay_ns);
  return cudaGetLastError();
}

int symcomm_debug_unwaiting_copy(void* dst, const void* src, uint64_t nbytes, cudaStream_t stream) {
  return launch(true, unwaiting_copy, 8, 256, stream, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src),
                size_t(nbytes));
}

int symcomm_ar_probe_write(symcomm_ar_t ctx, uint32_t token) {
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  probe_write<<<1, 32>>>(c->signals, c->rank, c->world, token);
  err = cudaGetLastError();
  return err != cudaSuccess ? err : cudaDeviceSynchronize();
}

// got: 2 x 8 words: [what peer p wrote here] then [what peer p wrote into its own probe].
int symcomm_ar_probe_read(symcomm_ar_t ctx, uint32_t* got) {
  Context* c = &ctx->impl;
  uint32_t* d = nullptr;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  err = cudaMalloc(&d, 2 * kMaxRanks * sizeof(uint32_t));
  if (err != cudaSuccess) return err;
  probe_read<<<1, 32>>>(c->signals, c->rank, c->world, d);
  if ((err = cudaGetLastError()) == cudaSuccess)
    err = cudaMemcpy(got, d, 2 * kMaxRanks * sizeof(uint32_t), cudaMemcpyDeviceToHost);
  cudaFree(d);
  return err;
}

// The IPC handle of the allocation holding ptr, and ptr's offset in it (for graph buffers).
int symcomm_ar_buffer_handle(symcomm_ar_t ctx, const void* ptr, char* handle_out, uint64_t* offset_out) {
  cudaError_t err = use_device(ctx->impl.device);  // not device 0's context
  if (err != cudaSuccess) return err;
  uintptr_t base = 0;
  err = allocation_base(ptr, &base);
  if (err != cudaSuccess) return err;
  cudaIpcMemHandle_t h;
  if ((err = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base))) != cudaSuccess) return err;
  std::memcpy(handle_out, &h, kHandleBytes);
  *offset_out = uint64_t(reinterpret_cast<uintptr_t>(ptr) - base);
  return cudaSuccess;
}

// Fills slot `slot` with every rank's pointer to one buffer: peers' from their handles and
// offsets, this rank's own as given.
int symcomm_ar_set_slot(symcomm_ar_t ctx, int slot, const char* handles, const uint64_t* offsets,
                        const void* own) {
  Context* c = &ctx->impl;
  if (slot < 1 || slot >= c->max_slots) return cudaErrorInvalidValue;
  cudaError_t err = use_device(c->device);  // IPC handles open on the current device
  if (err != cudaSuccess || (err = clear_slot(c, slot)) != cudaSuccess) return err;
  Peers p{};
  for (int r = 0; r < c->world; ++r) {
    if (r == c->rank) {
      p.ptr[r] = static_cast<char*>(const_cast<void*>(own));
      continue;
    }
    std::string key(handles + r * kHandleBytes, kHandleBytes);
    char* b = nullptr;
    if ((err = open_handle(c, key, &b)) != cudaSuccess) break;
    c->slot_handles[slot].push_back(key);
    p.ptr[r] = b + offsets[r];
  }
  // All or nothing: a slot half filled would send a replay to the peers it does name.
  if (err != cudaSuccess || (err = cudaMemcpy(c->slots + slot, &p, sizeof(Peers), cudaMemcpyHostToDevice)) != cudaSuccess) {
    clear_slot(c, slot);
    return err;
  }
  return cudaSuccess;
}

int symcomm_ar_release_slot(symcomm_ar_t ctx, int slot) {
  Context* c = &ctx->impl;
  if (slot < 1 || slot >= c->max_slots) return cudaErrorInvalidValue;
  cudaError_t err = use_device(c->device);
  return err != cudaSuccess ? err : clear_slot(c, slot);
}

int symcomm_ar_guard_capture(symcomm_ar_t ctx, symcomm_stream_t stream, uint64_t* token_out) {
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  cudaStreamCaptureStatus status;
  cudaGraph_t graph = nullptr;
  if ((err = cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph)) != cudaSuccess) return err;
  if (status != cudaStreamCaptureStatusActive || graph == nullptr) return cudaErrorStreamCaptureInvalidated;
  // The token is spent even if the retain below fails: its destructor then reports it at once,
  // and a later graph must not get the same token (its slots would be released with it).
  const uint64_t token = c->next_token++;
  Guard* guard = new Guard{c->released, token};
  cudaUserObject_t object;
  if ((err = cudaUserObjectCreate(&object, guard, graph_gone, 1, cudaUserObjectNoDestructorSync)) != cudaSuccess) {
    delete guard;
    return err;
  }
  // Moves our one reference into the graph: from here on the graph (and every instance of
  // it) owns the guard, and CUDA calls graph_gone once the last of them is destroyed.
  if ((err = cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove)) != cudaSuccess) {
    cudaUserObjectRelease(object, 1);  // runs graph_gone, which frees the guard
    return err;
  }
  *token_out = token;
  return cudaSuccess;
}

int symcomm_ar_take_released(symcomm_ar_t ctx, uint64_t* tokens, int capacity, int* count_out) {
  Context* c = &ctx->impl;
  if (capacity < 0) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(c->released->mutex);
  std::vector<uint64_t>& gone = c->released->tokens;
  const size_t n = gone.size() < size_t(capacity) ? gone.size() : size_t(capacity);
  std::copy(gone.begin(), gone.begin() + n, tokens);
  gone.erase(gone.begin(), gone.begin() + n);
  *count_out = int(n);
  return cudaSuccess;
}

int symcomm_ar_order_streams(symcomm_ar_t ctx, symcomm_stream_t before, symcomm_stream_t after) {
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess || (err = cudaEventRecord(c->order, before)) != cudaSuccess) return err;
  return cudaStreamWaitEvent(after, c->order, 0);
}

int symcomm_ar_alarm(symcomm_ar_t ctx, const uint64_t** word_out) {
  *word_out = ctx->impl.alarm_host;
  return cudaSuccess;
}

int symcomm_ar_retire(symcomm_ar_t ctx) {
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  const uint64_t closed = abort_code(SYMCOMM_AR_ABORT_CLOSED, 0, 0);
  if ((err = cudaMemcpy(&reinterpret_cast<Signal*>(c->base)->aborted, &closed, sizeof(closed),
                        cudaMemcpyHostToDevice)) != cudaSuccess)
    return err;
  delete ctx;  // host bookkeeping only: the device memory and mappings stay, on purpose
  return cudaSuccess;
}

// A POSIX file descriptor for the cuMem allocation at base (symmetric-pool regions come from
// ncclMemAlloc, which is cuMem memory: CUDA IPC handles do not cover it). The caller passes it
// to peers over a Unix socket and closes it.
int symcomm_ar_export_region(symcomm_ar_t ctx, const void* base, int* fd_out) {
  Driver* d = nullptr;
  cudaError_t err = use_device(ctx->impl.device);
  if (err == cudaSuccess) err = driver(&d);
  if (err != cudaSuccess) return err;
  CUmemGenericAllocationHandle h;
  if ((err = driver_error(d->retain(&h, const_cast<void*>(base)))) != cudaSuccess) return err;
  int fd = -1;
  err = driver_error(d->export_handle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  d->release(h);  // the retain above took a reference; the allocation itself lives on
  if (err == cudaSuccess) *fd_out = fd;
  return err;
}

// Maps a peer's exported region (fd from symcomm_ar_export_region, received over a socket)
// into this process, readable and writable from this rank's device.
int symcomm_ar_import_region(symcomm_ar_t ctx, int fd, size_t size, void** mapped_out) {
  Context* c = &ctx->impl;
  Driver* d = nullptr;
  cudaError_t err = use_device(c->device);  // the driver calls below act on the current context
  if (err == cudaSuccess) err = driver(&d);
  if (err != cudaSuccess) return err;
  CUmemGenericAllocationHandle h;
  err = driver_error(d->import_handle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  if (err != cudaSuccess) return err;
  CUdeviceptr va = 0;
  err = driver_error(d->reserve(&va, size, 0, 0, 0));
  if (err == cudaSuccess) {
    err = driver_error(d->map(va, size, 0, h, 0));
    if (err == cudaSuccess) {
      CUmemAccessDesc access = {};
      access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      access.location.id = c->device;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      err = driver_error(d->set_access(va, size, &access, 1));
      if (err != cudaSuccess) d->unmap(va, size);
    }
    if (err != cudaSuccess) d->address_free(va, size);
  }
  d->release(h);  // the mapping keeps the memory alive until unmapped
  if (err != cudaSuccess) return err;
  c->imported[reinterpret_cast<char*>(va)] = size;
  *mapped_out = reinterpret_cast<void*>(va);
  return cudaSuccess;
}

// Fills slot `slot` with the world's pointers to one buffer, given directly (pool regions).
int symcomm_ar_set_slot_ptrs(symcomm_ar_t ctx, int slot, const uint64_t* ptrs) {
  Context* c = &ctx->impl;
  if (slot < 1 || slot >= c->max_slots) return cudaErrorInvalidValue;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  Peers p{};
  for (int r = 0; r < c->world; ++r) p.ptr[r] = reinterpret_cast<char*>(ptrs[r]);
  return cudaMemcpy(c->slots + slot, &p, sizeof(Peers), cudaMemcpyHostToDevice);
}

// One all-reduce (sum) of nbytes (a multiple of 16). stage != 0 copies `in` into the staging
// buffer first and reads peers' staging (slot 0); otherwise one-shot/two-shot read slot `slot`
// at in_offset, and flag-free reads `in` directly.
int symcomm_ar_run(symcomm_ar_t ctx, symcomm_ar_algo_t algo, symcomm_dtype_t dtype, const void* in, int slot,
                   uint64_t in_offset, void* out, uint64_t nbytes, int stage, cudaStream_t stream) {
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  if (nbytes % 16 || slot < 0 || slot >= c->max_slots) return cudaErrorInvalidValue;
  // One-shot reads an unstaged input through its own slot (a mapped pool region or a captured
  // buffer), so only staged inputs are bounded by the staging buffer; two-shot's reduced chunks
  // pass through the scratch buffer, of the same size, whatever the input.
  const bool read_in_place = algo == kOneShot && !stage && slot != 0;
  if (algo == kFlagFree ? nbytes > c->flagfree_bytes : nbytes > c->staging_bytes && !read_in_place)
    return cudaErrorInvalidValue;
  if (nbytes == 0) return cudaSuccess;
  if (stage && algo != kFlagFree && (err = stage_input(c, in, nbytes, &slot, &in_offset, stream)) != cudaSuccess)
    return err;
  const uint4* src = static_cast<const uint4*>(in);
  uint4* dst = static_cast<uint4*>(out);
  const size_t nvec = nbytes / 16;
  return for_dtype(dtype, [&](auto t) {
    return for_world(c->world, [&](auto w) {
      return launch_world<typename decltype(t)::type, decltype(w)::value>(c, algo, src, slot, in_offset, dst, nvec,
                                                                          stream);
    });
  });
}

int symcomm_ar_oneshot_in_place(symcomm_ar_t ctx, symcomm_dtype_t dtype, int slot, uint64_t in_offset, void* scratch,
                                void* inout, uint64_t nbytes, cudaStream_t stream) {
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  // Slot 0 is the staging buffer, which holds no input here; a pool region's slot, or a captured
  // input's own, is read where the input lies.
  if (nbytes % 16 || slot <= 0 || slot >= c->max_slots || ((reinterpret_cast<uintptr_t>(scratch) |
      reinterpret_cast<uintptr_t>(inout)) & 15))
    return cudaErrorInvalidValue;
  if (nbytes == 0) return cudaSuccess;
  const size_t nvec = nbytes / 16;
  const Sync s = make_sync(c);
  return for_dtype(dtype, [&](auto t) {
    return for_world(c->world, [&](auto w) {
      return launch(c->overlap, one_shot<typename decltype(t)::type, decltype(w)::value>, blocks_for(c, nvec), kThreads,
                    stream, s, c->slots + slot, size_t(in_offset), static_cast<uint4*>(scratch), nvec,
                    static_cast<uint4*>(inout));
    });
  });
}

int symcomm_ar_twoshot_push(symcomm_ar_t ctx, symcomm_dtype_t dtype, const void* in, const void* own, int out_slot,
                            uint64_t out_offset, void* out, uint64_t nbytes, cudaStream_t stream) {
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  if (nbytes % 16 || out_offset % 16 || out_slot <= 0 || out_slot >= c->max_slots ||
      ((reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(own) | reinterpret_cast<uintptr_t>(out)) & 15))
    return cudaErrorInvalidValue;
  const size_t nvec = nbytes / 16;
  const size_t chunk = (nvec + c->world - 1) / c->world;
  if (size_t(c->world - 2) * chunk * 16 > c->staging_bytes) return cudaErrorInvalidValue;  // scratch's size
  if (nbytes == 0) return cudaSuccess;
  const Sync s = make_sync(c);
  return for_dtype(dtype, [&](auto t) {
    return for_world(c->world, [&](auto w) {
      return launch(c->overlap, two_shot_push<typename decltype(t)::type, decltype(w)::value>, push_blocks_for(c, chunk),
                    kThreads, stream, s, c->scratch, c->slots + out_slot, size_t(out_offset),
                    static_cast<const uint4*>(in), static_cast<const uint4*>(own), static_cast<uint4*>(out), nvec);
    });
  });
}

// Both flag-free collectives check what symcomm_ar_run checks of the flag-free all-reduce:
// whole vectors, at most one receive slot per chunk, and a dtype whose 0xFFFFFFFF word is a
// NaN, so that no real value collides with the sentinel. Fills `c` from chunk_bytes (one entry
// per rank, equal on every rank) and sets *total to their sum. A total of 0 launches nothing
// on any rank, so no turn is taken.
static cudaError_t flagfree_args(const Context* c, symcomm_dtype_t dtype, const void* in, const void* out,
                                 const uint64_t* chunk_bytes, Chunks* chunks, uint64_t* total) {
  if (chunk_bytes == nullptr || (reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(out)) & 15)
    return cudaErrorInvalidValue;
  if (dtype != SYMCOMM_FLOAT32 && dtype != SYMCOMM_FLOAT16 && dtype != SYMCOMM_BFLOAT16) return cudaErrorInvalidValue;
  *chunks = Chunks{};
  *total = 0;
  for (int r = 0; r < c->world; ++r) {
    if (chunk_bytes[r] % 16 || chunk_bytes[r] > c->flagfree_bytes) return cudaErrorInvalidValue;
    chunks->count[r] = chunk_bytes[r] / 16;
    chunks->start[r] = *total / 16;
    *total += chunk_bytes[r];
  }
  return cudaSuccess;
}

// The most vectors any rank sends one peer: the longest chunk, the same on every rank.
static size_t longest_chunk(const Context* c, const Chunks& chunks) {
  size_t most = 0;
  for (int r = 0; r < c->world; ++r) most = std::max(most, chunks.count[r]);
  return most;
}

int symcomm_ar_flagfree_all_gatherv(symcomm_ar_t ctx, symcomm_dtype_t dtype, const void* in, void* out,
                                    const uint64_t* chunk_bytes, cudaStream_t stream) {
  Context* c = &ctx->impl;
  Chunks chunks;
  uint64_t total;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess || (err = flagfree_args(c, dtype, in, out, chunk_bytes, &chunks, &total)) != cudaSuccess)
    return err;
  if (total == 0) return cudaSuccess;
  const Sync s = make_sync(c);
  return for_world(c->world, [&](auto w) {
    return launch(c->overlap, flag_free_gather<decltype(w)::value>, flagfree_grid(c, longest_chunk(c, chunks)),
                  kThreads, stream, s, c->flagfree, static_cast<const uint4*>(in), static_cast<uint4*>(out), chunks,
                  c->flagfree_bytes / 16);
  });
}

int symcomm_ar_flagfree_reduce_scatterv(symcomm_ar_t ctx, symcomm_dtype_t dtype, const void* in, void* out,
                                        const uint64_t* chunk_bytes, cudaStream_t stream) {
  Context* c = &ctx->impl;
  Chunks chunks;
  uint64_t total;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess || (err = flagfree_args(c, dtype, in, out, chunk_bytes, &chunks, &total)) != cudaSuccess)
    return err;
  if (total == 0) return cudaSuccess;
  const Sync s = make_sync(c);
  return for_dtype(dtype, [&](auto t) {
    return for_world(c->world, [&](auto w) {
      return launch(c->overlap, flag_free_scatter<typename decltype(t)::type, decltype(w)::value>,
                    flagfree_grid(c, longest_chunk(c, chunks)), kThreads, stream, s, c->flagfree,
                    static_cast<const uint4*>(in), static_cast<uint4*>(out), chunks, c->flagfree_bytes / 16);
    });
  });
}

int symcomm_ar_reduce_scatterv(symcomm_ar_t ctx, symcomm_dtype_t dtype, const void* in, int slot, uint64_t in_offset,
                               uint64_t total_bytes, uint64_t row_offset, void* out, uint64_t nbytes, int stage,
                               cudaStream_t stream) {
  Context* c = &ctx->impl;
  cudaError_t err = use_device(c->device);
  if (err != cudaSuccess) return err;
  if ((total_bytes | row_offset | nbytes) % 16 || row_offset + nbytes > total_bytes || slot < 0 ||
      slot >= c->max_slots || (stage && total_bytes > c->staging_bytes))
    return cudaErrorInvalidValue;
  if (stage && (err = stage_input(c, in, total_bytes, &slot, &in_offset, stream)) != cudaSuccess) return err;
  // One-shot over this rank's rows: every peer's input holds them at the same offset. A rank
  // with no rows still launches (nvec 0) and meets its peers at both barriers. The grid follows
  // the total, equal on every rank, never this rank's share.
  const int blocks = blocks_for(c, total_bytes / 16 / size_t(c->world));
  const Sync s = make_sync(c);
  uint4* dst = static_cast<uint4*>(out);
  return for_dtype(dtype, [&](auto t) {
    return for_world(c->world, [&](auto w) {
      return launch(c->overlap, one_shot<typename decltype(t)::type, decltype(w)::value>, blocks, kThreads, stream, s,
                    c->slots + slot, in_offset + row_offset, dst, nbytes / 16, static_cast<uint4*>(nullptr));
    });
  });
}

// Unmaps peers and frees this rank's memory. The caller makes sure no kernel still runs
// (peers included: they read this rank's buffer) before calling it.
int symcomm_ar_destroy(symcomm_ar_t ctx) {
  Context* c = &ctx->impl;
  cudaError_t first = use_device(c->device);
  for (auto& kv : c->opened) {
    cudaError_t err = cudaIpcCloseMemHandle(kv.second.base);
    if (first == cudaSuccess) first = err;
  }
  Driver* d = nullptr;
  if (!c->imported.empty() && driver(&d) == cudaSuccess) {
    for (auto& kv : c->imported) {
      const CUdeviceptr va = reinterpret_cast<CUdeviceptr>(kv.first);
      cudaError_t err = driver_error(d->unmap(va, kv.second));
      if (err == cudaSuccess) err = driver_error(d->address_free(va, kv.second));
      if (first == cudaSuccess) first = err;
    }
  }
  if (c->slots) cudaFree(c->slots);
  if (c->alarm_host) cudaFreeHost(c->alarm_host);
  if (c->order) cudaEventDestroy(c->order);
  if (c->base) {
    cudaError_t err = cudaFree(c->base);
    if (first == cudaSuccess) first = err;
  }
  delete ctx;
  return first;
}

// The library's only error-string function: symcomm.h's status codes are cudaError_t values
// plus a few negative ones of symcomm's own.
const char* symcomm_cuda_error_string(int code) {
  if (code == SYMCOMM_ERROR_INVALID_REGION) return "unknown pool, or an empty or unaligned region";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"
