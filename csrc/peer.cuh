// The machinery every peer-memory kernel shares (csrc/custom_ar.cu's all-reduce and
// reduce-scatter, csrc/peer_gather.cu's gathers, csrc/ep.cu's MoE dispatch and combine): the
// per-rank Signal block of barrier flags, the bounded waits that give up instead of trapping,
// the per-block epochs, the slot tables of peer addresses, the fp32 lanes the sums run in, and
// the host-side Context of one rank. custom_ar.cu's opening comment explains the memory
// ordering and the failure model; every kernel that meets peers must use barrier() and
// next_epoch() (or its halves, begin_epoch and end_epoch) from here so that all kernels of a
// context share one epoch sequence.
#ifndef SYMCOMM_PEER_CUH_
#define SYMCOMM_PEER_CUH_

#include "launch.cuh"
#include "symcomm.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

namespace symcomm {
namespace ar {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 128;  // barrier slots per rank: the widest grid (kWideGridBlocks)
constexpr int kThreads = 512;
// Grid cap of the barrier kernels (one-shot, two-shot, the push gathers, MoE dispatch/combine;
// H100 and H200 have 132 SMs). Every block spins on peers in barriers, so all of them must be
// resident at once: 64 blocks of 512 threads fit beside other work (MoE dispatch's 1024-thread
// blocks at prefill sizes take a whole SM's registers each, 64 of 132 SMs). At world 2 on H200, 64
// blocks against 36 took the one-shot all-reduce from 68.8 to 59.8 us at 16 MiB and the
// one-shot reduce-scatter from 154 to 112 us at 64 MiB
// (bench/results/2026-11-28_nvidia-h200-x4_w2_grid_unroll). kMaxBlocks bounds it.
constexpr int kGridBlocks = 64;
// The flag-free kernels' grids: N, 2N or 4N blocks, which flagfree_grid picks per call (the NVFP4
// gather's fp4_launch by its own rule, csrc/peer_gather.cu). Their
// data streams through the SMs that store it, so the narrow grid saves a little at small sizes
// and wider ones gain much past them: at world 2 on H200, all_gather at 4 MiB 15.14 -> 10.95 us
// and all_reduce at 2 MiB 13.79 -> 10.55 going from 32 to 64 blocks, while 1-64 KiB calls took
// about 0.1 us longer (-0.04 to +0.23; bench/results/2026-11-30_nvidia-h200-x2_w2_flagfree_grid).
// Each block keeps its own record of the live receive buffer and of what to clear; flagfree_end
// says how grids of any width keep those records alike.
constexpr int kFlagFreeBlocks = 32;
// One record per block of the widest grid.
constexpr int kFlagFreeRecords = 4 * kFlagFreeBlocks;
// These are the defaults of a context's grid_blocks / flagfree_blocks / flagfree_max_blocks;
// only symcomm_ar_sim_link lowers them (simulated ranks share one GPU, so each rank gets fewer
// SMs). Every rank of one world must use the same caps: block b meets block b.
// The push kernels' wide grid (two_shot_push, gather_push), for calls in which each rank sends
// at least kWideFromBytes to a peer: their remote stores drain faster issued from more SMs. At
// world 2 on H200, 128 blocks against 64 (bench/results/2026-11-30_nvidia-h200-x2_w2_twoshot_push):
// all_gather 256 MiB 401.6 -> 381.6 us, 64 MiB 107.1 -> 101.2, 16 MiB level at 30.2; the
// two-shot all-reduce by stores 256 MiB 766.4 -> 747.6, 64 MiB 198.4 -> 193.1, 16 MiB 54.8 ->
// 54.1, but 4 MiB 20.6 -> 21.4. Every block must be resident at once (they meet at barriers):
// at world 2 both kernels take at most 52 registers a thread, two blocks to an SM, so 128
// blocks need 64 SMs' worth; at world 8 two_shot_push<float> takes 70 (one block to an SM,
// 128 of 132 SMs), one more reason it is served at world 2 only until measured there.
constexpr int kWideGridBlocks = 128;
constexpr size_t kWideFromBytes = size_t(8) << 20;
static_assert(kGridBlocks <= kMaxBlocks && kWideGridBlocks <= kMaxBlocks, "one barrier slot per block");
constexpr int kHandleBytes = sizeof(cudaIpcMemHandle_t);
static_assert(kHandleBytes == SYMCOMM_AR_HANDLE_BYTES, "symcomm.h's handle size");
// A receive-buffer word that no peer has written yet. Compared as bits, never as floats. As a
// float it is a NaN (fp32, and both halves as fp16/bf16), so real data only meets it as a NaN,
// which the writer swaps for another NaN (kNotSentinel) before sending.
constexpr uint32_t kSentinel = 0xFFFFFFFFu;
constexpr uint32_t kNotSentinel = 0x7FFF7FFFu;

// What a flag-free writer sends for v: its words, with every sentinel word swapped for another NaN.
__device__ __forceinline__ uint4 without_sentinel(uint4 v) {
  v.x = v.x == kSentinel ? kNotSentinel : v.x;
  v.y = v.y == kSentinel ? kNotSentinel : v.y;
  v.z = v.z == kSentinel ? kNotSentinel : v.z;
  v.w = v.w == kSentinel ? kNotSentinel : v.w;
  return v;
}

// Whether a received vector is still (partly) unwritten.
__device__ __forceinline__ bool has_sentinel(const uint4& v) {
  return v.x == kSentinel || v.y == kSentinel || v.z == kSentinel || v.w == kSentinel;
}

constexpr int kFlagFree = SYMCOMM_AR_FLAGFREE, kOneShot = SYMCOMM_AR_ONESHOT, kTwoShot = SYMCOMM_AR_TWOSHOT;

// Barrier flags and epochs are uint64_t (see "Synchronisation" above): a flag holds the epoch
// of the last barrier of its kind this peer's block reached, 0 if none yet.
struct Signal {
  uint64_t start[kMaxBlocks][kMaxRanks];  // start[b][p]: peer p's block b arrived
  uint64_t mid[kMaxBlocks][kMaxRanks];
  uint64_t end[kMaxBlocks][kMaxRanks];
  uint64_t met[kMaxBlocks][kMaxRanks];  // met[b][p]: peer p's block b reached meet_all_blocks (number, mark)
  uint64_t epoch[kMaxBlocks];          // barrier epoch of this rank's block b (local only)
  uint64_t meetings;                   // meet_all_blocks' count of completed meetings (local only)
  uint64_t aborted;                    // 0, or why this rank gave up (abort_code); local only
  // Record b (every launch advances all of them alike: flagfree_end), read by block b of a launch:
  uint32_t flagfree_buf[kFlagFreeRecords];   // the receive buffer (0..2) the next flag-free call writes
  uint32_t flagfree_prev[kFlagFreeRecords];  // the most vectors a peer wrote per slot in the previous call
  uint32_t probe[kMaxRanks];           // P2P test: written by peer p into probe[p]
  uint32_t ep_dispatched;              // 1 from a peer-push layout to the next peer-push combine (local)
  uint32_t ep_calls[kGridBlocks];      // EP dispatches block b of this rank has run (local): their stamp
  // EP dispatch's counts tables (csrc/ep.cu's ep_dispatch), one per block of its grid (at most
  // grid_blocks <= kGridBlocks): ep_table[b][p] written by peer p's block b, its counts per expert
  // and its fingerprint in the last column, each word stamped with the call's number. 4 MiB in
  // all (docs/memory.md). Apart from the flags above: peers write the tables while this rank's
  // blocks spin on those.
  alignas(128) uint64_t ep_table[kGridBlocks][kMaxRanks][SYMCOMM_EP_MAX_EXPERTS + 1];
};

constexpr size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
// Staging follows the Signal block, and peers reach it as base + kSignalBytes: page-aligned so
// staging (and everything after it) keeps the allocation's alignment for 16-byte vector loads.
constexpr size_t kSignalBytes = align_up(sizeof(Signal), 4096);
static_assert(kSignalBytes % 4096 == 0 && kSignalBytes >= sizeof(Signal), "Signal block fits, page-aligned");
static_assert(offsetof(Signal, start) % 8 == 0 && offsetof(Signal, mid) % 8 == 0 && offsetof(Signal, end) % 8 == 0 &&
                  offsetof(Signal, met) % 8 == 0 && offsetof(Signal, epoch) % 8 == 0 &&
                  offsetof(Signal, meetings) % 8 == 0,
              "64-bit flags must be 8-byte aligned for st.release/ld.acquire .u64");

struct Peers {
  char* ptr[kMaxRanks];
};

// a[rank] by a compile-time index, for arrays in kernel parameters (Peers, custom_ar.cu's
// Chunks, peer_gather.cu's jobs): one indexed at run time is copied to local memory first, and
// ptxas then gives every thread a stack frame of the whole parameter struct, filled on entry.
// rank must be below W: any other index yields 0 (nullptr), silently.
template <int W, typename T>
__device__ __forceinline__ T of_rank(const T (&a)[kMaxRanks], int rank) {
  T v = 0;
#pragma unroll
  for (int r = 0; r < W; ++r)
    if (r == rank) v = a[r];
  return v;
}

// What every kernel needs to meet its peers, and to give up on them.
struct Sync {
  Peers signals;    // every rank's Signal block
  // This rank's own Signal block (signals.ptr[rank], set by make_sync), as a scalar: indexing
  // `signals` by the run-time rank would put a copy of Sync in every thread's stack frame.
  Signal* self;
  uint64_t* alarm;  // device address of this context's mapped host word
  uint64_t timeout_ns;
  int rank;
  bool early;       // signal dependents on entry (launch.cuh's dependents_early)
};

// symcomm.h's SYMCOMM_AR_ABORT_* layout: kind, the barrier phase, the peer that never came.
__host__ __device__ constexpr uint64_t abort_code(int kind, int phase, int peer) {
  return (uint64_t(kind) << 32) | (uint64_t(phase) << 16) | uint64_t(peer);
}

// Graphs whose CUDA user object was destroyed (the graph and every instance of it are gone),
// by capture token. CUDA runs the destructor on a thread of its own, where no CUDA call is
// allowed: it only records the token, and symcomm_ar_take_released hands it to the host,
// which frees the graph's slots. Shared with every pending destructor, so it outlives a
// context destroyed while graphs are still alive.
struct Released {
  std::mutex mutex;
  std::vector<uint64_t> tokens;
};

struct Guard {
  std::shared_ptr<Released> released;
  uint64_t token;
};

inline void CUDART_CB graph_gone(void* p) {
  Guard* g = static_cast<Guard*>(p);
  {
    std::lock_guard<std::mutex> lock(g->released->mutex);
    g->released->tokens.push_back(g->token);
  }
  delete g;
}

struct Context {
  int rank = 0;
  int world = 0;
  int device = 0;
  size_t staging_bytes = 0;
  size_t flagfree_bytes = 0;  // per rank, per receive buffer
  int max_slots = 0;
  uint64_t timeout_ns = 30ull * 1000 * 1000 * 1000;
  // Grid caps of this context's launches. Real ranks keep the constants above; simulated
  // ranks (symcomm_ar_sim_link) lower them so every rank's blocks fit on one GPU at once.
  int grid_blocks = kGridBlocks;
  int wide_blocks = kWideGridBlocks;           // push_blocks_for's cap from kWideFromBytes
  int flagfree_blocks = kFlagFreeBlocks;       // the narrow flag-free grid, N (flagfree_grid)
  int flagfree_max_blocks = kFlagFreeRecords;  // the cap of the wider ones, 2N and 4N
  // Launch every kernel as a programmatic dependent launch (launch.cuh). On unless
  // symcomm_ar_set_overlap turned it off, which only measurements do.
  bool overlap = true;
  // From how many valid entries per rank EP dispatch sends a token once per peer rank
  // (csrc/ep.cu's expand_duplicates); -1 for ep.cu's kDedupFromBytes over the row size. Only
  // symcomm_ep_debug_dedup_from changes it, for tests and measurements.
  int64_t ep_dedup_from = -1;
  // The flag-free NVFP4 gather's grid and block size; 0 blocks for peer_gather.cu's fp4_launch.
  // Only symcomm_fp4_debug_grid changes them, for measurements.
  int fp4_debug_blocks = 0;
  int fp4_debug_threads = 0;
  bool fp4_debug_block_major = false;
  char* base = nullptr;  // this rank's allocation
  size_t total_bytes = 0;
  Peers bases{};        // every rank's allocation, mapped here (own = base)
  Peers signals{}, scratch{}, flagfree{};
  Peers* slots = nullptr;  // device array of max_slots
  uint64_t* alarm_host = nullptr;  // mapped pinned word: the kernels' abort_code, 0 while healthy
  uint64_t* alarm_dev = nullptr;   // the same word as the kernels address it
  cudaEvent_t order = nullptr;     // symcomm_ar_order_streams' event
  // IPC handle bytes -> mapped base, opened once and counted per user (symcomm_ar_open's peer
  // buffers, and each graph slot filled by symcomm_ar_set_slot), so that releasing a slot
  // unmaps exactly what nothing else still uses.
  struct Mapping {
    char* base;
    int users;
  };
  std::map<std::string, Mapping> opened;
  std::vector<std::vector<std::string>> slot_handles;  // per slot: the `opened` keys it holds
  std::shared_ptr<Released> released = std::make_shared<Released>();
  uint64_t next_token = 1;
  std::map<char*, size_t> imported;     // peers' cuMem regions mapped here -> their size
};

// What a kernel of this context needs to meet its peers.
inline Sync make_sync(const Context* c) {
  return Sync{c->signals, reinterpret_cast<Signal*>(c->signals.ptr[c->rank]), c->alarm_dev, c->timeout_ns, c->rank,
              dependents_early()};
}

// Copies an eager input that peers cannot map into this rank's staging buffer, which they
// read as slot 0 at offset 0 (slot 0 holds every rank's staging address): the stage != 0
// prologue of every launch that reads peers' inputs.
inline cudaError_t stage_input(const Context* c, const void* in, size_t nbytes, int* slot, uint64_t* offset,
                               cudaStream_t stream) {
  const cudaError_t err = cudaMemcpyAsync(c->base + kSignalBytes, in, nbytes, cudaMemcpyDeviceToDevice, stream);
  if (err == cudaSuccess) *slot = 0, *offset = 0;
  return err;
}

// ------------------------------------------------------------------ device helpers
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void store_release(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The barrier flags' 64-bit twins: one aligned 64-bit access, so a reader never sees half of
// a new epoch and half of an old one.
__device__ __forceinline__ void store_release(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint4 load_volatile(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// "Flag has reached epoch" as a plain >=, deliberately not a wrap-safe signed difference: a
// 64-bit epoch that grows by one per call does not wrap in practice (2^64 calls at one per
// nanosecond take 584 years), and without wrap-around a flag array that no kernel has written
// for any number of calls (0, or an old epoch) is always below the current epoch, never
// mistaken for an arrival. A signed difference would again read a flag 2^63 epochs old as new.
__device__ __forceinline__ bool reached(uint64_t flag, uint64_t epoch) { return flag >= epoch; }

__device__ __forceinline__ Signal* own_signal(const Sync& s) { return s.self; }

__device__ __forceinline__ bool has_given_up(const Sync& s) {
  return *reinterpret_cast<volatile uint64_t*>(&own_signal(s)->aborted) != 0;
}

// Records why this rank stops; the first reason wins (the CAS is on device memory: atomics on
// mapped host memory are not available over every interconnect). The system fence makes the
// alarm visible to the host before the kernel ends.
__device__ inline void give_up(const Sync& s, uint64_t code) {
  unsigned long long* word = reinterpret_cast<unsigned long long*>(&own_signal(s)->aborted);
  if (atomicCAS(word, 0ull, static_cast<unsigned long long>(code)) == 0ull) {
    *reinterpret_cast<volatile uint64_t*>(s.alarm) = code;
    __threadfence_system();
  }
}

// False when this rank gave up: on this wait's expiry, or because another block or thread
// of the context did (then without waiting the whole bound again).
__device__ inline bool wait_flag(const Sync& s, const uint64_t* p, uint64_t epoch, int phase, int peer) {
  if (reached(load_acquire(p), epoch)) return true;
  const uint64_t t0 = now_ns();
  while (!reached(load_acquire(p), epoch)) {
    if (has_given_up(s)) return false;
    if (now_ns() - t0 > s.timeout_ns) {
      give_up(s, abort_code(SYMCOMM_AR_ABORT_TIMEOUT, phase, peer));
      return false;
    }
  }
  return true;
}

// Where a rank gave up (SYMCOMM_AR_ABORT_* phase): a barrier, or the flag-free kernel's data.
enum Phase { kStart = 0, kMid = 1, kEnd = 2, kFlagFreePhase = 3, kOwnBlocksPhase = 4 };

__device__ __forceinline__ uint64_t* phase_flags(Signal* s, int phase, int block) {
  return phase == kStart ? s->start[block] : phase == kMid ? s->mid[block] : s->end[block];
}

// Block b of every rank meets block b of every other rank. Threads 0..world-1 each pair with
// one peer: tell it we arrived, then wait for it. The CTA barrier before makes this block's
// earlier writes part of what the release publishes; the one after holds the block until
// every peer has arrived. Returns false, in every thread of the block, when this rank gave up.
__device__ inline bool barrier(const Sync& s, int phase, int world, uint64_t epoch) {
  __syncthreads();
  const int peer = threadIdx.x;
  bool ok = true;
  if (peer < world) {
    store_release(&phase_flags(reinterpret_cast<Signal*>(of_rank<kMaxRanks>(s.signals.ptr, peer)), phase, blockIdx.x)[s.rank], epoch);
    ok = wait_flag(s, &phase_flags(own_signal(s), phase, blockIdx.x)[peer], epoch, phase, peer);
  }
  return __syncthreads_and(ok);
}

// The number meet_all_blocks tags this kernel's arrivals with, read by each block on entry. Each
// block stores it back once it has met every block (the same value from every block): no block
// can still be about to read it then, since each read it before arriving.
__device__ __forceinline__ uint64_t next_meeting(const Sync& s) {
  return *reinterpret_cast<volatile uint64_t*>(&own_signal(s)->meetings) + 1;
}

// Every block of every rank meets here, where barrier() meets only the peers' block b: for a
// kernel whose blocks go on to read what any peer's block wrote. Threads 0..world-1 tell each
// peer this block arrived, with the meeting's number in the flag's upper 48 bits (blocks' epochs
// differ, so a block could not tell what a peer's block b' writes) and the caller's 16-bit mark
// below it; then thread j < 64 waits, with acquire loads, for block i / world of rank i % world,
// for each i = j, j + 64, ... below grid * world, one flag after another under one bound.
//
// A flag of this meeting whose mark is not this rank's stops the rank (SYMCOMM_AR_ABORT_MISMATCH,
// phase kEnd). A flag past this meeting has its mark unread, and counts as an arrival: the peer
// got past this meeting first. A combine's waiters never see one, since a peer's next kernel
// passes a barrier with this rank's whole grid first. A dedup dispatch's waiters can (the
// peer's next combine skips its start barrier), but that meeting's marks were already compared
// at the dispatch's kMid. So with marks that differ no block of either rank completes a
// combine's meeting, and no rank sums. Every rank names the mismatch unless one of its waiters is held first by a flag that never
// comes (a peer that already gave up starts no more blocks); that rank then stops at the bound,
// with a timeout. The meeting number has 48 bits: 2^48 combines at one a microsecond take 9 years.
//
// Measured on simulated ranks (bench/NOTES.md, 2026-11-29 ninth session): a thread per flag
// slowed the blocks still sending rows (a 2048-token combine by 30 µs); polling all of a thread's
// flags at once with relaxed loads and one sys-scope fence after cost 1.2 µs at decode, the
// fence's. At world 8 a 64-block grid gives each waiter 8 flags, up to 7 round trips after the
// last lands. False, in every thread, once the rank gave up.
__device__ inline bool meet_all_blocks(const Sync& s, int world, uint64_t meeting, uint32_t mark) {
  constexpr int kWaiters = 64;
  constexpr int kMarkBits = 16;
  __syncthreads();
  const uint64_t arrival = meeting << kMarkBits | (mark & 0xFFFFu);
  if (int(threadIdx.x) < world)
    store_release(&reinterpret_cast<Signal*>(of_rank<kMaxRanks>(s.signals.ptr, int(threadIdx.x)))->met[blockIdx.x][s.rank], arrival);
  bool ok = true;
  if (threadIdx.x < kWaiters) {
    const int flags = int(gridDim.x) * world;
    const uint64_t* met = &own_signal(s)->met[0][0];  // met[b][p] at b * kMaxRanks + p
    uint64_t t0 = 0;
    for (int i = threadIdx.x; ok && i < flags; i += kWaiters) {
      const uint64_t* flag = met + (i / world) * kMaxRanks + i % world;
      const int peer = i % world;
      uint64_t seen = load_acquire(flag);
      while (ok && !reached(seen >> kMarkBits, meeting)) {
        if (t0 == 0) t0 = now_ns();
        if (has_given_up(s)) {
          ok = false;
        } else if (now_ns() - t0 > s.timeout_ns) {
          // A block of this rank's own grid that never arrived could not start: too few SMs free.
          give_up(s, abort_code(SYMCOMM_AR_ABORT_TIMEOUT, peer == s.rank ? kOwnBlocksPhase : kEnd, peer));
          ok = false;
        } else {
          seen = load_acquire(flag);
        }
      }
      if (ok && seen >> kMarkBits == meeting && (seen & 0xFFFFu) != (mark & 0xFFFFu)) {
        give_up(s, abort_code(SYMCOMM_AR_ABORT_MISMATCH, kEnd, peer));
        ok = false;
      }
    }
  }
  ok = __syncthreads_and(ok);
  if (ok && threadIdx.x == 0) own_signal(s)->meetings = meeting;
  return ok;
}

// This block's epoch for the call, or 0 (never an epoch) once the rank has given up: then the
// kernel returns before touching a peer. Both words are read by one thread back to back, so
// the check adds no round trip to the prologue. Every peer kernel but the flag-free ones enters
// here, so this is where they wait for the kernel before them (launch.cuh). A kernel that has
// loads of its own to issue in the same round trip calls the two halves, begin_epoch and
// end_epoch, with the loads between them (csrc/ep.cu, csrc/peer_gather.cu).
struct EpochWords {
  uint64_t last;     // the block's previous epoch (thread 0's)
  uint64_t aborted;  // the rank's abort word (thread 0's)
};

__device__ __forceinline__ EpochWords begin_epoch(const Sync& s) {
  wait_for_predecessor();
  EpochWords w{0, 0};
  if (threadIdx.x == 0) {
    Signal* self = own_signal(s);
    w.last = *reinterpret_cast<volatile uint64_t*>(&self->epoch[blockIdx.x]);
    w.aborted = *reinterpret_cast<volatile uint64_t*>(&self->aborted);
  }
  return w;
}

__device__ __forceinline__ uint64_t end_epoch(const Sync& s, EpochWords w) {
  __shared__ uint64_t epoch;
  if (s.early) let_dependents_launch();
  if (threadIdx.x == 0) {
    if (w.aborted != 0) {
      epoch = 0;
    } else {
      epoch = w.last + 1;
      own_signal(s)->epoch[blockIdx.x] = w.last + 1;
    }
  }
  __syncthreads();
  return epoch;
}

__device__ __forceinline__ uint64_t next_epoch(const Sync& s) { return end_epoch(s, begin_epoch(s)); }

// Kernels read peers' buffers through slots. A slot whose pointers were never filled in (a
// graph replayed although its registration failed) is refused, never dereferenced. Every
// pointer of every slot is loaded before any is tested, and the tests are folded without a
// branch: tested one by one with an early return, each load waited for the test before it (the
// compiler keeps a load behind a branch that may skip it), and a kernel checking four slots at
// world 2 paid eight memory round trips in its prologue instead of one. Only a failure looks
// for the rank to name.
template <int N>
__device__ __forceinline__ bool slots_ready(const Sync& s, const Peers* const (&in)[N], int world) {
  const char* ptr[N][kMaxRanks];
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) ptr[n][r] = r < world ? in[n]->ptr[r] : "";
  bool ok = true;
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) ok &= ptr[n][r] != nullptr;
  if (ok) return true;
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r)
      if (ptr[n][r] == nullptr) {
        give_up(s, abort_code(SYMCOMM_AR_ABORT_UNREGISTERED, 0, r));
        return false;
      }
  return false;
}

__device__ __forceinline__ bool slot_ready(const Sync& s, const Peers* in, int world) {
  const Peers* const one[1] = {in};
  return slots_ready(s, one, world);
}

// The flag-free kernels' per-block bookkeeping (custom_ar.cu's flag_free, flag_free_gather and
// flag_free_scatter), in one place because they all drive the same Signal words and must agree
// on them. Receive buffers rotate over three: call k writes buffer k%3 and clears buffer (k-1)%3,
// which a peer writes again only at its call k+2, reached after receiving our call k+1 data,
// sent after this clear. The live buffer is kept as an index 0..2, not a call count % 3: a
// uint32_t count wraps at 2^32, and 2^32 % 3 == 1 would make two calls in a row write buffer 0.
// Every block of every flag-free launch takes a turn, whatever its thread mapping: the clear
// below covers [0, prev) with the launch's own stride, and prev is the same in every block.
//
// Launches differ in grid (flagfree_grid, fp4_launch) and block size, so every launch advances
// every record: block b of a launch of G blocks advances records b, b + G, b + 2G, ... below
// kFlagFreeRecords, each record exactly once per call (blocks of at least kFlagFreeRecords threads
// reach them all). A launch's block b then finds its record as current as block 0's
// whichever grids the calls before it had. Each record has one writer per launch, and every
// launch starts after the one before it ended.
//
// The turn is taken in two halves, flagfree_begin (the wait for the kernel before, then thread
// 0's loads of the block's words) and flagfree_end, so that a kernel issues its first input
// loads between them and both wait out one memory round trip together: at the sizes these
// kernels serve, the prologue is a chain of round trips, and the peers wait for its end.
struct FlagFreeWords {
  uint32_t buf = 0, prev = 0;  // the record's, in the threads that advance one (flagfree_end)
  bool stopped = false;        // thread 0's
};

// Thread t of block b advances record b + t * G of a G-block launch (if below kFlagFreeRecords),
// so the stores of every record the block owns issue together from warp 0's lanes (G >= 4): 0.04
// to 0.14 us less a call at 1-64 KiB than a loop in thread 0 (four store pairs on the 32-block
// grid), bench/results/2026-11-30_nvidia-h200-x2_w2_verify_480065e/lanes_ab/.
static_assert(kThreads >= kFlagFreeRecords, "one block of any flag-free grid holds a thread for every record");
__device__ __forceinline__ bool advances_a_record() {
  return blockIdx.x + size_t(threadIdx.x) * gridDim.x < size_t(kFlagFreeRecords);
}

__device__ __forceinline__ FlagFreeWords flagfree_begin(const Sync& s) {
  enter_after_predecessor(s.early);  // the flag-free kernels' entry, as begin_epoch is the others'
  FlagFreeWords w;
  if (advances_a_record()) {
    const Signal* self = own_signal(s);
    if (threadIdx.x == 0) w.stopped = has_given_up(s);
    // Each thread reads the record it will advance (equal to record b by the invariant): were
    // they all to read record b, a thread in another warp (grids under 4 blocks) could read it
    // after thread 0 advanced it.
    const unsigned r = blockIdx.x + threadIdx.x * gridDim.x;
    w.buf = self->flagfree_buf[r];
    w.prev = self->flagfree_prev[r];
  }
  return w;
}

__device__ __forceinline__ void flagfree_end(const Sync& s, FlagFreeWords w, size_t nvec, uint32_t* buf,
                                             uint32_t* prev, bool* stopped) {
  if (advances_a_record()) {
    Signal* self = own_signal(s);
    const unsigned r = blockIdx.x + threadIdx.x * gridDim.x;
    self->flagfree_buf[r] = w.buf == 2 ? 0 : w.buf + 1;
    self->flagfree_prev[r] = uint32_t(nvec);
    if (threadIdx.x == 0) *stopped = w.stopped, *buf = w.buf, *prev = w.prev;
  }
  __syncthreads();
}

// Resets this block's share of the buffer the previous call wrote (prev vectors per peer).
template <int W>
__device__ __forceinline__ void flagfree_clear(const Sync& s, const Peers& recv, size_t slot_vecs, uint32_t buf,
                                               uint32_t prev) {
  uint4* stale = reinterpret_cast<uint4*>(of_rank<W>(recv.ptr, s.rank)) + size_t((buf + 2) % 3) * W * slot_vecs;
  const uint4 blank = make_uint4(kSentinel, kSentinel, kSentinel, kSentinel);
  for (int r = 0; r < W; ++r) {
    if (r == s.rank) continue;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < prev; i += size_t(gridDim.x) * blockDim.x)
      stale[r * slot_vecs + i] = blank;
  }
}

// Where rank `from`'s vectors for rank `to` land in receive buffer `buf`: the layout every
// flag-free kernel shares ([3 buffers][W sender slots][slot_vecs]), so that flagfree_clear,
// which knows nothing of the op, resets exactly what any of them wrote. `to` is often the
// run-time rank, hence of_rank.
template <int W>
__device__ __forceinline__ uint4* flagfree_slot(const Peers& recv, int to, uint32_t buf, int from, size_t slot_vecs) {
  return reinterpret_cast<uint4*>(of_rank<W>(recv.ptr, to)) + (size_t(buf) * W + from) * slot_vecs;
}

// The vectors a chunk of `count` puts on the wire: the chunk, or one placeholder when empty
// (an empty chunk still sends one vector, which the peer waits for and drops: see
// custom_ar.cu's flag_free_gather for why the rotation needs it).
__device__ __forceinline__ size_t sent(size_t count) { return count > 0 ? count : 1; }

// The receiving half of every flag-free kernel: vector i of each world slot of receive buffer
// `buf` into v[0..W-1], in rank order; v[rank] is `own` (this rank's own contribution, as
// without_sentinel sent it to the peers, so every rank combines the same bits). All W-1 peer
// slots are loaded at once (independent loads in flight together), then only the slots whose
// data has not landed are polled. Volatile loads, no acquire: the data is its own flag, and a
// vector is consumed only once none of its words is the sentinel, so a reader never combines a
// word before the peer's store of that word arrived. Returns false when this rank gave up (the
// bounded wait expired, or another thread of the context gave up): the caller returns at once,
// as after any give-up. `senders` (bit r for rank r) names the slots that
// hold a vector i: an uneven all-gather's shorter chunks end before others, and v[r] of a slot
// left out is not touched.
template <int W>
__device__ __forceinline__ bool flagfree_receive(const Sync& s, const Peers& recv, uint32_t buf, size_t slot_vecs,
                                                 size_t i, uint4 own, uint4 (&v)[W], unsigned senders = ~0u) {
#pragma unroll
  for (int r = 0; r < W; ++r)
    if (senders >> r & 1)
      v[r] = r == s.rank ? own : load_volatile(flagfree_slot<W>(recv, s.rank, buf, r, slot_vecs) + i);
#pragma unroll
  for (int r = 0; r < W; ++r) {
    if (r != s.rank && (senders >> r & 1) && has_sentinel(v[r])) {
      const uint4* p = flagfree_slot<W>(recv, s.rank, buf, r, slot_vecs) + i;
      const uint64_t t0 = now_ns();
      do {
        if (has_given_up(s)) return false;
        if (now_ns() - t0 > s.timeout_ns) {  // a peer never sent: give up, don't hang
          give_up(s, abort_code(SYMCOMM_AR_ABORT_TIMEOUT, kFlagFreePhase, r));
          return false;
        }
        v[r] = load_volatile(p);
      } while (has_sentinel(v[r]));
    }
  }
  return true;
}

// 16 bytes of T as fp32 lanes, and back.
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  static constexpr int kN = 4;
  __device__ static void load(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y), f[2] = __uint_as_float(v.z), f[3] = __uint_as_float(v.w);
  }
  __device__ static void add(const uint4& v, float* f) {
    f[0] += __uint_as_float(v.x), f[1] += __uint_as_float(v.y), f[2] += __uint_as_float(v.z), f[3] += __uint_as_float(v.w);
  }
  __device__ static uint4 pack(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
};

template <typename H2, float2 (*ToF)(H2), H2 (*FromF)(float2)>
struct HalfLanes {
  static constexpr int kN = 8;
  __device__ static void load(const uint4& v, float* f) {
    const H2* h = reinterpret_cast<const H2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = ToF(h[i]);
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
  __device__ static void add(const uint4& v, float* f) {
    const H2* h = reinterpret_cast<const H2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = ToF(h[i]);
      f[2 * i] += x.x, f[2 * i + 1] += x.y;
    }
  }
  __device__ static uint4 pack(const float* f) {
    uint4 v;
    H2* h = reinterpret_cast<H2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = FromF(make_float2(f[2 * i], f[2 * i + 1]));
    return v;
  }
};

__device__ inline float2 bf2_to_f2(__nv_bfloat162 h) { return __bfloat1622float2(h); }
__device__ inline __nv_bfloat162 f2_to_bf2(float2 f) { return __float22bfloat162_rn(f); }
__device__ inline float2 h2_to_f2(__half2 h) { return __half22float2(h); }
__device__ inline __half2 f2_to_h2(float2 f) { return __float22half2_rn(f); }

template <>
struct Lanes<__nv_bfloat16> : HalfLanes<__nv_bfloat162, bf2_to_f2, f2_to_bf2> {};
template <>
struct Lanes<__half> : HalfLanes<__half2, h2_to_f2, f2_to_h2> {};

// The one rounding rule of every summing kernel: fp32 lanes, ranks added in order 0..W-1, one
// rounding to T at the end. The first term seeds the sum (not 0.0f), so a lone -0.0 survives
// as NCCL would keep it.
template <typename T, int W>
__device__ __forceinline__ uint4 sum_in_rank_order(const uint4 (&v)[W]) {
  float acc[Lanes<T>::kN];
  Lanes<T>::load(v[0], acc);
#pragma unroll
  for (int r = 1; r < W; ++r) Lanes<T>::add(v[r], acc);
  return Lanes<T>::pack(acc);
}

// Sum of the world's vectors at index i. All W loads are issued before the first add: with a
// loop over a run-time world size each add waited for its NVLink load before the next load
// issued, which serialised W round trips per vector (measured: two-shot at 4 MiB, world 4, ran
// at a third of NVLink bandwidth).
template <typename T, int W>
__device__ __forceinline__ uint4 reduce_at(const uint4* const* src, size_t i) {
  uint4 v[W];
#pragma unroll
  for (int r = 0; r < W; ++r) v[r] = src[r][i];
  return sum_in_rank_order<T, W>(v);
}

// The flag-free grid for a call whose ranks send at most `send_vecs` vectors to one peer (the
// same on every rank): 2N blocks from one vector per thread of the narrow grid (256 KiB at the
// defaults), 4N from four (1 MiB). At world 2 on H200 (bench/results/2026-11-30_nvidia-h200-x2_w2_widest_grid):
// - at 256 KiB to the peer (all_gather and reduce_scatter of 512 KiB) 2N was ahead of N or level,
//   4.59 against 4.74 us and 4.85 against 4.82; at 64 KiB and below N was ahead;
// - 4N against 2N: 512 KiB to the peer, behind (all_gather of 1 MiB 5.79 against 5.26); 1 MiB,
//   level or ahead (all_reduce of 1 MiB 7.36 / 7.33, all_gather of 2 MiB 7.26 / 7.47); 4 MiB,
//   well ahead (all_reduce of 4 MiB 16.98 / 19.41, all_gather of 8 MiB 17.63 / 20.42).
constexpr size_t kFlagFreeWidestFrom = 4;
inline int flagfree_grid(const Context* c, size_t send_vecs) {
  const size_t narrow_threads = size_t(c->flagfree_blocks) * kThreads;
  const int blocks = send_vecs >= kFlagFreeWidestFrom * narrow_threads ? 4 * c->flagfree_blocks
                     : send_vecs >= narrow_threads                      ? 2 * c->flagfree_blocks
                                                                        : c->flagfree_blocks;
  return blocks < c->flagfree_max_blocks ? blocks : c->flagfree_max_blocks;
}

// One thread per unit of work, at least one block, at most `cap` blocks.
inline int capped_blocks(size_t work, int cap) {
  size_t b = (work + kThreads - 1) / kThreads;
  if (b < 1) b = 1;
  return int(b < size_t(cap) ? b : size_t(cap));
}

inline int blocks_for(const Context* c, size_t work) { return capped_blocks(work, c->grid_blocks); }

// The grid of a push kernel whose ranks each send `per_peer_vecs` vectors to a peer (the same
// on every rank): blocks_for's below kWideFromBytes, up to the wide cap from there.
inline int push_blocks_for(const Context* c, size_t per_peer_vecs) {
  return capped_blocks(per_peer_vecs, per_peer_vecs * 16 < kWideFromBytes ? c->grid_blocks : c->wide_blocks);
}

// Runs f(std::integral_constant<int, W>{}) for the world size: the kernels take W as a template
// parameter, so their loops over peers unroll and all W loads issue together.
template <typename F>
cudaError_t for_world(int world, F&& f) {
  switch (world) {
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: return cudaErrorInvalidValue;  // symcomm_ar_create accepts only these (custom.py)
  }
}

template <typename T>
struct Type {
  using type = T;
};

// Runs f(Type<T>{}) for the element type the kernels sum in.
template <typename F>
cudaError_t for_dtype(symcomm_dtype_t dtype, F&& f) {
  switch (dtype) {
    case SYMCOMM_FLOAT32: return f(Type<float>{});
    case SYMCOMM_FLOAT16: return f(Type<__half>{});
    case SYMCOMM_BFLOAT16: return f(Type<__nv_bfloat16>{});
    default: return cudaErrorInvalidValue;
  }
}

// This library has its own (static) CUDA runtime. Every entry point selects the
// communicator's device through here. It asks the runtime rather than caching the answer:
// torch's runtime can make another device's context current on this thread between calls,
// and cudaGetDevice reads that state without a driver round trip.
inline cudaError_t use_device(int device) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == device) return cudaSuccess;
  return cudaSetDevice(device);
}

}  // namespace ar
}  // namespace symcomm

// The opaque handle of symcomm.h: one rank's Context, shared by the kernel files.
struct symcomm_ar_ctx {
  symcomm::ar::Context impl;
};

#endif  // SYMCOMM_PEER_CUH_
