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

inline void* big_alloc(size_t bytes) {
  if (bytes == 0) bytes = 1;
  constexpr size_t kHuge = size_t(2) << 20;
  if (bytes < static_cast<size_t>(CpuPolicy::kHugePagesFromBytes)) {
    void* p = std::malloc(bytes);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  if (bytes > SIZE_MAX - kHuge) throw std::bad_alloc();  // the rounding below would wrap
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, rounded);
  if (p == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(p, rounded, MADV_HUGEPAGE);  // advice only: a refusal leaves 4 KiB pages
#endif
  huge_allocations().fetch_add(1, std::memory_order_relaxed);
  return p;
}

inline void big_free(void* p) { std::free(p); }

}  // namespace cpu
}  // namespace scatter_add
