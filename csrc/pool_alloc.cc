// Sub-allocator over pre-registered symmetric regions, exposed as torch's pluggable-allocator
// entry points (symcomm_alloc / symcomm_free).
//
// Why not allocate a fresh ncclMemAlloc segment per torch request: window registration is a
// collective, so a rank whose pool grew alone would deadlock its peers. Regions are therefore
// added only by Python, in lock step on every rank (SymmetricPool.reserve), and this file
// merely carves them up. It returns NULL when no region has room; the caching allocator then
// raises OutOfMemoryError, which use_symmetric_memory turns into a SymmetricMemoryError.
//
// Determinism: a symmetric kernel needs each rank's tensor at the same offset of its window.
// Regions are searched in the order they were added and, inside one, by ascending offset,
// never by virtual address (which differs between ranks), so the same sequence of requests
// yields the same (region, offset) on every rank.
//
// Plain C ABI, no CUDA runtime: the NCCL allocation itself happens in Python through ctypes.
#include "symcomm.h"

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kAlign = 512;  // torch's caching allocator rounds to 512 bytes as well

struct Region {
  uintptr_t base;
  size_t size;
  std::map<size_t, size_t> free_ranges;  // offset -> length, coalesced
};

struct Pool {
  bool live = true;
  std::vector<Region> regions;
  size_t bytes_in_use = 0;
  size_t live_allocations = 0;
  size_t last_failed_request = 0;
};

struct Allocation {
  int pool;
  size_t region;
  size_t size;
};

std::mutex g_mutex;
std::vector<Pool> g_pools;
std::unordered_map<uintptr_t, Allocation> g_allocations;
thread_local int t_active_pool = -1;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

bool valid_pool(int pool) {
  return pool >= 0 && static_cast<size_t>(pool) < g_pools.size() && g_pools[pool].live;
}

void release_range(Region& region, size_t offset, size_t size) {
  auto next = region.free_ranges.lower_bound(offset);
  if (next != region.free_ranges.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      size += prev->second;
      region.free_ranges.erase(prev);
    }
  }
  if (next != region.free_ranges.end() && offset + size == next->first) {
    size += next->second;
    region.free_ranges.erase(next);
  }
  region.free_ranges[offset] = size;
}

}  // namespace

extern "C" {

int symcomm_pool_create() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_pools.emplace_back();
  return static_cast<int>(g_pools.size() - 1);
}

symcomm_status_t symcomm_pool_add_region(int pool, uintptr_t base, size_t size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!valid_pool(pool) || size == 0 || base % kAlign != 0) return SYMCOMM_ERROR_INVALID_REGION;
  Region region{base, size, {}};
  region.free_ranges[0] = size;
  g_pools[pool].regions.push_back(std::move(region));
  return SYMCOMM_SUCCESS;
}

// Makes `pool` the target of symcomm_alloc on this thread; returns the previous target.
int symcomm_pool_set_active(int pool) {
  int previous = t_active_pool;
  t_active_pool = pool;
  return previous;
}

size_t symcomm_pool_bytes_in_use(int pool) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return valid_pool(pool) ? g_pools[pool].bytes_in_use : 0;
}

size_t symcomm_pool_live_allocations(int pool) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return valid_pool(pool) ? g_pools[pool].live_allocations : 0;
}

// The size of the most recent request this pool could not serve (0 if none), then clears it.
size_t symcomm_pool_take_failed_request(int pool) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!valid_pool(pool)) return 0;
  size_t failed = g_pools[pool].last_failed_request;
  g_pools[pool].last_failed_request = 0;
  return failed;
}

// Forgets the pool. Live allocations keep their bookkeeping entries so a late free is still
// recognised (and ignored) rather than corrupting another pool.
void symcomm_pool_destroy(int pool) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (valid_pool(pool)) {
    g_pools[pool].live = false;
    g_pools[pool].regions.clear();
  }
}

void* symcomm_alloc(size_t size, int /*device*/, symcomm_stream_t /*stream*/) {
  std::lock_guard<std::mutex> lock(g_mutex);
  int pool = t_active_pool;
  if (!valid_pool(pool)) return nullptr;
  Pool& p = g_pools[pool];
  const size_t need = align_up(size == 0 ? 1 : size);
  for (size_t r = 0; r < p.regions.size(); ++r) {
    Region& region = p.regions[r];
    for (auto it = region.free_ranges.begin(); it != region.free_ranges.end(); ++it) {
      if (it->second < need) continue;
      const size_t offset = it->first;
      const size_t remaining = it->second - need;
      region.free_ranges.erase(it);
      if (remaining) region.free_ranges[offset + need] = remaining;
      const uintptr_t ptr = region.base + offset;
      g_allocations[ptr] = Allocation{pool, r, need};
      p.bytes_in_use += need;
      p.live_allocations += 1;
      return reinterpret_cast<void*>(ptr);
    }
  }
  p.last_failed_request = size;
  return nullptr;
}

void symcomm_free(void* ptr, size_t /*size*/, int /*device*/, symcomm_stream_t /*stream*/) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto found = g_allocations.find(reinterpret_cast<uintptr_t>(ptr));
  if (found == g_allocations.end()) return;
  const Allocation a = found->second;
  g_allocations.erase(found);
  if (!valid_pool(a.pool)) return;
  Pool& p = g_pools[a.pool];
  Region& region = p.regions[a.region];
  release_range(region, reinterpret_cast<uintptr_t>(ptr) - region.base, a.size);
  p.bytes_in_use -= a.size;
  p.live_allocations -= 1;
}

}  // extern "C"
