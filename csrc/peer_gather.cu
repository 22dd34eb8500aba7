// Uneven all-gather by push (symcomm/backends/peer_gather.py): the kernel and its entry point,
// over the peer machinery of peer.cuh.
#include "peer.cuh"

namespace {
using namespace symcomm::ar;

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
template <int W>
__global__ void __launch_bounds__(kThreads) gather_push(Sync s, const Peers* slots, Pieces pieces) {
  const uint64_t epoch = next_epoch(s);
  if (epoch == 0) return;
  for (int k = 0; k < pieces.count; ++k)
    if (!slot_ready(s, slots + pieces.slot[k], W)) return;
  if (!barrier(s, kStart, W, epoch)) return;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int k = 0; k < pieces.count; ++k) {
    uint4* dst[W];
#pragma unroll
    for (int q = 0; q < W; ++q) dst[q] = reinterpret_cast<uint4*>(slots[pieces.slot[k]].ptr[(s.rank + q) % W] + pieces.dst_offset[k]);
    const uint4* src = pieces.src[k];
    for (size_t i = first; i < pieces.nvec[k]; i += stride) {
      const uint4 v = src[i];
#pragma unroll
      for (int q = 0; q < W; ++q) dst[q][i] = v;
    }
  }
  barrier(s, kEnd, W, epoch);
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
    if ((srcs[k] | dst_offsets[k] | nbytes[k]) % 16 || slots[k] < 1 || slots[k] >= c->max_slots)
      return cudaErrorInvalidValue;
    pieces.src[k] = reinterpret_cast<const uint4*>(srcs[k]);
    pieces.slot[k] = slots[k];
    pieces.dst_offset[k] = dst_offsets[k];
    pieces.nvec[k] = nbytes[k] / 16;
  }
  // The grid must be the same on every rank (block b meets block b), so it follows the total,
  // which every rank knows, not this rank's share.
  const int blocks = blocks_for(c, total_bytes / 16 / size_t(c->world));
  const Sync s{c->signals, c->alarm_dev, c->timeout_ns, c->rank};
  return for_world(c->world, [&](auto w) {
    gather_push<decltype(w)::value><<<blocks, kThreads, 0, stream>>>(s, c->slots, pieces);
    return cudaGetLastError();
  });
}

}  // extern "C"
