// Expert-parallel dispatch and combine: the per-entry and per-row math that csrc/ep.cu's kernels
// and their CPU twin (symcomm_ep_dispatch_host / symcomm_ep_combine_host) share, so CI checks
// the kernels' bytes against symcomm/ep/layout.py and symcomm/ep/fp8.py without a GPU.
//
// Everything here is __host__ __device__ and works on one "unit" of a row, the piece one lane
// of a warp owns: 16 bytes of a row copied as is, one 16-value NVFP4 block (fp4.cuh's codec),
// or 8 values of a 128-value FP8 block. symcomm/ep/layout.py states where rows land and in
// which order combine adds them; this file only computes values.
#ifndef SYMCOMM_EP_CUH_
#define SYMCOMM_EP_CUH_

#include "fp4.cuh"
#include "fp8.cuh"
#include "symcomm.h"

#include <cstdint>

namespace symcomm {
namespace ep {

constexpr int kFp8Block = 128;     // values per FP8 scale (symcomm/ep/fp8.py)
constexpr int kFp8Unit = fp8::kUnit;  // values per lane: 16 lanes make one FP8 block
constexpr int kCombineUnit = 8;    // values per lane in the combine's sum
constexpr float kFp8Max = 448.0f;

// Entry (t, j) of a token's top-k: its expert id if the entry is sent, else -1 (out of
// [0, experts), or the same expert as an earlier slot of the token).
template <typename Id>
SYMCOMM_HD int entry_key(const Id* ids, int64_t entry, int topk, int experts) {
  const int64_t id = static_cast<int64_t>(ids[entry]);
  if (id < 0 || id >= experts) return -1;
  const int64_t first = entry - entry % topk;
  for (int64_t e = first; e < entry; ++e)
    if (static_cast<int64_t>(ids[e]) == id) return -1;
  return static_cast<int>(id);
}

SYMCOMM_HD int64_t align_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

// What every rank of a dispatch must agree on, folded into one int32 that travels in the counts
// table (symcomm/ep/layout.py's fingerprint computes the same): ranks that sized their buffers
// differently see it before any row moves. The encoding, the row's values and their dtype are in
// it because they set the grid (units per row) and what a row's bytes mean: NVFP4 rows of c
// values and FP8 rows of c / 2 have the same bytes and units, and so do fp16 and bf16 rows.
SYMCOMM_HD int32_t fingerprint(int64_t capacity, int64_t row_bytes, int topk, int align, int64_t max_tokens,
                               int experts, int quant, int64_t cols, int dtype) {
  const uint64_t parts[] = {uint64_t(capacity),   uint64_t(row_bytes), uint64_t(topk),
                            uint64_t(align),      uint64_t(max_tokens), uint64_t(experts),
                            uint64_t(quant),      uint64_t(cols),       uint64_t(dtype)};
  uint64_t h = 0;
  for (uint64_t part : parts) h = (h * 1000003ull) ^ part;
  return int32_t(h & 0x7FFFFFFFull);
}

// What every rank of a combine must agree on, in the 16 bits a meeting flag has to spare
// (peer.cuh's meet_all_blocks): the encoding and dtype exactly, since those are the per-call
// choices a rank makes alone (the handle's sizes were agreed at dispatch), and 12 bits of a hash
// of the handle's sizes, against handles of different dispatches. The hash is mixed before its
// top bits are taken: the low bits of the multiply-xor fold see each size only modulo 4096, so
// max_tokens 4096 and 8192 would share a mark.
SYMCOMM_HD uint32_t combine_mark(int quant, int dtype, int64_t cols, int64_t capacity, int64_t max_tokens, int topk) {
  const uint64_t parts[] = {uint64_t(cols), uint64_t(capacity), uint64_t(max_tokens), uint64_t(topk)};
  uint64_t h = 0;
  for (uint64_t part : parts) h = (h * 1000003ull) ^ part;
  h ^= h >> 33;  // a 64-bit finaliser (MurmurHash3's fmix64): every input bit reaches the top bits
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  return uint32_t(quant & 3) | uint32_t(dtype & 3) << 2 | uint32_t(h >> 52) << 4;
}

// Which entry a received row came from (symcomm/ep/layout.py's recv_src).
SYMCOMM_HD int32_t origin(int rank, int64_t max_tokens, int64_t token, int topk, int slot) {
  return static_cast<int32_t>((rank * max_tokens + token) * topk + slot);
}

// ------------------------------------------------------------------ FP8 blocks
// The dequant scale of a block from its amax (fp4::amax_step's bits: a NaN wins): amax / 448,
// or 1 where that is not > 0 (an all-zero block, a NaN).
SYMCOMM_HD float fp8_scale(uint32_t amax_bits) {
  const float s = float_of(amax_bits) / kFp8Max;
  return s > 0.0f ? s : 1.0f;
}

// Eight values' codes with the block's scale (fp8.cuh: saturated, every NaN 0x7F).
SYMCOMM_HD uint2 fp8_codes8(const float (&v)[kFp8Unit], float s) {
  uint32_t w[2];
#ifdef __CUDA_ARCH__
  fp8::encode8(v, fp8::scale_of(s), w);
#else
  fp8::encode8_host(v, s, w);
#endif
  return make_uint2(w[0], w[1]);
}

SYMCOMM_HD void fp8_values8(uint2 codes, float s, float (&y)[kFp8Unit]) {
#ifdef __CUDA_ARCH__
  fp8::decode8(codes, s, y);
#else
  const uint32_t w[2] = {codes.x, codes.y};
  for (int i = 0; i < kFp8Unit; ++i) y[i] = fp4::e4m3_value(uint8_t(w[i >> 2] >> ((i & 3) * 8))) * s;
#endif
}

// ------------------------------------------------------------------ NVFP4 blocks
// One 16-value block of T, encoded by the codec's own encode_block: the bytes fp4.quantize writes.
template <typename T>
SYMCOMM_HD uint8_t nvfp4_block(const T* x, float gs, uint2* payload) {
  float v[fp4::kBlock];
#pragma unroll
  for (int i = 0; i < fp4::kBlock; ++i) v[i] = to_f32(x[i]);
  uint32_t words[2];
  const uint8_t scale = fp4::encode_block(v, gs, words);
  *payload = make_uint2(words[0], words[1]);
  return scale;
}

// ------------------------------------------------------------------ combine
// acc + w * y as two roundings (no fused multiply-add): the rounding of symcomm/ep/layout.py's
// partial sums, on the device as on the host.
SYMCOMM_HD float weighted_add(float acc, float w, float y) { return add_rn(acc, mul_rn(w, y)); }

// Eight values at p as stored (p 16-byte aligned on the device: 16- or 32-byte vector loads).
template <typename T>
SYMCOMM_HD void load8_raw(const T* p, T (&raw)[kCombineUnit]) {
#ifdef __CUDA_ARCH__
#pragma unroll
  for (int k = 0; k < int(kCombineUnit * sizeof(T) / 16); ++k)
    reinterpret_cast<uint4*>(raw)[k] = reinterpret_cast<const uint4*>(p)[k];
#else
  for (int i = 0; i < kCombineUnit; ++i) raw[i] = p[i];
#endif
}

// Eight values to p (16-byte aligned on the device), rounded from fp32.
template <typename T>
SYMCOMM_HD void store8(T* p, const float (&v)[kCombineUnit]) {
#ifdef __CUDA_ARCH__
  constexpr int kVectors = kCombineUnit * sizeof(T) / 16;
  alignas(16) T raw[kCombineUnit];
#pragma unroll
  for (int i = 0; i < kCombineUnit; ++i) raw[i] = from_f32<T>(v[i]);
#pragma unroll
  for (int k = 0; k < kVectors; ++k) reinterpret_cast<uint4*>(p)[k] = reinterpret_cast<const uint4*>(raw)[k];
#else
#pragma unroll
  for (int i = 0; i < kCombineUnit; ++i) p[i] = from_f32<T>(v[i]);
#endif
}

// 8 bytes at p (8-byte aligned on the device, anything on the host).
SYMCOMM_HD uint2 load8_bytes(const char* p) {
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const uint2*>(p);
#else
  uint2 v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

SYMCOMM_HD float load_f32(const char* p) {
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const float*>(p);
#else
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

// A top-k weight as fp32, whatever dtype the caller passed.
SYMCOMM_HD float weight_at(const void* w, symcomm_dtype_t dtype, int64_t i) {
  switch (dtype) {
    case SYMCOMM_BFLOAT16: return to_f32(static_cast<const __nv_bfloat16*>(w)[i]);
    case SYMCOMM_FLOAT16: return to_f32(static_cast<const __half*>(w)[i]);
    default: return static_cast<const float*>(w)[i];
  }
}

// ------------------------------------------------------------------ combine, by rank
// recv_group (symcomm/ep/layout.py): on each rank, [W, max_tokens, topk] pairs of int32, the rows
// of rank q's token t on this rank as (row, the fp32 bits of its weight) in slot order, ended by
// (-1, 0) where fewer than topk; (-1, 0) first where the token sent nothing here.
constexpr int kGroupPairs = 2;

// Values of T in a 16-byte unit, the piece one lane of the combine owns.
template <typename T>
constexpr int kUnitValues = int(16 / sizeof(T));

template <typename T>
SYMCOMM_HD void load16(const T* p, T (&raw)[kUnitValues<T>]) {
#ifdef __CUDA_ARCH__
  *reinterpret_cast<uint4*>(raw) = *reinterpret_cast<const uint4*>(p);
#else
  std::memcpy(raw, p, 16);
#endif
}

// Units u0 + 32 m (m < U) of a group's partial (symcomm/ep/layout.py, "Combine, by rank"): its
// rows of expert_out in slot order, weighted, in fp32 from +0.0; units from `units` on are left
// at zero. `list` is the group's recv_group entry. A lane of the combine takes U units of a row,
// one per 32-unit chunk, so that one list serves U chunks and U loads a row are in flight.
//
// The list is read kSumGroup / U slots at a time and every listed row of those slots is loaded,
// for all U units, before any is added: a group of slots costs one memory round trip for its rows.
// A slot after the end of the list holds whatever an earlier dispatch left there: `live` stops at
// the first row -1, and nothing past it is loaded or added.
constexpr int kSumGroup = 8;

template <typename T, int U>
SYMCOMM_HD void partial_units(const T* expert_out, const int32_t* list, int64_t cols, int64_t units, int64_t u0,
                              int topk, float (&acc)[U][kUnitValues<T>]) {
  constexpr int V = kUnitValues<T>, G = kSumGroup / U;
  static_assert(G >= 1, "at least one slot a round trip");
#pragma unroll
  for (int m = 0; m < U; ++m)
#pragma unroll
    for (int i = 0; i < V; ++i) acc[m][i] = 0.0f;
  bool live = true;
  for (int j0 = 0; j0 < topk && live; j0 += G) {
    int32_t row[G];
    uint32_t weight[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      row[g] = j0 + g < topk ? list[(j0 + g) * kGroupPairs] : -1;
      weight[g] = j0 + g < topk ? uint32_t(list[(j0 + g) * kGroupPairs + 1]) : 0u;
    }
    alignas(16) T raw[G][U][V];
    bool in[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      live = live && row[g] >= 0;
      in[g] = live;
#pragma unroll
      for (int m = 0; m < U; ++m)
        if (live && u0 + 32 * m < units) load16(expert_out + int64_t(row[g]) * cols + (u0 + 32 * m) * V, raw[g][m]);
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (!in[g]) continue;
      const float w = float_of(weight[g]);
#pragma unroll
      for (int m = 0; m < U; ++m) {
        if (u0 + 32 * m >= units) continue;
#pragma unroll
        for (int i = 0; i < V; ++i) acc[m][i] = weighted_add(acc[m][i], w, to_f32(raw[g][m][i]));
      }
    }
  }
}

// Bit p set: rank p holds one of token t's valid entries (send_rows >= 0, expert id / num_local).
template <typename Id>
SYMCOMM_HD uint32_t ranks_of(const Id* ids, const int32_t* send_rows, int64_t t, int topk, int num_local, int world) {
  uint32_t ranks = 0;
#pragma unroll 8
  for (int j = 0; j < topk; ++j) {
    const int64_t e = t * topk + j;
    const int64_t p = static_cast<int64_t>(ids[e]) / num_local;
    if (send_rows[e] >= 0 && p >= 0 && p < world) ranks |= 1u << p;
  }
  return ranks;
}

// kCombineUnit values at unit u of token t's output: the partials of the ranks holding its valid
// entries (ranks_of) in rank order, in fp32 from +0.0, each as it came back to ``back`` (this
// rank's returned buffer: slot p * max_tokens + t; FP8 codes first, then the scales). Every rank's
// slot is loaded first, before ranks_of's loads are used (each slot lies inside `back`; those of
// ranks without an entry hold another call's bytes and are never added): one round trip.
// R: the most ranks the caller's world can have (the kernels' W, the twin's kMaxWorld).
template <typename T, int Q, int R, typename Id>
SYMCOMM_HD void owner_unit(const char* back, const Id* ids, const int32_t* send_rows, int topk, int num_local,
                           int world, int64_t t, int64_t u, int64_t cols, int64_t max_tokens,
                           float (&acc)[kCombineUnit]) {
#pragma unroll
  for (int i = 0; i < kCombineUnit; ++i) acc[i] = 0.0f;
  const int64_t slots = world * max_tokens;
  alignas(16) T raw[R][kCombineUnit];
  uint2 codes[R];
  float scale[R];
#pragma unroll
  for (int p = 0; p < R; ++p) {
    if (p >= world) continue;
    const int64_t slot = p * max_tokens + t;
    if constexpr (Q == SYMCOMM_EP_FP8) {
      codes[p] = load8_bytes(back + slot * cols + u * kCombineUnit);
      scale[p] = load_f32(back + slots * cols + (slot * (cols / kFp8Block) + u * kCombineUnit / kFp8Block) * 4);
    } else {
      load8_raw(reinterpret_cast<const T*>(back) + slot * cols + u * kCombineUnit, raw[p]);
    }
  }
  const uint32_t ranks = ranks_of(ids, send_rows, t, topk, num_local, world);
#pragma unroll
  for (int p = 0; p < R; ++p) {
    if (p >= world || !(ranks >> p & 1u)) continue;
    float y[kCombineUnit];
    if constexpr (Q == SYMCOMM_EP_FP8) {
      fp8_values8(codes[p], scale[p], y);
    } else {
#pragma unroll
      for (int i = 0; i < kCombineUnit; ++i) y[i] = to_f32(raw[p][i]);
    }
#pragma unroll
    for (int i = 0; i < kCombineUnit; ++i) acc[i] = add_rn(acc[i], y[i]);  // a decoded FP8 value is a product: no fused add
  }
}

}  // namespace ep
}  // namespace symcomm

#endif  // SYMCOMM_EP_CUH_
