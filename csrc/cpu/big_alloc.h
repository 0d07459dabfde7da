// Buffers of many megabytes that a call fills at once (the direct walk's scratch past what a
// thread keeps between calls): allocated on 2 MiB boundaries and marked for transparent huge
// pages, so that the kernel maps them 2 MiB at a time instead of faulting in each 4 KiB page
// (where the system's setting is "madvise"; "always" maps them so anyway, "never" not at all).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "policy.h"

namespace scatter_add {
namespace cpu {

// Buffers big_alloc has placed on 2 MiB boundaries, in this process (for tests).
inline std::atomic<int64_t>& huge_allocations() {
  static std::atomic<int64_t> count{0};
  return count;
}

constexpr size_t kHugePage = size_t(2) << 20;

// Asks for huge pages for the whole 2 MiB pages inside [p, p + bytes) (advice only: a refusal
// leaves 4 KiB pages).
inline void advise_huge(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~uintptr_t(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~uintptr_t(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

inline void* big_alloc(size_t bytes) {
  if (bytes == 0) bytes = 1;
  constexpr size_t kHuge = kHugePage;
  if (bytes < static_cast<size_t>(CpuPolicy::kHugePagesFromBytes)) {
    void* p = std::malloc(bytes);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  if (bytes > SIZE_MAX - kHuge) throw std::bad_alloc();  // the rounding below would wrap
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, rounded);
  if (p == nullptr) throw std::bad_alloc();
  advise_huge(p, rounded);
  huge_allocations().fetch_add(1, std::memory_order_relaxed);
  return p;
}

inline void big_free(void* p) { std::free(p); }

// Gives an empty vector room for n elements, asking for huge pages for the whole 2 MiB pages of a
// large new buffer before anything touches it (its start is wherever the allocator puts it).
template <class T>
void reserve_huge(std::vector<T>& v, size_t n) {
  if (n <= v.capacity()) return;
  v.clear();
  v.reserve(n);
  if (n * sizeof(T) >= static_cast<size_t>(CpuPolicy::kHugePagesFromBytes)) advise_huge(v.data(), n * sizeof(T));
}

}  // namespace cpu
}  // namespace scatter_add
