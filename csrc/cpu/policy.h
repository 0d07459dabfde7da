// The CPU cost model's constants, in one place. Each cites the measurement behind it; they were
// taken on a 2-core Xeon (Sapphire Rapids, AVX-512 + AVX-512 BF16) with the C++ microbenchmark
// (`.build/release/benchmarks/bench_scatter_add --strategies`, forced strategies), single thread
// unless stated. They rank strategies; they need not be exact, only right about which is cheaper.
#pragma once

#include <cstdint>

namespace scatter_add {
namespace cpu {

struct CpuPolicy {
  // --- threads -------------------------------------------------------------------------------
  // Below this many bytes of memory traffic per thread, fewer threads are used: an OpenMP fork
  // and join costs a few microseconds, about what 64 KiB of streaming takes on one core.
  static constexpr int64_t kMinBytesPerThread = 64 << 10;

  // --- planned rows (count / radix) ----------------------------------------------------------
  // Work split: a destination row costs (its contributions + kRowCost) row-transfers, since the
  // row is read and written once. Split points inside a row fall on kColumnAlign elements
  // (128 B of bf16, a multiple of every vector width) so threads never share a cache line
  // except at unaligned row ends.
  static constexpr int64_t kRowCost = 2;
  static constexpr int64_t kColumnAlign = 64;

  // --- plan building -------------------------------------------------------------------------
  // Counting sort: zeroing and scanning the N-row histogram, and per kept entry (count + place).
  static constexpr double kCountNsPerRow = 1.0;
  static constexpr double kCountNsPerEntry = 3.0;
  // Radix sort: digits of at most kRadixDigitBits bits; per entry and pass (count + scatter),
  // and per bucket and pass (clear + prefix).
  static constexpr int kRadixDigitBits = 11;
  static constexpr double kRadixNsPerEntryPass = 2.5;
  static constexpr double kRadixNsPerBucket = 1.0;

  // --- strategy choice -----------------------------------------------------------------------
  // Per contribution: the direct walk's fixed cost, and the planned walk's (sources, offsets).
  static constexpr double kDirectNsPerEntry = 1.5;
  static constexpr double kPlannedNsPerEntry = 2.0;
  // Per destination row of the planned walk (row pointer, accumulator load and store).
  static constexpr double kPlannedNsPerRow = 2.0;
  // Per byte moved to or from memory, streamed and at random rows (a row of a few cache lines
  // read at a random place costs more per byte than a stream).
  static constexpr double kNsPerByteStream = 0.1;
  static constexpr double kNsPerByteRandom = 0.25;
  // The direct walk re-reads and re-writes a destination row per contribution: from cache while
  // the touched rows fit in kCacheBytes, from memory beyond.
  static constexpr int64_t kCacheBytes = 8 << 20;
  // bf16/fp16 rows hit by several contributions take the scratch (float32) form of the direct
  // walk: per row of N (bitmap and rank) and per touched row byte (copy in and out).
  static constexpr double kScratchNsPerRow = 0.05;

  // Direct with several threads: split columns when each thread gets at least this many bytes
  // of every row (whole cache lines, and a balanced split whatever the index), rows otherwise.
  static constexpr int64_t kMinColumnShareBytes = 128;
  // The direct walk prefetches destination rows ahead only when out is larger than this (a
  // cache-resident out gains nothing and the prefetch costs a third of a D = 1 walk).
  static constexpr int64_t kPrefetchAboveBytes = 1 << 20;
  // Row split: a sample of kBalanceSamples index entries is counted per block of 2^shift rows
  // (at most kMaxBlocks blocks) to cut the rows into shares of equal work.
  static constexpr int64_t kMaxBlocks = 4096;
  static constexpr int64_t kBalanceSamples = 16384;
};

}  // namespace cpu
}  // namespace scatter_add
