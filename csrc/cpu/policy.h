// Tuning constants of the CPU path, in one place (habit 6 of shared/DESIGN.md).
#pragma once

#include <cstdint>

namespace scatter_add {
namespace cpu {

struct CpuPolicy {
  // Below this many bytes of memory traffic per thread, fewer threads are used: an OpenMP fork
  // and join costs a few microseconds, about what 64 KiB of streaming takes on one core.
  static constexpr int64_t kMinBytesPerThread = 64 << 10;
  // Work split: a destination row costs (its contributions + kRowCost) row-transfers, since the
  // row is read and written once. Split points inside a row fall on kColumnAlign elements
  // (128 B of bf16, a multiple of every vector width) so threads never share a cache line
  // except at unaligned row ends.
  static constexpr int64_t kRowCost = 2;
  static constexpr int64_t kColumnAlign = 64;
  // Plan building: a counting sort costs O(N + K); above N > kSortRatio * K + kSortSlack a
  // comparison sort of (row, source) pairs, O(K log K), avoids touching a histogram of N.
  static constexpr int64_t kSortRatio = 8;
  static constexpr int64_t kSortSlack = 4096;
};

}  // namespace cpu
}  // namespace scatter_add
