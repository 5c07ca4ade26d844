// Large tensors of the tonp ops (gradients, activations: hundreds of MB per training step) come
// from a pool of blocks kept mapped after their tensors die, as CUDA's caching allocator keeps
// device memory. Fresh memory costs a page fault and a zeroed page per 4 KB on first touch:
// on the 30B-A3B layer the MoE backward spent more time there than in its GEMMs. A block is
// reused for the next request of its rounded size or up to half its size (training steps repeat
// their shapes; a rollout's prefill changes its row count every call, and a fresh block for each
// new count cost the batch-64 prefill 1.4x its time on the AMD EPYC); new blocks are 2 MB aligned
// with transparent huge pages requested. Freed blocks beyond
// TONP_POOL_MB (default 4096) of idle memory go back to the system; tonp.release_memory_pool()
// (torch.ops.tonp.release_memory_pool) returns all idle blocks. TONP_HUGE_PAGES=0: no THP advice.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "ops_common.h"

namespace tonp {
namespace {

constexpr size_t kHuge = size_t(2) << 20;   // rounding and alignment of a block
constexpr size_t kMinBytes = size_t(4) << 20;  // smaller tensors: plain at::empty

bool env_off(const char* name) {
  const char* v = std::getenv(name);
  return v && v[0] == '0';
}

struct Pool {
  std::mutex mu;
  std::multimap<size_t, void*> idle;            // block size -> block
  std::unordered_map<void*, size_t> live;       // block -> block size
  size_t idle_bytes = 0;
  const size_t cap = [] {
    const char* v = std::getenv("TONP_POOL_MB");
    return (v ? size_t(std::strtoull(v, nullptr, 10)) : size_t(4096)) << 20;
  }();

  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> g(mu);
      // The smallest idle block that holds `bytes`, if it is at most twice that.
      auto it = idle.lower_bound(bytes);
      if (it != idle.end() && it->first <= 2 * bytes) {
        void* p = it->second;
        const size_t have = it->first;
        idle.erase(it);
        idle_bytes -= have;
        live[p] = have;
        return p;
      }
    }
    void* p = std::aligned_alloc(kHuge, bytes);
    TORCH_CHECK(p, "tonp: out of memory allocating ", bytes, " bytes");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    static const bool no_thp = env_off("TONP_HUGE_PAGES");
    if (!no_thp) madvise(p, bytes, MADV_HUGEPAGE);
#endif
    std::lock_guard<std::mutex> g(mu);
    live[p] = bytes;
    return p;
  }

  void give_back(void* p) {
    std::unique_lock<std::mutex> g(mu);
    const auto it = live.find(p);
    const size_t bytes = it->second;
    live.erase(it);
    if (idle_bytes + bytes <= cap) {
      idle.emplace(bytes, p);
      idle_bytes += bytes;
      return;
    }
    g.unlock();
    std::free(p);
  }

  void release() {
    std::lock_guard<std::mutex> g(mu);
    for (auto& kv : idle) std::free(kv.second);
    idle.clear();
    idle_bytes = 0;
  }
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: tensors may outlive static destruction
  return *p;
}

void release_memory_pool() { pool().release(); }

}  // namespace

bool poison_memory() {
  static const bool on = [] {
    const char* v = std::getenv("TONP_POISON");
    return v && v[0] == '1';
  }();
  return on;
}

at::Tensor empty_big(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  static const bool off = env_off("TONP_POOL_MB");
  const size_t bytes = size_t(c10::multiply_integers(sizes)) * c10::elementSize(c10::typeMetaToScalarType(opts.dtype()));
  if (off || bytes < kMinBytes || !opts.device().is_cpu()) return at::empty(sizes, opts);
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = pool().take(rounded);
  if (poison_memory()) std::memset(p, 0xff, rounded);
  return at::from_blob(p, sizes, [](void* q) { pool().give_back(q); }, opts);
}

at::Tensor empty_huge(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  const size_t bytes = size_t(c10::multiply_integers(sizes)) * c10::elementSize(c10::typeMetaToScalarType(opts.dtype()));
  if (bytes < kMinBytes || !opts.device().is_cpu() || env_off("TONP_HUGE_PAGES")) return at::empty(sizes, opts);
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // A fresh mapping, never memory malloc hands back from its heap: pages a previous tensor already
  // faulted in stay 4 KB whatever the advice (khugepaged may merge them, much later). The
  // mapping is cut to a 2 MB aligned span and advised before its first touch.
  const size_t span = rounded + kHuge;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(raw != MAP_FAILED, "tonp: out of memory mapping ", span, " bytes");
  char* const lo = static_cast<char*>(raw);
  char* const p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(lo) + kHuge - 1) & ~uintptr_t(kHuge - 1));
  if (p > lo) munmap(lo, size_t(p - lo));
  if (lo + span > p + rounded) munmap(p + rounded, size_t(lo + span - (p + rounded)));
  madvise(p, rounded, MADV_HUGEPAGE);
  return at::from_blob(p, sizes, [rounded](void* q) { munmap(q, rounded); }, opts);
#else
  void* p = std::aligned_alloc(kHuge, rounded);
  TORCH_CHECK(p, "tonp: out of memory allocating ", rounded, " bytes");
  return at::from_blob(p, sizes, [](void* q) { std::free(q); }, opts);
#endif
}

// A contiguous copy of t in empty_huge memory (the same bits): a model's weights, which every
// decode step streams whole. Where empty_huge gives plain memory, a plain copy.
at::Tensor huge_pages_copy(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "tonp.huge_pages_copy: expected a CPU tensor, got one on ", t.device());
  at::Tensor out = empty_huge(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  out.copy_(t);
  return out;
}

TORCH_LIBRARY_FRAGMENT(tonp, m) {
  m.def("release_memory_pool() -> ()", &release_memory_pool);
  m.def("huge_pages_copy(Tensor t) -> Tensor", &huge_pages_copy);
}

}  // namespace tonp
