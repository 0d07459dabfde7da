// The kernels, written once over an "Ops" struct that each ISA translation unit defines:
//   storage  element type in memory (float, double, uint16_t for bf16/fp16)
//   acc      accumulator scalar (float, or double for f64)
//   vec      a register of `width` accumulators
//   elem     scalar conversions: elem::get(storage) -> acc, elem::put(acc) -> storage (RNE)
//   load(const storage*) -> vec, store(storage*, vec), load_part/store_part(p, [v,] m) for the
//   first m < width elements, add(vec, vec), mul(vec, vec), fmadd(a, b, c) = a*b + c with one
//   rounding, set1(acc) -> vec, load_acc(const acc*) / store_acc(acc*, vec) on accumulators and
//   their _part forms for the first m < width; store_lanes(storage*, vec, lanes) stores the
//   elements whose bit (element q: bit q) is set and writes nothing else (another call may be
//   updating the others); differ(const acc*, const acc*) -> the bits of the width elements whose
//   bit patterns differ.
// Every path performs the same operations per element (see kernels.h), so every ISA level, kernel
// and split gives the same bits. Internal linkage on purpose (see convert.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kernels.h"

namespace scatter_add {
namespace cpu {
namespace {

// A row another thread owns (outside [lo, lo + span)) is not prefetched: a prefetch for writing
// would pull that thread's line away from it on every entry. Its own first row stands in (a select,
// no branch).
inline uint64_t own_row(uint64_t row, uint64_t lo, uint64_t span) { return row - lo < span ? row : lo; }

// Where a bf16/fp16 direct walk keeps a row's float32 sum: dense, a slot per row, all filled from
// out in advance; sparse, slots only for the rows named more than once (slot_bits / slot_base),
// the others added in place; touched, a slot per row filled by the row's first contribution.
enum class Slots { dense, sparse, touched };

// Rows of at most this many columns are added element by element, in the direct walks: a masked
// vector load and store per contribution cost more than a few scalar ones, most where a row comes
// back soon (a load from a masked store in flight waits for it). One thread, thread CPU time,
// K = 1M, base -> scalar: D = 2 float32 N = 100k 3.9-4.1 -> 2.3 ms, N = 10k 3.2-3.5 -> 1.7-1.8 ms;
// D = 2 bf16 (float32 scratch) N = 1M 17-24 -> 14-18 ms, N = 100k 5.1-5.3 -> 4.0 ms; D = 4 float32
// N = 100k 4.7-5.4 -> 3.1-3.4 ms; D = 4 bf16 N = 100k 6.4-7.4 -> 5.2-6.1 ms; D = 8 within noise.
constexpr int64_t kScalarCols = 4;

// The first cache line of row `row` of a matrix of row_bytes per row: rows of one line, or rows
// the hardware prefetchers follow once their first line is in.
inline void prefetch_at(const void* base, uint64_t row, uint64_t row_bytes, int rw = 0) {
  // Unsigned arithmetic: an ignored index (any value) must not make the address computation UB.
  const uintptr_t p = reinterpret_cast<uintptr_t>(base) + row * row_bytes;
  if (rw)
    __builtin_prefetch(reinterpret_cast<const void*>(p), 1);
  else
    __builtin_prefetch(reinterpret_cast<const void*>(p), 0);
}

// Every cache line of the `bytes` bytes at base + row * row_bytes. A row of several lines
// prefetched by its first line alone stalls on the others (the hardware prefetchers do not follow
// a random row).
inline void prefetch_lines_at(const void* base, uint64_t row, uint64_t row_bytes, uint64_t bytes, int rw = 0) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(base) + row * row_bytes;
  for (uintptr_t a = p & ~uintptr_t(63); a < p + bytes; a += 64) {
    if (rw)
      __builtin_prefetch(reinterpret_cast<const void*>(a), 1);
    else
      __builtin_prefetch(reinterpret_cast<const void*>(a), 0);
  }
}

// n bytes from s to d, the whole aligned vectors of d by non-temporal stores (the ends by
// memcpy): a large gather's rows go to memory without being read into the cache first. They are
// weakly ordered: stream_fence() before anything else reads them.
inline void stream_copy(void* d, const void* s, size_t n) {
#if defined(__AVX512F__)
  constexpr size_t kV = 64;
#elif defined(__AVX__)
  constexpr size_t kV = 32;
#elif defined(__SSE2__)
  constexpr size_t kV = 16;
#else
  constexpr size_t kV = 0;
#endif
  char* dp = static_cast<char*>(d);
  const char* sp = static_cast<const char*>(s);
  if constexpr (kV > 0) {
    const size_t head = std::min(n, (kV - reinterpret_cast<uintptr_t>(dp) % kV) % kV);
    std::memcpy(dp, sp, head);
    dp += head;
    sp += head;
    n -= head;
    for (; n >= kV; n -= kV, dp += kV, sp += kV) {
#if defined(__AVX512F__)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dp), _mm512_loadu_si512(sp));
#elif defined(__AVX__)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dp), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)));
#elif defined(__SSE2__)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dp), _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)));
#endif
    }
  }
  std::memcpy(dp, sp, n);
}

// A copy of Bytes (a constant) bytes, inlined: whole 32-byte vectors where the ISA has them.
// GCC expands a constant memcpy into 16-byte moves (its generic tuning splits unaligned 32-byte
// ones), twice the loads and stores. Gathers of such rows, this build and the memcpy one loaded
// in one process, alternated with index_select (2-vCPU EPYC without AVX-512, two threads,
// medians of 300 calls, two runs), speedup over index_select with memcpy -> with these:
// bfloat16 N = 33 K = 32768 D = 128 0.94-1.02x -> 1.10-1.11x, N = 6554 K = 65536 D = 64 1.04x
// -> 1.19x, float32 N = 65536 K = 6554 D = 64 1.03-1.10x -> 1.22-1.31x; into a float32 dst of
// 16 MiB, bound by its writes, the same within the spread (N = 66 K = 65536 D = 64 1.01x ->
// 1.00-1.05x, N = 655 1.12-1.13x -> 1.10x).
template <size_t Bytes>
inline void fixed_copy(void* d, const void* s) {
#if defined(__AVX__)
  if constexpr (Bytes >= 32 && Bytes % 32 == 0) {
    for (size_t b = 0; b < Bytes / 32; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<char*>(d) + 32 * b),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const char*>(s) + 32 * b)));
    return;
  }
#endif
  std::memcpy(d, s, Bytes);
}

inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Sources first, first + 1, ... (a run of a sorted index), indexed like the plan's source array.
struct Consecutive {
  int64_t first;
  int64_t operator[](int64_t k) const { return first + k; }
};

template <class Ops>
struct RowKernels {
  using T = typename Ops::storage;
  using A = typename Ops::acc;
  using V = typename Ops::vec;
  using E = typename Ops::elem;
  static constexpr int W = Ops::width;
  static constexpr int kUnroll = 4;
  // Hot-row path above this many contributions, for column ranges of kBufferMinBlocks register
  // blocks (kUnroll * W columns) or more; its buffer of sums holds kBufferBytes (a column chunk of
  // that many bytes of accumulators). The register path walks every source once per block, and
  // each walk pays a cache miss per source row; the buffered one walks them once, at the price of
  // a load and a store of the buffer per vector. EPYC, one thread, count plan, the 59k sources of
  // a hot row (8 KiB apart) added over a column window, ms, register / buffered: float32 64
  // columns 2.3-2.5 / 3.0-4.2, 128 4.7-6.8 / 5.1-6.8, 256 10.5-10.9 / 8.7-10.7, 512 21.2 /
  // 13.7-16.4, 1008 42.7-47.0 / 21.7-27.8; bf16 64 1.6-2.3 / 2.8-3.4, 128 2.9-3.6 / 4.1-5.6,
  // 256 8.5-10.1 / 7.0-9.1, 1008 37.8-39.7 / 18.1-20.3. With sources in cache (K = 64 and 512,
  // 128 to 1008 columns) the two were within 10% except float32 K = 512 w = 1008 (34-45 / 32 us).
  // The threshold was once 1024 columns, which sent the second thread's share of a two-way split
  // float32 hot row (D = 2048, columns 1280 to 2048) down the register path: 40-60 ms against
  // 22 ms for columns 1024 to 2048.
  static constexpr int64_t kManyContributions = 8;
  static constexpr int64_t kBufferMinBlocks = 4;
  static constexpr int64_t kBufferMinCols = kBufferMinBlocks * kUnroll * W;
  static constexpr int64_t kBufferBytes = 16 << 10;
  static constexpr int64_t kBufferCap = kBufferBytes / static_cast<int64_t>(sizeof(A));
  static_assert(kBufferCap % W == 0, "the buffer's last vector stays inside it");
  // Software prefetch distance inside a long row, in elements (512 B of bf16).
  static constexpr int64_t kPrefetchCols = 256;
  // Rows of more than one line and at most kNearRowBytes of columns (kFarNearRowBytes in a walk
  // over more bytes than the caches hold, RowsJob::far), in a plan: each source row
  // is prefetched whole (every line: the hardware prefetchers do not follow a random row) about
  // kPrefetchBytes ahead of its add, between 2 and kNearAheadMax entries ahead, and each
  // destination row kOutRowsAhead rows ahead; longer rows are streamed kPrefetchCols ahead inside
  // the row, rows of one line prefetch their first line kPrefetchAhead entries ahead. Count
  // strategy, one thread, thread CPU time, best of 4 runs of 7, before (the first line of a
  // source row kPrefetchAhead entries ahead up to 256 B, 512 B ahead inside the row beyond) ->
  // after: float32 D = 128 N = K = 65536 6.1 -> 4.7 ms, bf16 D = 64 N = K = 262144 16.9 -> 14.9 ms,
  // D = 256 N = K = 65536 9.1 -> 7.8 ms, D = 512 N = K = 32768 6.3 -> 5.6 ms; hot rows and rows
  // of one line within 4%.
  static constexpr int64_t kNearRowBytes = 1024;
  // Through the torch op, 2 threads, Zen 5 EPYC, medians of 15 calls, best of 3 runs alternated
  // with the build before, rows of 2 KiB prefetched whole / streamed: bf16 D = 1024 N = 16384
  // K = 32768 0.69x, float32 D = 512 N = K = 16384 0.74x; but in the caches 1.10-1.19x (bf16
  // D = 1024: N = K = 4096, N = 410 K = 4096, N = 4096 K = 410, MoE top-2 N = 2048 K = 4096).
  static constexpr int64_t kFarNearRowBytes = 2048;
  // Longer rows stream kPrefetchCols ahead inside each row, which leaves the start of every
  // source row and of the destination row to miss as the row begins. Their first kHeadBytes are
  // prefetched kHeadAhead entries (sources) and rows (destination) ahead, across rows. Count
  // plan, two threads, best of 6 alternated runs: bf16 D = 1024 N = 16384 K = 32768 (MoE top-2)
  // 6.2 -> 5.2 ms, N = K = 65536 uniform 17.5 -> 15.1 ms (1.2-1.5x in earlier sets of runs);
  // float32 top-2 D = 2048 1.05x, D = 4096 0.99x. Through the torch op, alternated with the
  // build before: bf16 top-2 rows of 2-8 KiB 1.05-1.18x, D = 1024 uniform 1.36x, float32 rows of
  // 2-16 KiB 0.97-1.08x. A head of kPrefetchCols elements (1 KiB of float32) instead: float32
  // 0.94-1.05x; whole rows prefetched as for the shorter rows: 1.1x slower at D = 1024 bf16.
  static constexpr int64_t kHeadBytes = 512;
  static constexpr int64_t kHeadAhead = 2;
  // kPrefetchBytes ahead, at most kNearAheadMax entries: 2 KiB and 16 entries before. The C++
  // random-rows cells (bench_scatter_add --random-rows, 2 threads, Zen 5 EPYC, best of 3 rounds
  // alternated with the build before): bf16 D = 256 N = K = 65536 1.58 -> 1.18 ms, D = 64 N = K =
  // 262144 3.07 -> 2.82 ms, float32 D = 256 N = K = 65536 2.54 -> 2.25 ms, the rest within 2%.
  // 16 KiB and 128 entries gave the same as 8 KiB.
  static constexpr int64_t kPrefetchBytes = 8192;
  static constexpr int64_t kNearAheadMax = 64;
  static constexpr int64_t kOutRowsAhead = 8;
  static constexpr int64_t kPrefetchAhead = 16;
  // A row with more contributions than `ahead` (a hot row, whose sources come in increasing
  // order, which the hardware prefetchers partly follow) prefetches the rest of its sources as
  // rows of one line do up to kHotLineRowBytes, inside the row beyond.
  static constexpr int64_t kHotLineRowBytes = 256;
  static constexpr int64_t kLineBytes = 64;
  static constexpr int64_t entries_ahead(int64_t row_bytes) {
    return std::min<int64_t>(kNearAheadMax, std::max<int64_t>(2, kPrefetchBytes / std::max<int64_t>(row_bytes, 1)));
  }

  // mask (all ones or zero) ? a : b, without a branch: bitwise operations in the vector
  // registers the values live in (a compiler turns a plain a ? b : c into a branch).
  static A select_acc(uintptr_t mask, A a, A b) {
#if defined(__SSE2__)
    if constexpr (sizeof(A) == 4) {
      const __m128 m = _mm_castsi128_ps(_mm_cvtsi32_si128(static_cast<int>(mask)));
      return _mm_cvtss_f32(_mm_or_ps(_mm_and_ps(m, _mm_set_ss(a)), _mm_andnot_ps(m, _mm_set_ss(b))));
    } else {
      const __m128d m = _mm_castsi128_pd(_mm_cvtsi64_si128(static_cast<long long>(mask)));
      return _mm_cvtsd_f64(_mm_or_pd(_mm_and_pd(m, _mm_set_sd(a)), _mm_andnot_pd(m, _mm_set_sd(b))));
    }
#else
    return mask ? a : b;
#endif
  }

  template <bool Weighted>
  static V step(V acc, V x, V w) {
    return Weighted ? Ops::fmadd(x, w, acc) : Ops::add(acc, x);
  }
  template <bool Weighted>
  static A step1(A acc, A x, A w) {
    return Weighted ? std::fma(x, w, acc) : acc + x;
  }

  // ---- planned rows -------------------------------------------------------------------------

  // One out row's columns [c0, c1) += its n contributions ids[0..n) in order (ids: the plan's
  // source array, or Consecutive sources). Prefetching: `inside`, kPrefetchCols ahead inside the
  // rows (long rows, and consecutive sources, where that reaches the next rows); and contributions
  // k < fetch_end prefetch the first line of source ids[k + kPrefetchAhead].
  template <bool Weighted, class Ids>
  static void add_row(T* out, const T* src, int64_t stride, Ids ids, int64_t n, const A* w, int64_t c0, int64_t c1,
                      bool inside, int64_t fetch_end) {
    const uint64_t sb = static_cast<uint64_t>(stride) * sizeof(T);
    if (n > kManyContributions && c1 - c0 >= kBufferMinCols) {
      add_row_buffered<Weighted>(out, src, stride, ids, n, w, c0, c1);
      return;
    }
    if (W == 1 || c1 - c0 == 1) {  // one column: scalar
      for (int64_t c = c0; c < c1; ++c) {
        A acc = E::get(out[c]);
        for (int64_t k = 0; k < n; ++k) {
          if (k < fetch_end) prefetch_at(src + c, static_cast<uint64_t>(ids[k + kPrefetchAhead]), sb);
          acc = step1<Weighted>(acc, E::get(src[ids[k] * stride + c]), Weighted ? w[ids[k]] : A(1));
        }
        out[c] = E::put(acc);
      }
      return;
    }
    int64_t c = c0;
    for (; c + kUnroll * W <= c1; c += kUnroll * W) {
      V acc[kUnroll];
      if (inside) __builtin_prefetch(out + c + kPrefetchCols, 1);
      for (int u = 0; u < kUnroll; ++u) acc[u] = Ops::load(out + c + u * W);
      for (int64_t k = 0; k < n; ++k) {
        const T* s = src + ids[k] * stride + c;
        if (inside)
          __builtin_prefetch(s + kPrefetchCols);
        else if (k < fetch_end)
          prefetch_at(src + c, static_cast<uint64_t>(ids[k + kPrefetchAhead]), sb);
        const V wk = Ops::set1(Weighted ? w[ids[k]] : A(1));
        for (int u = 0; u < kUnroll; ++u) acc[u] = step<Weighted>(acc[u], Ops::load(s + u * W), wk);
      }
      for (int u = 0; u < kUnroll; ++u) Ops::store(out + c + u * W, acc[u]);
    }
    for (; c < c1; c += W) {
      const int64_t m = (c1 - c < W) ? (c1 - c) : W;
      V acc = (m == W) ? Ops::load(out + c) : Ops::load_part(out + c, m);
      for (int64_t k = 0; k < n; ++k) {
        const T* s = src + ids[k] * stride + c;
        if (k < fetch_end) prefetch_at(src + c, static_cast<uint64_t>(ids[k + kPrefetchAhead]), sb);
        const V x = (m == W) ? Ops::load(s) : Ops::load_part(s, m);
        acc = step<Weighted>(acc, x, Ops::set1(Weighted ? w[ids[k]] : A(1)));
      }
      if (m == W) {
        Ops::store(out + c, acc);
      } else {
        Ops::store_part(out + c, acc, m);
      }
    }
  }

  // Rows with many contributions (hot rows): keep a column chunk's running sums in an L1 buffer
  // and stream each source row's chunk contiguously, instead of striding across all source rows
  // once per register block. Same operations in the same order, so the same bits.
  // A chunk of at most kNearRowBytes prefetches its source rows whole, entries_ahead of the add,
  // as add_rows does for such rows; a longer chunk prefetches the next source's first line. The
  // first line alone left the rest of each scattered row to miss: count strategy, two threads, the
  // sweep's timing interleaved with index_add_ (bench_sweep.run_cell), 2-vCPU EPYC without
  // AVX-512, two runs, speedup over index_add_ before -> after: float32 D = 128 K = 32768 N = 33
  // 1.12-1.16x -> 1.43-1.74x, N = 328 1.41x -> 1.56-1.80x; N = 64 K = 65536 1.43-1.48x ->
  // 1.59-1.67x; N = 16 K = 8192 0.96-1.05x -> 1.08-1.25x; D = 256 N = 164 K = 16384 1.25x ->
  // 1.42-1.60x; bfloat16 D = 128 N = 33 K = 32768 1.20-1.21x -> 1.39-1.49x. Whole chunks of up to
  // 16 KiB were slower: float32 N = 10 K = 1024 D = 4096 0.95-1.03x -> 0.80x.
  template <bool Weighted, class Ids>
  static void add_row_buffered(T* out, const T* src, int64_t stride, Ids ids, int64_t n,
                               const A* w, int64_t c0, int64_t c1) {
    alignas(64) A buf[kBufferCap];
    const uint64_t sb = static_cast<uint64_t>(stride) * sizeof(T);
    for (int64_t cb = c0; cb < c1; cb += kBufferCap) {
      const int64_t m = (c1 - cb < kBufferCap) ? (c1 - cb) : kBufferCap;
      const int64_t full = m - m % W;
      const int64_t chunk = m * static_cast<int64_t>(sizeof(T));
      const bool whole = chunk <= kNearRowBytes;
      const int64_t ahead = whole ? entries_ahead(chunk) : 1;
      if (whole)
        for (int64_t k = 0; k < std::min(n, ahead); ++k)
          prefetch_lines_at(src + cb, static_cast<uint64_t>(ids[k]), sb, static_cast<uint64_t>(chunk));
      for (int64_t c = 0; c < full; c += W) Ops::store_acc(buf + c, Ops::load(out + cb + c));
      if (full < m) Ops::store_acc(buf + full, Ops::load_part(out + cb + full, m - full));
      for (int64_t k = 0; k < n; ++k) {
        const T* s = src + ids[k] * stride + cb;
        if (k + ahead < n) {
          if (whole)
            prefetch_lines_at(src + cb, static_cast<uint64_t>(ids[k + ahead]), sb, static_cast<uint64_t>(chunk));
          else
            __builtin_prefetch(src + ids[k + 1] * stride + cb);
        }
        const V wk = Ops::set1(Weighted ? w[ids[k]] : A(1));
        for (int64_t c = 0; c < full; c += W)
          Ops::store_acc(buf + c, step<Weighted>(Ops::load_acc(buf + c), Ops::load(s + c), wk));
        if (full < m)
          Ops::store_acc(buf + full,
                         step<Weighted>(Ops::load_acc(buf + full), Ops::load_part(s + full, m - full), wk));
      }
      for (int64_t c = 0; c < full; c += W) Ops::store(out + cb + c, Ops::load_acc(buf + c));
      if (full < m) Ops::store_part(out + cb + full, Ops::load_acc(buf + full), m - full);
    }
  }

  template <bool Weighted>
  static void add_rows(const RowsJob& j, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    T* out = static_cast<T*>(j.out);
    const T* src = static_cast<const T*>(j.src);
    const A* w = static_cast<const A*>(j.w);
    const int64_t rb = (c1 - c0) * static_cast<int64_t>(sizeof(T));
    const uint64_t ob = static_cast<uint64_t>(j.out_stride) * sizeof(T), sb = static_cast<uint64_t>(j.src_stride) * sizeof(T);
    if (rb > (j.far ? kFarNearRowBytes : kNearRowBytes) || rb <= kLineBytes) {
      // Rows of one line prefetch the first line of the source kPrefetchAhead entries ahead,
      // across rows, and the destination row 4 rows ahead. Long rows stream inside, and get a
      // head start across rows (kHeadAhead).
      const bool one_line = rb <= kLineBytes;
      const uint64_t head = static_cast<uint64_t>(std::min<int64_t>(rb, kHeadBytes));
      int64_t next = j.offsets[r0];  // the first entry whose source's head is not prefetched yet
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = j.offsets[r], e = j.offsets[r + 1];
        if (one_line) {
          if (r + 4 < r1) prefetch_at(out + c0, static_cast<uint64_t>(j.rows[r + 4]), ob, 1);
        } else {
          for (const int64_t until = std::min(std::min(e, b + kHeadAhead) + kHeadAhead, j.num_sources); next < until; ++next)
            prefetch_lines_at(src + c0, static_cast<uint64_t>(j.sources[next]), sb, head);
          next = std::max(next, e);
          if (r + kHeadAhead < r1) prefetch_lines_at(out + c0, static_cast<uint64_t>(j.rows[r + kHeadAhead]), ob, head, 1);
        }
        add_row<Weighted>(out + j.rows[r] * j.out_stride, src, j.src_stride, j.sources + b, e - b, w, c0, c1,
                          !one_line, one_line ? j.num_sources - b - kPrefetchAhead : 0);
      }
      return;
    }
    // Whole source rows `ahead` entries ahead of the one being added, across destination rows (a
    // hot row's first `ahead` here, the rest by add_row).
    const int64_t ahead = entries_ahead(rb);
    int64_t next = j.offsets[r0];  // the first entry whose source row is not prefetched yet
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = j.offsets[r], e = j.offsets[r + 1];
      for (const int64_t until = std::min(std::min(e, b + ahead) + ahead, j.num_sources); next < until; ++next)
        prefetch_lines_at(src + c0, static_cast<uint64_t>(j.sources[next]), sb, static_cast<uint64_t>(rb));
      if (r + kOutRowsAhead < r1)
        prefetch_lines_at(out + c0, static_cast<uint64_t>(j.rows[r + kOutRowsAhead]), ob, static_cast<uint64_t>(rb), 1);
      const bool hot = e - b > ahead;
      add_row<Weighted>(out + j.rows[r] * j.out_stride, src, j.src_stride, j.sources + b, e - b, w, c0, c1,
                        hot && rb > kHotLineRowBytes, hot && rb <= kHotLineRowBytes ? e - b - kPrefetchAhead : 0);
      next = std::max(next, e);
    }
  }

  // ---- direct -------------------------------------------------------------------------------

  // out row o's m columns += wi * s (one contribution, rounded once).
  template <bool Weighted>
  static void add_once(T* o, const T* s, A wi, int64_t m) {
    if (W == 1 || m <= kScalarCols) {
      for (int64_t c = 0; c < m; ++c) o[c] = E::put(step1<Weighted>(E::get(o[c]), E::get(s[c]), wi));
      return;
    }
    const V wk = Ops::set1(wi);
    int64_t c = 0;
    for (; c + W <= m; c += W) Ops::store(o + c, step<Weighted>(Ops::load(o + c), Ops::load(s + c), wk));
    if (c < m)
      Ops::store_part(o + c, step<Weighted>(Ops::load_part(o + c, m - c), Ops::load_part(s + c, m - c), wk), m - c);
  }

  template <class I, bool Weighted>
  static void add_direct(const DirectJob& j, int64_t i0, int64_t i1, int64_t c0, int64_t c1) {
    const bool one = W == 1 || c1 - c0 <= kScalarCols;
    if (j.compact) {
      if (one)
        add_compact<I, Weighted, true>(j, i0, i1, c0, c1);
      else
        add_compact<I, Weighted, false>(j, i0, i1, c0, c1);
      return;
    }
    if (c1 - c0 == 1 && j.every_entry) {
      if (j.prefetch)
        add_direct_loop<I, Weighted, true, true, true, true>(j, i0, i1, c0, c1);
      else
        add_direct_loop<I, Weighted, false, true, true, true>(j, i0, i1, c0, c1);
    } else if (c1 - c0 == 1) {
      if (j.prefetch)
        add_direct_loop<I, Weighted, true, true, true>(j, i0, i1, c0, c1);
      else
        add_direct_loop<I, Weighted, false, true, true>(j, i0, i1, c0, c1);
    } else if (j.prefetch) {
      if (one)
        add_direct_loop<I, Weighted, true, true, false>(j, i0, i1, c0, c1);
      else
        add_direct_loop<I, Weighted, true, false, false>(j, i0, i1, c0, c1);
    } else {
      if (one)
        add_direct_loop<I, Weighted, false, true, false>(j, i0, i1, c0, c1);
      else
        add_direct_loop<I, Weighted, false, false, false>(j, i0, i1, c0, c1);
    }
  }
  // One contribution added into its row of m elements: element by element (Scalar) or by the
  // level's vectors.
  template <bool Weighted, bool Scalar>
  static inline void add_entry(T* __restrict o, const T* __restrict s, A wi, int64_t m) {
    if (Scalar) {
      for (int64_t c = 0; c < m; ++c) o[c] = E::put(step1<Weighted>(E::get(o[c]), E::get(s[c]), wi));
    } else {
      add_once<Weighted>(o, s, wi, m);
    }
  }
  // Scalar: the scalar level, or rows of a few columns (the per-element loop, no vector set-up).
  // One: a single column, known at compile time (no column loop). The pointers are restrict (out
  // and src never overlap): otherwise a store through out may alias every field of the job, which
  // the compiler then reloads per entry (one float32 column, N = 100k, K = 1M, one thread: 3.0 ->
  // 2.1-2.5 ms; a plain loop with no checks: 1.7-2.1 ms). Every (DirectJob::every_entry): no entry
  // to skip, so no test per entry (float32 D = 1, N = 1000, K = 1M, one thread, C++, four runs
  // alternated: 1.18-1.78 -> 1.01-1.08 ms).
  template <class I, bool Weighted, bool Prefetch, bool Scalar, bool One, bool Every = false>
  static void add_direct_loop(const DirectJob& j, int64_t i0, int64_t i1, int64_t c0, int64_t c1) {
    const I* __restrict idx = static_cast<const I*>(j.index);
    T* __restrict out = static_cast<T*>(j.out) + c0;
    const T* __restrict src = static_cast<const T*>(j.src) + c0;
    const A* __restrict w = static_cast<const A*>(j.w);
    const int64_t m = One ? 1 : c1 - c0, os = j.out_stride, ss = j.src_stride;
    const uint64_t ob = static_cast<uint64_t>(os) * sizeof(T);
    // Rows outside [lo, hi) (another thread's) and ignored entries are skipped with one unsigned
    // compare: an ignore_index outside [lo, hi) needs no test of its own.
    const uint64_t lo = static_cast<uint64_t>(j.row_lo), span = static_cast<uint64_t>(j.row_hi - j.row_lo);
    const bool ign_in_range = j.has_ignore && static_cast<uint64_t>(j.ignore) - lo < span;
    const int64_t ign = j.ignore;
    const int64_t pf_end = i1 - kPrefetchAhead;
    for (int64_t i = i0; i < i1; ++i) {
      if (Prefetch && i < pf_end)
        prefetch_at(out,
                    Every ? static_cast<uint64_t>(idx[i + kPrefetchAhead])
                          : own_row(static_cast<uint64_t>(idx[i + kPrefetchAhead]), lo, span),
                    ob, 1);
      const int64_t r = static_cast<int64_t>(idx[i]);
      if (!Every && (static_cast<uint64_t>(r) - lo >= span || (ign_in_range && r == ign))) continue;
      add_entry<Weighted, Scalar>(out + r * os, src + i * ss, Weighted ? w[i] : A(1), m);
    }
  }

  // A row split's in-place walk (DirectJob::compact): each block of kCompactBlock entries is first
  // compacted to this thread's own (a pass over its index with no branch), which are then added
  // in order, each one's destination and source rows prefetched whole kCompactAhead entries ahead
  // (out is larger than the caches where this runs, or, for rows of 256 bytes and more, at least
  // 1 MiB: CpuPolicy::kCompactWideMinOutBytes). Skipping the other thread's entries
  // inside the walk mispredicts a branch for about every other entry, and stalls on rows no
  // prefetch asked for.
  static constexpr int64_t kCompactBlock = 512;
  static constexpr int64_t kCompactAhead = 8;
  template <class I, bool Weighted, bool Scalar>
  static void add_compact(const DirectJob& j, int64_t i0, int64_t i1, int64_t c0, int64_t c1) {
    const I* __restrict idx = static_cast<const I*>(j.index);
    T* __restrict out = static_cast<T*>(j.out) + c0;
    const T* __restrict src = static_cast<const T*>(j.src) + c0;
    const A* __restrict w = static_cast<const A*>(j.w);
    const int64_t m = c1 - c0, os = j.out_stride, ss = j.src_stride;
    const uint64_t ob = static_cast<uint64_t>(os) * sizeof(T), sb = static_cast<uint64_t>(ss) * sizeof(T);
    const uint64_t bytes = static_cast<uint64_t>(m) * sizeof(T);
    const uint64_t lo = static_cast<uint64_t>(j.row_lo), span = static_cast<uint64_t>(j.row_hi - j.row_lo);
    const bool ign_in_range = j.has_ignore && static_cast<uint64_t>(j.ignore) - lo < span;
    const uint64_t ign = static_cast<uint64_t>(j.ignore);
    int32_t mine[kCompactBlock];
    for (int64_t b = i0; b < i1; b += kCompactBlock) {
      const int64_t e = std::min(i1, b + kCompactBlock);
      int64_t n = 0;
      for (int64_t i = b; i < e; ++i) {
        const uint64_t r = static_cast<uint64_t>(static_cast<int64_t>(idx[i]));
        mine[n] = static_cast<int32_t>(i - b);
        n += static_cast<int64_t>((r - lo < span) & !(ign_in_range && r == ign));
      }
      for (int64_t q = 0; q < n; ++q) {
        if (q + kCompactAhead < n) {
          const int64_t p = b + mine[q + kCompactAhead];
          prefetch_lines_at(out, static_cast<uint64_t>(static_cast<int64_t>(idx[p])), ob, bytes, 1);
          prefetch_lines_at(src, static_cast<uint64_t>(p), sb, bytes);
        }
        const int64_t i = b + mine[q];
        add_entry<Weighted, Scalar>(out + static_cast<int64_t>(idx[i]) * os, src + i * ss, Weighted ? w[i] : A(1), m);
      }
    }
  }

#if defined(__AVX512F__)
  // a + b, whose NaN is a's when both are NaN (x86 keeps the first source's), as the scalar walks
  // add acc + x: pinned by asm, where the compiler may swap a commutative add's operands (the
  // sign of a float16 NaN survives rounding, and would then depend on which walk took the entry).
  static __m512 add_first(__m512 a, __m512 b) {
    __m512 r;
    __asm__("vaddps %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
    return r;
  }

  // add_runs' walk of one-element bf16/fp16 rows (out and src: the column, src contiguous), 16
  // entries at a time from i while 16 remain: the same sums in the same order, each row's run
  // summed lane after lane from its row's value (or from acc, the sum carried in from the entries
  // before, for a run that began before the block) and stored where it ends, rounded a vector at
  // a time. A lane's sum needs the lane before it only inside a run, so a block takes one pass
  // per entry of its longest run. acc and prev (the last row added) carry the walk's state in
  // and out. Returns where it stopped: i1 less under 16, or the first block holding an ignored
  // entry (or, for int64 indices, a row past the int32 range), which the caller walks itself.
  // bf16 D = 1 sorted, one thread, direct strategy, C++ (medians of 15 calls, 6 runs alternated
  // with the walk one entry at a time): N = K = 1M (runs of 1.6) 5.0-6.2 -> 3.7-4.7 ms, N = 1M
  // K = 100k 0.53-0.62 -> 0.23-0.34 ms. Through the op, 2 threads, against torch's best in the same
  // rounds (geometric mean of 3 runs): N = K = 1M 1.12x -> 1.43x, N = 100k K = 1M (runs of 10,
  // which the run-by-run walk now takes: CpuPolicy::kLongRunRounded) 1.13x -> 1.32x, N = 1M K =
  // 100k 2.62x -> 3.36x.
  template <class I, bool Weighted>
  static int64_t add_run_blocks(const I* idx, T* out, int64_t os, const T* src, const A* w, int64_t i, int64_t i1,
                                bool has_ignore, int64_t ign, A& acc, int64_t& prev) {
    static_assert(W == 16 && sizeof(T) == 2, "16 float32 lanes of 2-byte rows");
    alignas(64) int32_t rv[16];
    alignas(64) T base[16];
    alignas(64) T rounded[16];
    alignas(64) A sums[16];
    const bool ign32 = has_ignore && ign >= INT32_MIN && ign <= INT32_MAX;
    for (; i + 16 <= i1; i += 16) {
      __m512i r;
      if constexpr (sizeof(I) == 4) {
        r = _mm512_loadu_si512(idx + i);
        if (ign32 && _mm512_cmpeq_epi32_mask(r, _mm512_set1_epi32(static_cast<int32_t>(ign))) != 0) return i;
      } else {
        const __m512i a = _mm512_loadu_si512(idx + i), b = _mm512_loadu_si512(idx + i + 8);
        const __m512i top = _mm512_set1_epi64(INT32_MAX);
        if ((_mm512_cmpgt_epu64_mask(a, top) | _mm512_cmpgt_epu64_mask(b, top)) != 0) return i;  // ignore_index too
        if (has_ignore && (_mm512_cmpeq_epi64_mask(a, _mm512_set1_epi64(ign)) |
                           _mm512_cmpeq_epi64_mask(b, _mm512_set1_epi64(ign))) != 0)
          return i;
        r = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(a)), _mm512_cvtepi64_epi32(b), 1);
      }
      _mm512_store_si512(rv, r);
      // prev fits an int32 lane here: rows do not decrease, and these fit.
      const __m512i before = _mm512_alignr_epi32(r, _mm512_set1_epi32(static_cast<int32_t>(prev)), 15);
      const __mmask16 start = _mm512_cmpneq_epi32_mask(r, before);
      __mmask16 end = _mm512_cmpneq_epi32_mask(r, _mm512_alignr_epi32(r, r, 1)) & 0x7FFF;
      if (i + 16 == i1 || static_cast<int64_t>(idx[i + 16]) != static_cast<int64_t>(rv[15])) end |= 0x8000;
      // Each lane's row value: where the block's rows lie within 32 consecutive rows of a
      // contiguous out, from one load of them (up to the last row only) and a permute; else one
      // load per lane. (Those 16 two-byte stores read back as one vector cost a failed store
      // forward: bf16 N = K = 1M sorted, one thread, 2.9-3.5 -> 2.4-2.5 ms.)
      const int32_t lo = rv[0], span = rv[15] - rv[0];
      const bool near = os == 1 && span < 32;
      const __m512i at32 = _mm512_sub_epi32(r, _mm512_set1_epi32(lo));
      if (near) {
        const __m512i rows = _mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint64_t(2) << span) - 1), out + lo);
        const __m512i at = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(at32));
        _mm256_store_si256(reinterpret_cast<__m256i*>(base),
                           _mm512_castsi512_si256(_mm512_permutexvar_epi16(at, rows)));
      } else {
        for (int l = 0; l < 16; ++l) base[l] = out[static_cast<int64_t>(rv[l]) * os];
      }
      V b = Ops::load(base);
      if ((start & 1) == 0) b = _mm512_mask_mov_ps(b, 1, _mm512_set1_ps(acc));
      const V v = Ops::load(src + i);
      V wv{};
      if constexpr (Weighted) wv = _mm512_loadu_ps(w + i);
      V s = Weighted ? _mm512_fmadd_ps(v, wv, b) : add_first(b, v);
      for (__mmask16 pending = static_cast<__mmask16>(~start & 0xFFFE); pending != 0;) {
        const __mmask16 ready = static_cast<__mmask16>(pending & ~(pending << 1));
        const V below = _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(s), _mm512_castps_si512(s), 15));
        s = _mm512_mask_mov_ps(s, ready, Weighted ? _mm512_fmadd_ps(v, wv, below) : add_first(below, v));
        pending = static_cast<__mmask16>(pending & ~ready);
      }
      if (near) {
        // The run ends' rounded sums placed at their rows' offsets from lo (compress the ending
        // lanes, expand them to the rows' positions, a half of 16 rows at a time) and written
        // by one masked store, where a store per run end cost a loop of scalar stores: bf16 N = K
        // = 1M sorted, one thread, 4 runs alternated, 3.0-3.7 -> 2.6-3.0 ms; float16, 2 threads,
        // 1.9-2.0 -> 1.3-1.5 ms; runs of 3 or more, within the noise (fewer ends a block).
        const __m512i vals = _mm512_cvtepu16_epi32(Ops::narrow(s));
        const uint32_t rows_end = static_cast<uint32_t>(
            _mm512_mask_reduce_or_epi32(end, _mm512_sllv_epi32(_mm512_set1_epi32(1), at32)));
        const __mmask16 low = _mm512_mask_cmplt_epi32_mask(end, at32, _mm512_set1_epi32(16));
        const __m512i a = _mm512_maskz_expand_epi32(static_cast<__mmask16>(rows_end),
                                                    _mm512_maskz_compress_epi32(low, vals));
        const __m512i b = _mm512_maskz_expand_epi32(static_cast<__mmask16>(rows_end >> 16),
                                                    _mm512_maskz_compress_epi32(end & ~low, vals));
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(a)),
                                                _mm512_cvtepi32_epi16(b), 1);
        _mm512_mask_storeu_epi16(out + lo, rows_end, both);
      } else {
        Ops::store(rounded, s);
        for (uint32_t e = end; e != 0; e &= e - 1) {
          const int l = __builtin_ctz(e);
          out[static_cast<int64_t>(rv[l]) * os] = rounded[l];
        }
      }
      _mm512_store_ps(sums, s);
      acc = sums[15];
      prev = rv[15];
    }
    return i;
  }
#endif

  // A sorted index: each row's contributions form one run of consecutive sources, summed like a
  // planned row (loaded once, accumulated in registers, rounded once) with no plan. Sources
  // [i0, i1) must start and end on run boundaries.
  template <class I, bool Weighted>
  static void add_runs(const DirectJob& j, int64_t i0, int64_t i1, int64_t c0, int64_t c1) {
    const I* idx = static_cast<const I*>(j.index);
    T* out = static_cast<T*>(j.out);
    const T* src = static_cast<const T*>(j.src);
    const A* w = static_cast<const A*>(j.w);
    const int64_t m = c1 - c0, os = j.out_stride, ss = j.src_stride;
    const bool has_ignore = j.has_ignore;
    const int64_t ign = j.ignore;
    if ((W == 1 || m == 1) && j.long_runs) {
      // Long runs: each summed in a register, one branch per run (predicted when runs are long).
      // The run's end is found in the loop that sums it: its compare runs beside the sum's chain,
      // where a separate scan ahead of the sum cost a pass of its own. The run going on is the
      // expected outcome, so that the compiler lays the loop out with one taken branch an entry;
      // laid out the other way (a jump to the loop's end and back on every entry) it ran slower,
      // by how much depending on where it fell in the code. C++, one thread, K = 1M sorted, three
      // runs alternated: float32 runs of 100 / 1000 1.63-1.72 / 1.48-1.54 -> 1.24-1.33 /
      // 1.16-1.25 ms, bf16 1.55-2.26 / 1.67-2.11 -> 1.19-1.54 / 1.29-1.54 ms; runs of 14 to 20
      // within the noise.
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t i = i0; i < i1;) {
          const I r = idx[i];
          if (has_ignore && static_cast<int64_t>(r) == ign) {
            while (++i < i1 && idx[i] == r) {}
            continue;
          }
          T* o = out + static_cast<int64_t>(r) * os + c;
          A acc = E::get(*o);
          do {
            acc = step1<Weighted>(acc, E::get(src[i * ss + c]), Weighted ? w[i] : A(1));
          } while (__builtin_expect(++i < i1 && idx[i] == r, 1));
          *o = E::put(acc);
        }
      return;
    }
    if constexpr (std::is_same_v<T, A>) {
      if (W == 1 || m == 1) {
        // float32 / float64 rows hold the running sum exactly: each contribution reads its row
        // and writes it back, with no dependency between rows.
        for (int64_t c = c0; c < c1; ++c)
          for (int64_t i = i0; i < i1; ++i) {
            const int64_t r = static_cast<int64_t>(idx[i]);
            if (has_ignore && r == ign) continue;
            T* o = out + r * os + c;
            *o = step1<Weighted>(*o, src[i * ss + c], Weighted ? w[i] : A(1));
          }
        return;
      }
    }
    if (W == 1 || m == 1) {
      // One column at a time, without a branch per run (short runs of a random length would
      // mispredict): the running sum restarts from out where the row changes and is stored
      // after every contribution; a row is never read again once its run is over, so its last
      // store, rounded once from the whole run's sum, is what stays. Inside a run the load reads
      // a dummy instead of the row just stored, so the sum's chain stays in registers.
      // bf16/fp16 rows of one element with contiguous sources take 16 entries at a time where
      // the AVX-512 kernels run (add_run_blocks); this walk takes the rest.
      const T dummy{};
      for (int64_t c = c0; c < c1; ++c) {
        A acc = 0;
        int64_t prev = -1;
        for (int64_t i = i0; i < i1;) {
          int64_t stop = i1;
#if defined(__AVX512F__)
          if constexpr (W == 16 && sizeof(T) == 2) {
            if (m == 1 && ss == 1) {
              i = add_run_blocks<I, Weighted>(idx, out + c, os, src + c, w, i, i1, has_ignore, ign, acc, prev);
              stop = std::min(i1, i + 16);  // a block the vectors left (an ignored entry), then vectors again
            }
          }
#endif
          for (; i < stop; ++i) {
            const int64_t r = static_cast<int64_t>(idx[i]);
            if (has_ignore && r == ign) continue;
            T* o = out + r * os + c;
            // All ones where the row changes. Opaque to the compiler, so that both selects below
            // stay bit selects instead of becoming a branch that mispredicts on random run lengths.
            uintptr_t fresh = uintptr_t(0) - uintptr_t(r != prev);
            __asm__("" : "+r"(fresh));
            const T* from = reinterpret_cast<const T*>((reinterpret_cast<uintptr_t>(o) & fresh) |
                                                       (reinterpret_cast<uintptr_t>(&dummy) & ~fresh));
            acc = select_acc(fresh, E::get(*from), acc);
            acc = step1<Weighted>(acc, E::get(src[i * ss + c]), Weighted ? w[i] : A(1));
            *o = E::put(acc);
            prev = r;
          }
        }
      }
      return;
    }
    for (int64_t i = i0; i < i1;) {
      const I r = idx[i];
      int64_t e = i + 1;
      while (e < i1 && idx[e] == r) ++e;
      if (!(has_ignore && static_cast<int64_t>(r) == ign)) {
        T* o = out + static_cast<int64_t>(r) * os;
        if (m <= W) {  // one partial vector per run
          V acc = Ops::load_part(o + c0, m);
          for (int64_t x = i; x < e; ++x)
            acc = step<Weighted>(acc, Ops::load_part(src + x * ss + c0, m), Ops::set1(Weighted ? w[x] : A(1)));
          Ops::store_part(o + c0, acc, m);
        } else {
          add_row<Weighted>(o, src, ss, Consecutive{i}, e - i, w, c0, c1, true, 0);
        }
      }
      i = e;
    }
  }

  template <class I, bool Weighted>
  static void scratch_add(const DirectJob& j, int64_t i0, int64_t i1, int64_t c0, int64_t c1) {
    auto run = [&](auto slots) {
      constexpr Slots S = decltype(slots)::value;
      if (c1 - c0 != 1)
        scratch_add_loop<I, Weighted, S>(j, i0, i1, c0, c1);
      else if (j.prefetch)
        scratch_add_column<I, Weighted, S, true>(j, i0, i1, c0);
      else
        scratch_add_column<I, Weighted, S, false>(j, i0, i1, c0);
    };
    if (j.touched != nullptr)
      run(std::integral_constant<Slots, Slots::touched>{});
    else if (j.slot_base == nullptr)
      run(std::integral_constant<Slots, Slots::dense>{});
    else
      run(std::integral_constant<Slots, Slots::sparse>{});
  }
  // One column: the general loop's byte mark and stores may alias every field of the job, which
  // the compiler then reloads per entry; here the fields live in registers. K = 1M, D = 1 bf16,
  // one thread: dense, marking, N = 10k 2.3-4.0 -> 1.4-2.3 ms; dense, prefetched, N = 1M 7.4-8.9
  // -> 4.0-5.3 ms; sparse, N = 1M, K = 100k, zipf 1.6-2.2 -> 1.1-1.3 ms, uniform 1.5-1.8 -> 1.2-1.4.
  // A sparse walk also prefetches the two bitmap words that rank its row (out's random rows evict
  // them from the L2): N = 1M, K = 100k, uniform, 1.01-1.09 -> 0.61-0.9 ms (EPYC, best of 50).
  template <class I, bool Weighted, Slots S, bool Prefetch>
  static void scratch_add_column(const DirectJob& j, int64_t i0, int64_t i1, int64_t c0) {
    const I* __restrict idx = static_cast<const I*>(j.index);
    const T* __restrict src = static_cast<const T*>(j.src) + c0;
    T* __restrict out = static_cast<T*>(j.out) + c0;
    A* __restrict acc = static_cast<A*>(j.scratch);
    const A* __restrict w = static_cast<const A*>(j.w);
    const uint64_t* __restrict slot_bits = j.slot_bits;
    const int64_t* __restrict slot_base = j.slot_base;
    uint64_t* __restrict touched = j.touched;
    uint8_t* __restrict mark = j.mark_rows;
    const int64_t ss = j.src_stride, as = j.scratch_stride, os = j.out_stride;
    const uint64_t ab = static_cast<uint64_t>(as) * sizeof(A), ob = static_cast<uint64_t>(os) * sizeof(T);
    const uint64_t lo = static_cast<uint64_t>(j.row_lo), span = static_cast<uint64_t>(j.row_hi - j.row_lo);
    const bool ign_in_range = j.has_ignore && static_cast<uint64_t>(j.ignore) - lo < span;
    const int64_t ign = j.ignore;
    const int64_t pf_end = i1 - kPrefetchAhead;
    auto walk = [&](auto marking) {
      for (int64_t i = i0; i < i1; ++i) {
        if (Prefetch && i < pf_end) {  // the slot, out's row, and the bitmap words that pick them
          const uint64_t pr = own_row(static_cast<uint64_t>(idx[i + kPrefetchAhead]), lo, span);
          if (S != Slots::sparse) prefetch_at(acc, pr, ab, 1);
          if (S != Slots::dense) prefetch_at(out, pr, ob, S == Slots::sparse);
          if (S != Slots::dense) __builtin_prefetch((S == Slots::sparse ? slot_bits : touched) + (pr >> 6));
          if (S == Slots::sparse) __builtin_prefetch(slot_base + (pr >> 6));
        }
        const int64_t r = static_cast<int64_t>(idx[i]);
        if (static_cast<uint64_t>(r) - lo >= span || (ign_in_range && r == ign)) continue;
        const A x = E::get(src[i * ss]), wi = Weighted ? w[i] : A(1);
        int64_t slot = r;
        if (S == Slots::sparse) {
          const uint64_t word = slot_bits[r >> 6], below = (uint64_t(1) << (r & 63)) - 1;
          if (!((word >> (r & 63)) & 1)) {  // the row's only contribution
            T& o = out[r * os];
            o = E::put(step1<Weighted>(E::get(o), x, wi));
            continue;
          }
          slot = slot_base[r >> 6] + __builtin_popcountll(word & below);
        }
        if (decltype(marking)::value) mark[r] = 1;
        A& a = acc[slot * as];
        if (S == Slots::touched) {  // the row's first contribution starts from out's value
          const uint64_t word = touched[r >> 6], bit = uint64_t(1) << (r & 63);
          const A base = (word & bit) ? a : E::get(out[r * os]);
          touched[r >> 6] = word | bit;
          a = step1<Weighted>(base, x, wi);
          continue;
        }
        a = step1<Weighted>(a, x, wi);
      }
    };
    if (S == Slots::dense && mark != nullptr)
      walk(std::true_type{});
    else
      walk(std::false_type{});
  }
  // Dense and touched: every row has a scratch slot, slot = row (touched: filled from out by the
  // row's first contribution). Sparse: only the rows in slot_bits do.
  template <class I, bool Weighted, Slots S>
  static void scratch_add_loop(const DirectJob& j, int64_t i0, int64_t i1, int64_t c0, int64_t c1) {
    // The job's fields in locals: the stores through out, acc and the marks could alias them, and
    // the compiler would reload each per entry.
    const I* __restrict idx = static_cast<const I*>(j.index);
    T* __restrict out = static_cast<T*>(j.out) + c0;
    A* __restrict acc = static_cast<A*>(j.scratch);
    const T* __restrict src = static_cast<const T*>(j.src) + c0;
    const A* __restrict w = static_cast<const A*>(j.w);
    const uint64_t* __restrict slot_bits = j.slot_bits;
    const int64_t* __restrict slot_base = j.slot_base;
    uint64_t* __restrict touched = j.touched;
    uint8_t* __restrict mark = j.mark_rows;
    const int64_t m = c1 - c0, ss = j.src_stride, os = j.out_stride, as = j.scratch_stride, ign = j.ignore;
    const bool prefetch = j.prefetch;
    const uint64_t ob = static_cast<uint64_t>(os) * sizeof(T), ab = static_cast<uint64_t>(as) * sizeof(A);
    const uint64_t lo = static_cast<uint64_t>(j.row_lo), span = static_cast<uint64_t>(j.row_hi - j.row_lo);
    const bool ign_in_range = j.has_ignore && static_cast<uint64_t>(ign) - lo < span;
    for (int64_t i = i0; i < i1; ++i) {
      if (prefetch && i + kPrefetchAhead < i1) {  // the slot, out's row, and the bitmap words that pick them
        const uint64_t pr = own_row(static_cast<uint64_t>(idx[i + kPrefetchAhead]), lo, span);
        if (S != Slots::sparse) prefetch_at(acc, pr, ab, 1);
        if (S != Slots::dense) prefetch_at(out, pr, ob, S == Slots::sparse);
        if (S != Slots::dense) __builtin_prefetch((S == Slots::sparse ? slot_bits : touched) + (pr >> 6));
        if (S == Slots::sparse) __builtin_prefetch(slot_base + (pr >> 6));
      }
      const int64_t r = static_cast<int64_t>(idx[i]);
      if (static_cast<uint64_t>(r) - lo >= span || (ign_in_range && r == ign)) continue;
      const T* s = src + i * ss;
      const A wi = Weighted ? w[i] : A(1);
      int64_t slot = r;
      if (S == Slots::sparse) {
        const uint64_t word = slot_bits[r >> 6];
        if (!((word >> (r & 63)) & 1)) {  // the row's only contribution
          add_once<Weighted>(out + r * os, s, wi, m);
          continue;
        }
        slot = slot_base[r >> 6] + __builtin_popcountll(word & ((uint64_t(1) << (r & 63)) - 1));
      }
      if (S == Slots::dense && mark != nullptr) mark[r] = 1;
      A* o = acc + slot * as;
      if (S == Slots::touched && !((touched[r >> 6] >> (r & 63)) & 1)) {  // first: from out's value
        touched[r >> 6] |= uint64_t(1) << (r & 63);
        T* from = out + r * os;
        if (W == 1 || m <= kScalarCols) {
          for (int64_t c = 0; c < m; ++c) o[c] = step1<Weighted>(E::get(from[c]), E::get(s[c]), wi);
          continue;
        }
        copy_span(from, o, m, false);
      }
      if (W == 1 || m <= kScalarCols) {
        for (int64_t c = 0; c < m; ++c) o[c] = step1<Weighted>(o[c], E::get(s[c]), wi);
        continue;
      }
      const V wk = Ops::set1(wi);
      int64_t c = 0;
      for (; c + W <= m; c += W) Ops::store_acc(o + c, step<Weighted>(Ops::load_acc(o + c), Ops::load(s + c), wk));
      if (c < m)
        Ops::store_acc_part(o + c, step<Weighted>(Ops::load_acc_part(o + c, m - c), Ops::load_part(s + c, m - c), wk),
                            m - c);
    }
  }

  static void scratch_copy(const DirectJob& j, const uint64_t* rows, int64_t w0, int64_t w1, int64_t c0, int64_t c1,
                           bool to_out) {
    T* out = static_cast<T*>(j.out) + c0;
    A* acc = static_cast<A*>(j.scratch);
    A* orig = static_cast<A*>(j.scratch_orig);
    const int64_t m = c1 - c0;
    // Rows of m elements back to back in out and in a dense scratch: one span of elements (whose
    // marks, when there are marks, must be one per element: m = 1).
    if (j.touched != nullptr) {  // touched slots: only back, only the touched rows
      if (to_out) scratch_copy_touched(j, out, acc, w0, w1, m);
      return;
    }
    if (W > 1 && j.out_stride == m && j.scratch_stride == m && j.slot_base == nullptr && (m == 1 || rows == nullptr)) {
      scratch_copy_flat(j, out, acc, rows, w0, w1, m, to_out);
      return;
    }
    for (int64_t wd = w0; wd < w1; ++wd) {
      uint64_t bits = ~uint64_t(0);
      if (rows != nullptr) {
        bits = rows[wd];
      } else {  // every row of [row_lo, row_hi) in this word
        const int64_t lo = std::max<int64_t>(j.row_lo - wd * 64, 0), hi = std::min<int64_t>(j.row_hi - wd * 64, 64);
        if (lo >= hi) continue;
        bits = (hi == 64 ? ~uint64_t(0) : (uint64_t(1) << hi) - 1) & ~((uint64_t(1) << lo) - 1);
      }
      int64_t slot = j.slot_base != nullptr ? j.slot_base[wd] : 0;
      for (; bits != 0; bits &= bits - 1, ++slot) {
        const int64_t row = wd * 64 + __builtin_ctzll(bits);
        T* o = out + row * j.out_stride;
        A* a = acc + (j.slot_base != nullptr ? slot : row) * j.scratch_stride;
        A* snap = orig != nullptr ? orig + (a - acc) : nullptr;
        if (to_out && snap != nullptr && std::memcmp(a, snap, static_cast<size_t>(m) * sizeof(A)) == 0)
          continue;  // the adds left the row as it came: not written
        if (W == 1 || m == 1) {
          for (int64_t c = 0; c < m; ++c) {
            if (to_out)
              o[c] = E::put(a[c]);
            else
              a[c] = E::get(o[c]);
          }
        } else {
          copy_span(o, a, m, to_out);
        }
        if (!to_out && snap != nullptr) std::memcpy(snap, a, static_cast<size_t>(m) * sizeof(A));
      }
    }
  }

  // Touched slots back to out, row by row in increasing order (the slots and rows stream forward
  // through memory), with the job's fields in registers: written through `out`, they would be
  // reloaded per row.
  static void scratch_copy_touched(const DirectJob& j, T* __restrict out, A* __restrict acc, int64_t w0, int64_t w1,
                                   int64_t m) {
    const uint64_t* __restrict touched = j.touched;
    const int64_t os = j.out_stride, as = j.scratch_stride;
    for (int64_t wd = w0; wd < w1; ++wd) {
      for (uint64_t bits = touched[wd]; bits != 0; bits &= bits - 1) {
        const int64_t row = wd * 64 + __builtin_ctzll(bits);
        if (W == 1 || m <= kScalarCols) {
          for (int64_t c = 0; c < m; ++c) out[row * os + c] = E::put(acc[row * as + c]);
        } else {
          copy_span(out + row * os, acc + row * as, m, true);
        }
      }
    }
  }

  // n consecutive elements between out and the float32 scratch: rounded once into out (to_out) or
  // widened into the scratch, whole vectors then one partial.
  static void copy_span(T* o, A* a, int64_t n, bool to_out) {
    int64_t c = 0;
    for (; c + W <= n; c += W) {
      if (to_out)
        Ops::store(o + c, Ops::load_acc(a + c));
      else
        Ops::store_acc(a + c, Ops::load(o + c));
    }
    if (c < n) {
      if (to_out)
        Ops::store_part(o + c, Ops::load_acc_part(a + c, n - c), n - c);
      else
        Ops::store_acc_part(a + c, Ops::load_part(o + c, n - c), n - c);
    }
  }

  // scratch_copy for rows of m elements back to back, a slot per row: W elements per vector, each
  // vector rounded at once and stored in the lanes to write (a mask store; element by element,
  // 2.2 ms of a 9.5 ms call at N = K = 1M, D = 1 bf16, one thread). Back to out: the rows marked
  // (m = 1), or the elements whose sum differs from the snapshot, compared as bit patterns (an
  // element whose sum equals it rounds back to its own bits, so leaving it is the same as writing
  // it, and the rows no entry names are never written).
  static void scratch_copy_flat(const DirectJob& j, T* out, A* acc, const uint64_t* rows, int64_t w0, int64_t w1,
                                int64_t m, bool to_out) {
    const int64_t lo = std::max(j.row_lo, w0 * 64), hi = std::min(j.row_hi, w1 * 64);
    if (hi <= lo) return;
    const int64_t e0 = lo * m, e1 = hi * m;  // elements; e0 is a multiple of 64 (or 0)
    A* orig = static_cast<A*>(j.scratch_orig);
    if (!to_out || (rows == nullptr && orig == nullptr)) {  // every element
      copy_span(out + e0, acc + e0, e1 - e0, to_out);
      if (!to_out && orig != nullptr) std::memcpy(orig + e0, acc + e0, static_cast<size_t>(e1 - e0) * sizeof(A));
      return;
    }
    constexpr uint64_t kAll = W >= 64 ? ~uint64_t(0) : (uint64_t(1) << W) - 1;
    for (int64_t e = e0; e < e1; e += W) {
      uint64_t b;
      if (rows != nullptr) {  // m = 1: element e is row e
        b = (rows[e >> 6] >> (e & 63)) & kAll;
      } else if (e + W <= e1) {
        b = Ops::differ(acc + e, orig + e);
      } else {
        b = 0;
        for (int64_t q = 0; q < e1 - e; ++q) b |= uint64_t(std::memcmp(acc + e + q, orig + e + q, sizeof(A)) != 0) << q;
      }
      if (b == 0) continue;
      if (e + W <= e1) {
        if (b == kAll)
          Ops::store(out + e, Ops::load_acc(acc + e));
        else
          Ops::store_lanes(out + e, Ops::load_acc(acc + e), b);
        continue;
      }
      b &= (uint64_t(1) << (e1 - e)) - 1;  // the last, partial vector
      T lanes[W];
      Ops::store_part(lanes, Ops::load_acc_part(acc + e, e1 - e), e1 - e);
      for (; b != 0; b &= b - 1) {
        const int q = __builtin_ctzll(b);
        out[e + q] = lanes[q];
      }
    }
  }

  // ---- gather -------------------------------------------------------------------------------

  template <class I, bool Weighted>
  static void gather(const GatherJob& j, int64_t i0, int64_t i1, int64_t c0, int64_t c1) {
    const I* idx = static_cast<const I*>(j.index);
    T* dst = static_cast<T*>(j.dst) + c0;
    const T* x = static_cast<const T*>(j.x) + c0;
    const A* w = static_cast<const A*>(j.w);
    const int64_t m = c1 - c0;
    const size_t bytes = static_cast<size_t>(m) * sizeof(T);
    const uint64_t xb = static_cast<uint64_t>(j.x_stride) * sizeof(T);
    if (!Weighted && j.stream) {  // non-temporal stores (GatherJob::stream), fenced before return
      copy_rows<I>(j, dst, x, i0, i1, bytes, StreamCopy{});
      stream_fence();
      return;
    }
    if (!Weighted) {  // short rows: a copy of constant size
      switch (bytes) {
        case 4: return copy_rows<I>(j, dst, x, i0, i1, 4, FixedCopy<4>{});
        case 8: return copy_rows<I>(j, dst, x, i0, i1, 8, FixedCopy<8>{});
        case 16: return copy_rows<I>(j, dst, x, i0, i1, 16, FixedCopy<16>{});
        case 32: return copy_rows<I>(j, dst, x, i0, i1, 32, FixedCopy<32>{});
        case 64: return copy_rows<I>(j, dst, x, i0, i1, 64, FixedCopy<64>{});
        case 128: return copy_rows<I>(j, dst, x, i0, i1, 128, FixedCopy<128>{});
        case 256: return copy_rows<I>(j, dst, x, i0, i1, 256, FixedCopy<256>{});
        default: break;
      }
    }
    for (int64_t i = i0; i < i1; ++i) {
      if (i + kPrefetchAhead < i1) prefetch_at(x, static_cast<uint64_t>(idx[i + kPrefetchAhead]), xb);
      const int64_t r = static_cast<int64_t>(idx[i]);
      T* d = dst + i * j.dst_stride;
      if (j.has_ignore && r == j.ignore) {
        std::memset(d, 0, bytes);
        continue;
      }
      const T* s = x + r * j.x_stride;
      if (!Weighted) {
        if (m == 1)
          d[0] = s[0];
        else
          std::memcpy(d, s, bytes);
        continue;
      }
      const A wi = w[i];
      if (W == 1 || m == 1) {
        for (int64_t c = 0; c < m; ++c) d[c] = E::put(E::get(s[c]) * wi);
        continue;
      }
      const V wv = Ops::set1(wi);
      int64_t c = 0;
      for (; c + W <= m; c += W) Ops::store(d + c, Ops::mul(Ops::load(s + c), wv));
      if (c < m) Ops::store_part(d + c, Ops::mul(Ops::load_part(s + c, m - c), wv), m - c);
    }
  }

  // Unweighted rows of `bytes`, each copied by copy(dst_row, x_row, bytes); zeros at ignore.
  template <class I, class Copy>
  static void copy_rows(const GatherJob& j, T* dst, const T* x, int64_t i0, int64_t i1, size_t bytes, Copy copy) {
    const I* idx = static_cast<const I*>(j.index);
    const uint64_t xb = static_cast<uint64_t>(j.x_stride) * sizeof(T);
    for (int64_t i = i0; i < i1; ++i) {
      if (i + kPrefetchAhead < i1) prefetch_at(x, static_cast<uint64_t>(idx[i + kPrefetchAhead]), xb);
      const int64_t r = static_cast<int64_t>(idx[i]);
      if (j.has_ignore && r == j.ignore)
        std::memset(dst + i * j.dst_stride, 0, bytes);
      else
        copy(dst + i * j.dst_stride, x + r * j.x_stride, bytes);
    }
  }
  template <size_t Bytes>
  struct FixedCopy {  // a copy of constant size, inlined
    void operator()(void* d, const void* s, size_t) const { fixed_copy<Bytes>(d, s); }
  };
  struct StreamCopy {
    void operator()(void* d, const void* s, size_t n) const { stream_copy(d, s, n); }
  };

  static void scale_row(void* dst_v, const void* x_v, double w, int64_t c0, int64_t c1) {
    T* dst = static_cast<T*>(dst_v);
    const T* x = static_cast<const T*>(x_v);
    const A wa = static_cast<A>(w);
    const V wv = Ops::set1(wa);
    int64_t c = c0;
    if (W > 1)
      for (; c + W <= c1; c += W) Ops::store(dst + c, Ops::mul(Ops::load(x + c), wv));
    if (c < c1) {
      if (W == 1 || c1 - c == 1) {
        for (; c < c1; ++c) dst[c] = E::put(E::get(x[c]) * wa);
      } else {
        Ops::store_part(dst + c, Ops::mul(Ops::load_part(x + c, c1 - c), wv), c1 - c);
      }
    }
  }
};

// Partial loads and stores through a small buffer, for ISAs without masked moves of the type.
template <class Ops>
struct PartByCopy {
  using T = typename Ops::storage;
  static typename Ops::vec load_part(const T* p, int64_t m) {
    T tmp[Ops::width] = {};
    std::memcpy(tmp, p, static_cast<size_t>(m) * sizeof(T));
    return Ops::load(tmp);
  }
  static void store_part(T* p, typename Ops::vec v, int64_t m) {
    T tmp[Ops::width];
    Ops::store(tmp, v);
    std::memcpy(p, tmp, static_cast<size_t>(m) * sizeof(T));
  }
};

// Order of the tables' first index follows scatter_add::DType: f32, f64, bf16, f16.
template <class Ops>
void fill_row(KernelTable& t, int d) {
  using K = RowKernels<Ops>;
  t.rows[d][0] = &K::template add_rows<false>;
  t.rows[d][1] = &K::template add_rows<true>;
  t.direct[d][0][0] = &K::template add_direct<int32_t, false>;
  t.direct[d][0][1] = &K::template add_direct<int64_t, false>;
  t.direct[d][1][0] = &K::template add_direct<int32_t, true>;
  t.direct[d][1][1] = &K::template add_direct<int64_t, true>;
  t.runs[d][0][0] = &K::template add_runs<int32_t, false>;
  t.runs[d][0][1] = &K::template add_runs<int64_t, false>;
  t.runs[d][1][0] = &K::template add_runs<int32_t, true>;
  t.runs[d][1][1] = &K::template add_runs<int64_t, true>;
  t.gather[d][0][0] = &K::template gather<int32_t, false>;
  t.gather[d][0][1] = &K::template gather<int64_t, false>;
  t.gather[d][1][0] = &K::template gather<int32_t, true>;
  t.gather[d][1][1] = &K::template gather<int64_t, true>;
  t.scale[d] = &K::scale_row;
  if (sizeof(typename Ops::storage) == 2) {
    t.scratch_add[d][0][0] = &K::template scratch_add<int32_t, false>;
    t.scratch_add[d][0][1] = &K::template scratch_add<int64_t, false>;
    t.scratch_add[d][1][0] = &K::template scratch_add<int32_t, true>;
    t.scratch_add[d][1][1] = &K::template scratch_add<int64_t, true>;
    t.scratch_copy[d] = &K::scratch_copy;
  }
}

// KernelTable::index_check: branch-free passes the compiler vectorises, in the index's own width
// (values must lie in [0, min(n, I's max)]: one unsigned compare catches negatives too).
template <class I>
IndexCheck check_index_values(const void* index, int64_t k, int64_t n, bool has_ignore, int64_t ign,
                              bool want_sorted) {
  const I* __restrict idx = static_cast<const I*>(index);
  IndexCheck s{false, false, 0};
  using U = std::make_unsigned_t<I>;
  const U lim = static_cast<uint64_t>(n) > static_cast<uint64_t>(std::numeric_limits<I>::max())
                    ? static_cast<U>(static_cast<U>(std::numeric_limits<I>::max()) + 1)
                    : static_cast<U>(n);
  const bool ign_fits = has_ignore && ign >= std::numeric_limits<I>::min() && ign <= std::numeric_limits<I>::max();
  unsigned bad = 0;
  int64_t ignored = 0;
  if (want_sorted && !ign_fits && k > 0) {
    // Both tests in one pass over the index, which is read once rather than twice (float32
    // D = 1, N = 1000, K = 1M: the two passes took a fifth of the call).
    unsigned descents = 0;
    bad = static_cast<U>(idx[0]) >= lim;
    for (int64_t i = 1; i < k; ++i) {
      descents |= idx[i - 1] > idx[i];
      bad |= static_cast<U>(idx[i]) >= lim;
    }
    s.sorted = descents == 0;
    s.bad = bad != 0;
    return s;
  }
  if (want_sorted) {
    unsigned descents = 0;
    for (int64_t i = 1; i < k; ++i) descents |= idx[i - 1] > idx[i];
    s.sorted = descents == 0;
  }
  if (!ign_fits) {
    for (int64_t i = 0; i < k; ++i) bad |= static_cast<U>(idx[i]) >= lim;
  } else {
    const I g = static_cast<I>(ign);
    for (int64_t i = 0; i < k; ++i) {
      const bool is_ignored = idx[i] == g;
      ignored += is_ignored;
      bad |= (static_cast<U>(idx[i]) >= lim) & !is_ignored;
    }
  }
  s.bad = bad != 0;
  s.ignored = ignored;
  return s;
}

// KernelTable::deal, entry by entry: rows of RowBytes bytes (0: job.row_bytes). The position
// is chosen by masks: a branch here would be mispredicted for about every other entry.
template <size_t RowBytes, bool Down, class I>
DealEnds deal_scalar(const DealJob& j, int64_t i0, int64_t i1, int64_t p0, int64_t p1, int64_t trash) {
  const size_t bytes = RowBytes != 0 ? RowBytes : j.row_bytes, asz = j.w_bytes, srb = j.src_row_bytes;
  const bool has_ign = j.has_ignore;
  const int64_t ign = has_ign ? j.ignore : 0, cut = j.cut;
  const I* __restrict idx = static_cast<const I*>(j.index);
  const unsigned char* __restrict src = j.src;
  const unsigned char* __restrict w = j.w;
  I* __restrict ids = static_cast<I*>(j.ids);
  unsigned char* __restrict rows = j.rows;
  unsigned char* __restrict ws = j.ws;
  auto pick = [](bool take, int64_t a, int64_t b) {
    const int64_t m = -static_cast<int64_t>(take);
    return (a & m) | (b & ~m);
  };
  constexpr int64_t step = Down ? -1 : 1;
  for (int64_t n = i1 - i0, jj = 0; jj < n; ++jj) {
    const int64_t i = Down ? i1 - 1 - jj : i0 + jj;
    const I v = idx[i];
    const int64_t r = static_cast<int64_t>(v);
    const bool keep = !(has_ign && r == ign), second = r >= cut;
    const int64_t pos = pick(keep, pick(second, p1, p0), trash);
    ids[pos] = v;
    std::memcpy(rows + static_cast<size_t>(pos) * bytes, src + static_cast<size_t>(i) * srb, bytes);
    if (asz != 0) std::memcpy(ws + static_cast<size_t>(pos) * asz, w + static_cast<size_t>(i) * asz, asz);
    p0 += step & -static_cast<int64_t>(keep & !second);
    p1 += step & -static_cast<int64_t>(keep & second);
  }
  return {p0, p1};
}

template <bool Down, class I>
DealEnds deal_rows_scalar(const DealJob& j, int64_t i0, int64_t i1, int64_t p0, int64_t p1, int64_t trash) {
  switch (j.row_bytes) {
    case 2: return deal_scalar<2, Down, I>(j, i0, i1, p0, p1, trash);
    case 4: return deal_scalar<4, Down, I>(j, i0, i1, p0, p1, trash);
    case 8: return deal_scalar<8, Down, I>(j, i0, i1, p0, p1, trash);
    case 16: return deal_scalar<16, Down, I>(j, i0, i1, p0, p1, trash);
    case 32: return deal_scalar<32, Down, I>(j, i0, i1, p0, p1, trash);
    case 64: return deal_scalar<64, Down, I>(j, i0, i1, p0, p1, trash);
    default: return deal_scalar<0, Down, I>(j, i0, i1, p0, p1, trash);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// One block of L entries (16 of int32, 8 of int64) from entry i: each thread's entries compressed
// to the front of a register, in order, and stored by a mask of their count at its position
// (Down: the count below it). Rows of RowBytes (2 or 4) back to back, weights of WBytes (0 or 4).
template <size_t RowBytes, size_t WBytes, bool Down, class I>
inline void deal_block(const DealJob& j, int64_t i, int64_t& p0, int64_t& p1, bool ign_fits, bool all_first) {
  constexpr bool wide = sizeof(I) == 8;
  const I* idx = static_cast<const I*>(j.index);
  __m512i v = _mm512_loadu_si512(idx + i);
  unsigned keep, sec;
  if (wide) {
    keep = ign_fits ? _mm512_cmpneq_epi64_mask(v, _mm512_set1_epi64(j.ignore)) : 0xFFu;
    sec = all_first ? 0u : _mm512_cmpge_epi64_mask(v, _mm512_set1_epi64(j.cut));
  } else {
    keep = ign_fits ? _mm512_cmpneq_epi32_mask(v, _mm512_set1_epi32(static_cast<int32_t>(j.ignore))) : 0xFFFFu;
    sec = all_first ? 0u : _mm512_cmpge_epi32_mask(v, _mm512_set1_epi32(static_cast<int32_t>(j.cut)));
  }
  sec &= keep;
  const unsigned fst = keep & ~sec;
  const int c[2] = {__builtin_popcount(fst), __builtin_popcount(sec)};
  const unsigned m[2] = {fst, sec};
  const int64_t at[2] = {Down ? p0 - c[0] + 1 : p0, Down ? p1 - c[1] + 1 : p1};
  const unsigned char* s = j.src + static_cast<size_t>(i) * RowBytes;
  const unsigned char* w = WBytes != 0 ? j.w + static_cast<size_t>(i) * WBytes : nullptr;
  for (int t = 0; t < 2; ++t) {
    const unsigned store = (1u << c[t]) - 1u;
    const int64_t a = at[t];
    if (wide) {
      _mm512_mask_storeu_epi64(static_cast<int64_t*>(j.ids) + a, static_cast<__mmask8>(store),
                               _mm512_maskz_compress_epi64(static_cast<__mmask8>(m[t]), v));
      if (RowBytes == 2) {
        const __m256i r = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
        _mm_mask_storeu_epi16(j.rows + a * 2, static_cast<__mmask8>(store),
                              _mm256_cvtepi32_epi16(_mm256_maskz_compress_epi32(static_cast<__mmask8>(m[t]), r)));
      } else {
        const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
        _mm256_mask_storeu_epi32(j.rows + a * 4, static_cast<__mmask8>(store),
                                 _mm256_maskz_compress_epi32(static_cast<__mmask8>(m[t]), r));
      }
      if (WBytes == 4) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
        _mm256_mask_storeu_epi32(j.ws + a * 4, static_cast<__mmask8>(store),
                                 _mm256_maskz_compress_epi32(static_cast<__mmask8>(m[t]), x));
      }
    } else {
      _mm512_mask_storeu_epi32(static_cast<int32_t*>(j.ids) + a, static_cast<__mmask16>(store),
                               _mm512_maskz_compress_epi32(static_cast<__mmask16>(m[t]), v));
      if (RowBytes == 2) {
        const __m512i r = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
        _mm256_mask_storeu_epi16(j.rows + a * 2, static_cast<__mmask16>(store),
                                 _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(static_cast<__mmask16>(m[t]), r)));
      } else {
        const __m512i r = _mm512_loadu_si512(s);
        _mm512_mask_storeu_epi32(j.rows + a * 4, static_cast<__mmask16>(store),
                                 _mm512_maskz_compress_epi32(static_cast<__mmask16>(m[t]), r));
      }
      if (WBytes == 4) {
        const __m512i x = _mm512_loadu_si512(w);
        _mm512_mask_storeu_epi32(j.ws + a * 4, static_cast<__mmask16>(store),
                                 _mm512_maskz_compress_epi32(static_cast<__mmask16>(m[t]), x));
      }
    }
  }
  p0 += Down ? -c[0] : c[0];
  p1 += Down ? -c[1] : c[1];
}

template <size_t RowBytes, size_t WBytes, bool Down, class I>
DealEnds deal_vector(const DealJob& j, int64_t i0, int64_t i1, int64_t p0, int64_t p1, int64_t trash) {
  constexpr int64_t L = 64 / sizeof(I);
  const bool ign_fits =
      j.has_ignore && j.ignore >= std::numeric_limits<I>::min() && j.ignore <= std::numeric_limits<I>::max();
  const bool all_first = j.cut > std::numeric_limits<I>::max();  // no entry reaches the second's rows
  const int64_t blocks = (i1 - i0) / L;
  for (int64_t b = 0; b < blocks; ++b)
    deal_block<RowBytes, WBytes, Down, I>(j, Down ? i1 - (b + 1) * L : i0 + b * L, p0, p1, ign_fits, all_first);
  // The entries left over: below the blocks (Down) or above them.
  const DealEnds e = Down ? deal_scalar<RowBytes, Down, I>(j, i0, i1 - blocks * L, p0, p1, trash)
                          : deal_scalar<RowBytes, Down, I>(j, i0 + blocks * L, i1, p0, p1, trash);
  return e;
}
#endif

template <bool Down, class I>
DealEnds deal_entries(const DealJob& j, int64_t i0, int64_t i1, int64_t p0, int64_t p1, int64_t trash) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if (j.src_row_bytes == j.row_bytes && (j.w_bytes == 0 || j.w_bytes == 4)) {
    const bool wt = j.w_bytes == 4;
    if (j.row_bytes == 2)
      return wt ? deal_vector<2, 4, Down, I>(j, i0, i1, p0, p1, trash) : deal_vector<2, 0, Down, I>(j, i0, i1, p0, p1, trash);
    if (j.row_bytes == 4)
      return wt ? deal_vector<4, 4, Down, I>(j, i0, i1, p0, p1, trash) : deal_vector<4, 0, Down, I>(j, i0, i1, p0, p1, trash);
  }
#endif
  return deal_rows_scalar<Down, I>(j, i0, i1, p0, p1, trash);
}

template <class F32, class F64, class BF16, class F16>
KernelTable make_table() {
  KernelTable t{};
  t.index_check[0] = &check_index_values<int32_t>;
  t.index_check[1] = &check_index_values<int64_t>;
  t.deal[0][0] = &deal_entries<false, int32_t>;
  t.deal[0][1] = &deal_entries<true, int32_t>;
  t.deal[1][0] = &deal_entries<false, int64_t>;
  t.deal[1][1] = &deal_entries<true, int64_t>;
  fill_row<F32>(t, 0);
  fill_row<F64>(t, 1);
  fill_row<BF16>(t, 2);
  fill_row<F16>(t, 3);
  return t;
}

}  // namespace
}  // namespace cpu
}  // namespace scatter_add
