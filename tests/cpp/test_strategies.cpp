// One set of bits whatever runs: every strategy (direct, count, radix) x thread count x ISA level
// (CTest runs the suite once per level) gives exactly the bits of the summation contract,
// computed here element by element: start from out, acc = fma(w, s, acc) (acc + s unweighted) in
// float32 (float64 for f64) in increasing source order, round once, subnormals kept. The data are
// full of subnormals of each dtype. Also: gather's bits, views_may_overlap, bad views, and the
// strategy switches.
#include <gtest/gtest.h>
#include <xmmintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <thread>
#include <vector>

#include "big_alloc.h"
#include "dispatch.h"
#include "policy.h"
#include "strategy.h"
#include "test_util.h"

namespace {

// Values of every kind for dtype t: normal, subnormal, zero, and tiny enough that sums of a few
// land in the subnormal range (one in six each normal and zero, of either sign). The buffers run
// to millions of elements, so they are drawn by splitmix64 (seeded from rng, one draw per
// element) without a branch on the kind: std::mt19937_64, uniform_real_distribution and a
// mispredicted branch per element took more than half of this suite's time.
Buf special_buf(DType t, size_t n, std::mt19937_64& rng) {
  const double tiny = t == DType::f64 ? 1e-308 : t == DType::f16 ? 4e-5 : 1e-38;
  const double scale[6] = {1.0, 0.0, tiny, tiny, tiny, tiny};
  Buf b(t, n);
  uint64_t state = rng();
  for (size_t i = 0; i < n; ++i) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);  // splitmix64
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const double u = -2.0 + static_cast<double>(z >> 11) * 0x1p-51;  // [-2, 2): 53 bits times 4 / 2^53
    b.set(i, u * scale[z % 6]);  // the low bits pick the kind; z >> 11 leaves them out of u
  }
  return b;
}

std::vector<float> special_weights(int64_t k, std::mt19937_64& rng) {
  std::vector<float> w(static_cast<size_t>(k));
  std::uniform_real_distribution<float> u(-1.5f, 1.5f);
  for (auto& x : w) x = (rng() % 4 == 0) ? 0.5f : u(rng);
  return w;
}

// out0 after the direct walk on `threads` threads.
Buf direct_walk(const Buf& out0, int64_t n, int64_t d, int64_t os, const Idx& idx, const Buf& src, int64_t k,
                int64_t ss, const float* w, int threads, std::optional<int64_t> ignore) {
  Buf out = out0;
  sa::Options opt;
  opt.strategy = sa::Strategy::direct;
  opt.num_threads = threads;
  opt.ignore_index = ignore;
  sa::index_add_rows(mat(out, n, d, os), idx.view(), cmat(src, k, d, ss), {w, k, DType::f32}, opt);
  return out;
}

// The contract, one element at a time (std::fma: one rounding). Only touched rows are rounded
// back, so untouched rows keep their bits.
void reference_add(Buf& out, int64_t n, int64_t d, int64_t os, const Buf& src, int64_t ss,
                   const std::vector<int64_t>& iv, const float* w, std::optional<int64_t> ignore) {
  const DType t = out.dtype;
  std::vector<double> acc64;
  std::vector<float> acc32;
  std::vector<char> touched(static_cast<size_t>(n), 0);
  if (t == DType::f64)
    acc64.resize(static_cast<size_t>(n * d));
  else
    acc32.resize(static_cast<size_t>(n * d));
  for (const int64_t r : iv)
    if (!(ignore && r == *ignore)) touched[r] = 1;
  for (int64_t r = 0; r < n; ++r)  // only the rows that contributions reach start from out
    for (int64_t j = 0; touched[r] && j < d; ++j) {
      if (t == DType::f64)
        acc64[r * d + j] = out.get(r * os + j);
      else
        acc32[r * d + j] = static_cast<float>(out.get(r * os + j));
    }
  for (size_t i = 0; i < iv.size(); ++i) {
    const int64_t r = iv[i];
    if (ignore && r == *ignore) continue;
    for (int64_t j = 0; j < d; ++j) {
      const double s = src.get(i * ss + j);
      if (t == DType::f64) {
        double& a = acc64[r * d + j];
        a = w ? std::fma(static_cast<double>(w[i]), s, a) : a + s;
      } else {
        float& a = acc32[r * d + j];
        a = w ? std::fma(w[i], static_cast<float>(s), a) : a + static_cast<float>(s);
      }
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    if (!touched[r]) continue;
    for (int64_t j = 0; j < d; ++j) {
      if (t == DType::f64)
        out.set(r * os + j, acc64[r * d + j]);
      else
        out.set(r * os + j, acc32[r * d + j]);  // f32 exact; bf16/f16 one rounding (set rounds)
    }
  }
}

struct StrategyShape {
  int64_t n, k, d;
  Pattern p;
};
const StrategyShape kStrategyShapes[] = {
    {1, 5, 1, Pattern::uniform},      {37, 80, 1, Pattern::uniform},   {4096, 64, 3, Pattern::uniform},
    {50, 2000, 2, Pattern::zipf},     {20, 60, 17, Pattern::all_equal}, {300, 600, 64, Pattern::moe_topk},
    {64, 700, 33, Pattern::hot_row},  {40, 30, 1030, Pattern::hot_row}, {100, 300, 129, Pattern::sorted},
    {5000, 3000, 16, Pattern::zipf},  {2000, 5000, 1, Pattern::sorted}, {50, 900, 1030, Pattern::sorted},
    // long runs of a sorted index (summed run by run), one column and a few
    {30, 3000, 1, Pattern::sorted},   {3, 500, 5, Pattern::sorted},
    // a bf16/f16 scratch over one column, large enough for a row split across threads
    {20000, 60000, 1, Pattern::uniform},
    // rows of 2 to 4 columns, added element by element by the direct walks: repeated rows in a
    // dense scratch (N <= K) and in a sparse one (N > K)
    {300, 2000, 4, Pattern::uniform}, {3000, 1000, 4, Pattern::zipf},  {2000, 900, 3, Pattern::hot_row},
    // a hot row wider than the hot-row buffer (16 KiB of sums): summed in several column chunks
    {8, 40, 4500, Pattern::hot_row},
    // a hot row of a few register blocks: buffered on one thread, and split by columns into
    // shares on both sides of the buffered path's threshold on two and three
    {16, 200, 300, Pattern::hot_row},
};
const sa::Strategy kStrategies[] = {sa::Strategy::direct, sa::Strategy::count, sa::Strategy::radix};

TEST(Strategies, EveryStrategyAndThreadCountGivesTheContractBits) {
  uint64_t seed = 100;
  for (const StrategyShape& sh : kStrategyShapes)
    for (DType t : kDtypes)
      for (IndexType it : kItypes)
        for (bool weighted : {false, true})
          for (bool ig : {false, true}) {
            std::mt19937_64 rng(seed++);
            const int64_t os = sh.d + (seed % 3 == 0 ? 3 : 0), ss = sh.d + (seed % 2 ? 5 : 0);
            const Buf out0 = special_buf(t, static_cast<size_t>(sh.n * os), rng);
            const Buf src = special_buf(t, static_cast<size_t>(std::max<int64_t>(sh.k * ss, 1)), rng);
            std::vector<int64_t> iv = make_indices(sh.p, sh.n, sh.k, rng);
            std::optional<int64_t> ignore;
            if (ig) {
              ignore = -1;
              for (int64_t i = 0; i < sh.k; i += 4) iv[static_cast<size_t>(i)] = -1;
            }
            const Idx idx = make_idx(it, iv);
            const std::vector<float> w = special_weights(sh.k, rng);
            Buf want = out0;
            reference_add(want, sh.n, sh.d, os, src, ss, iv, weighted ? w.data() : nullptr, ignore);
            for (sa::Strategy st : kStrategies)
              for (int threads : {1, 2, 3}) {
                Buf out = out0;
                sa::Options opt;
                opt.strategy = st;
                opt.num_threads = threads;
                opt.ignore_index = ignore;
                sa::index_add_rows(mat(out, sh.n, sh.d, os), idx.view(), cmat(src, sh.k, sh.d, ss),
                                   {weighted ? w.data() : nullptr, sh.k, DType::f32}, opt);
                if (out.bytes != want.bytes) {
                  size_t e = 0;
                  while (e < out.size() && out.get(e) == want.get(e)) ++e;
                  FAIL() << sa::dtype_name(t) << (it == IndexType::i32 ? " i32" : " i64")
                         << (weighted ? " weighted" : "") << (ig ? " ignore" : "") << " N=" << sh.n
                         << " K=" << sh.k << " D=" << sh.d << " strategy=" << sa::strategy_name(st)
                         << " threads=" << threads << " isa=" << sa::isa_name(sa::active_isa())
                         << ": element " << e << " is " << out.get(e) << ", want " << want.get(e);
                }
              }
          }
}

// The direct walk's row split (each thread a range of rows, every thread walking the whole index)
// runs only where the work per entry pays for the skipped entries: shapes where it does, at three
// threads, against the reference.
// bf16/fp16 sum in dense slots at the first shape (16 columns, N up to 3 K) and in sparse ones at
// the second.
TEST(Strategies, DirectRowSplitGivesTheContractBits) {
  uint64_t seed = 300;
  struct Shape {
    int64_t n, k, d;
  };
  ASSERT_TRUE(sa::cpu::touched_slots_pay(30000, 20000, 16, false, 20000.0 / 30000));
  for (const Shape sh : {Shape{30000, 20000, 16}, Shape{20000, 6000, 64}})
  for (DType t : kDtypes)
    for (Pattern p : {Pattern::uniform, Pattern::zipf})
      for (bool weighted : {false, true}) {
        const int64_t n = sh.n, k = sh.k, d = sh.d;
        ASSERT_TRUE(sa::cpu::direct_row_split_pays({n, k, d, t}, 3)) << sa::dtype_name(t) << " D=" << d;
        std::mt19937_64 rng(seed++);
        const Buf out0 = special_buf(t, static_cast<size_t>(n * d), rng);
        const Buf src = special_buf(t, static_cast<size_t>(k * d), rng);
        std::vector<int64_t> iv = make_indices(p, n, k, rng);
        for (int64_t i = 0; i < k; i += 7) iv[static_cast<size_t>(i)] = -1;
        const Idx idx = make_idx(IndexType::i32, iv);
        const std::vector<float> w = special_weights(k, rng);
        Buf want = out0;
        reference_add(want, n, d, d, src, d, iv, weighted ? w.data() : nullptr, int64_t(-1));
        for (int threads : {1, 3}) {
          const Buf out = direct_walk(out0, n, d, d, idx, src, k, d, weighted ? w.data() : nullptr, threads, -1);
          ASSERT_EQ(out.bytes, want.bytes) << sa::dtype_name(t) << " D=" << d << (weighted ? " weighted" : "")
                                           << " threads=" << threads;
        }
      }
  // One column of a small table: not worth it; one thread walks.
  EXPECT_FALSE(sa::cpu::direct_row_split_pays({100000, 1000000, 1, DType::f32}, 2));
}

// A row split over rows of 64 to 512 bytes into an out larger than the caches (rows of 256 bytes
// and more: from 1 MiB) compacts each block of entries to the thread's own before it adds them:
// float32/float64 rows, and bf16/fp16 rows where no row repeats (added in place), with ignored
// entries (the ignore value outside every thread's rows, and inside the last's), weights, both
// index types, a K that leaves a part block, strided rows, at two and three threads, against the
// reference.
TEST(Strategies, DirectRowSplitCompactedGivesTheContractBits) {
  using P = sa::cpu::CpuPolicy;
  uint64_t seed = 900;
  struct Shape {
    int64_t k, d;
    bool distinct;   // every row at most once
    int split_from;  // the fewest threads that split the rows (asserted)
  };
  struct Case {
    IndexType it;
    bool weighted, ignore_inside;
  };
  const Case cases[] = {{IndexType::i32, false, false}, {IndexType::i64, true, true}};
  for (const Shape sh : {Shape{6001, 64, false, 2}, Shape{20000, 16, false, 2}, Shape{30000, 32, true, 3}})
    for (DType t : kDtypes) {
      const int64_t k = sh.k, d = sh.d, row_bytes = d * static_cast<int64_t>(sa::dtype_size(t));
      if (row_bytes < P::kCompactMinRowBytes || row_bytes > P::kCompactMaxRowBytes) continue;
      if (sa::dtype_size(t) == 2 && !sh.distinct) continue;  // repeated rows: a float32 scratch
      const double min_out = row_bytes >= P::kCompactWideRowBytes ? P::kCompactWideMinOutBytes : P::kCompactMinOutBytes;
      // at least K rows: distinct rows, and rows named at most kRowSplitMaxLoad times
      const int64_t n = std::max(static_cast<int64_t>(min_out) / row_bytes, k) + 1000;
      ASSERT_TRUE(sa::cpu::direct_compacts({n, k, d, t}));
      for (const Case c : cases) {
        const int64_t ignore = c.ignore_inside ? n - 3 : -1;
        const int64_t os = c.weighted ? d + 3 : d, ss = c.weighted ? d : d + 5;
        std::mt19937_64 rng(seed++);
        Buf out0(t, static_cast<size_t>(n * os));  // up to 32 MiB and more: a special tile repeated
        const Buf tile = special_buf(t, size_t(1) << 16, rng);
        for (size_t at = 0; at < out0.bytes.size(); at += tile.bytes.size())
          std::memcpy(out0.bytes.data() + at, tile.bytes.data(), std::min(tile.bytes.size(), out0.bytes.size() - at));
        const Buf src = special_buf(t, static_cast<size_t>(k * ss), rng);
        std::vector<int64_t> iv = sh.distinct ? std::vector<int64_t>(static_cast<size_t>(k))
                                              : make_indices(Pattern::uniform, n, k, rng);
        if (sh.distinct)
          for (int64_t i = 0; i < k; ++i) iv[static_cast<size_t>(i)] = (i * 7919 + 11) % n;
        for (int64_t i = 0; i < k; i += 7) iv[static_cast<size_t>(i)] = ignore;
        const Idx idx = make_idx(c.it, iv);
        const std::vector<float> w = special_weights(k, rng);
        Buf want = out0;
        reference_add(want, n, d, os, src, ss, iv, c.weighted ? w.data() : nullptr, ignore);
        for (int threads : {2, 3}) {
          sa::Options o;
          o.num_threads = threads;
          if (threads >= sh.split_from) {
            ASSERT_TRUE(sa::cpu::direct_split({n, k, d, t}, o, false).rows)
                << sa::dtype_name(t) << " D=" << d << " threads=" << threads;
          }
          Buf out = out0;
          o.strategy = sa::Strategy::direct;
          o.ignore_index = ignore;
          sa::index_add_rows(mat(out, n, d, os), idx.view(), cmat(src, k, d, ss),
                             {c.weighted ? w.data() : nullptr, k, DType::f32}, o);
          ASSERT_EQ(out.bytes, want.bytes) << sa::dtype_name(t) << " D=" << d << " ignore=" << ignore
                                           << (c.weighted ? " weighted" : "") << " threads=" << threads;
        }
      }
    }
}

// A plan walk over more bytes than the caches hold prefetches source rows of up to 2 KiB whole
// (RowsJob::far): rows of 2000 bytes (2048 for float32), a uniform index and one with
// hot rows, weights and ignored entries, both plan sorts, one and three threads, against the
// reference.
TEST(Strategies, FarPlanWalkOverRowsOfUpTo2KiBGivesTheContractBits) {
  using P = sa::cpu::CpuPolicy;
  uint64_t seed = 950;
  for (DType t : kDtypes) {
    const int64_t row_bytes = t == DType::f32 ? 2048 : 2000;
    const int64_t d = row_bytes / static_cast<int64_t>(sa::dtype_size(t)), k = 18000, n = 8000;
    for (const Pattern pat : {Pattern::uniform, Pattern::zipf}) {
      std::mt19937_64 rng(seed++);
      const Buf out0 = special_buf(t, static_cast<size_t>(n * d), rng);
      const Buf src = special_buf(t, static_cast<size_t>(k * d), rng);
      std::vector<int64_t> iv = make_indices(pat, n, k, rng);
      const int64_t ignore = iv[5];
      // The walk's bytes as run_planned counts them: its kept sources and its distinct rows.
      std::vector<char> hit(static_cast<size_t>(n));
      int64_t kept = 0, distinct = 0;
      for (const int64_t r : iv)
        if (r != ignore) {
          ++kept;
          distinct += !hit[static_cast<size_t>(r)];
          hit[static_cast<size_t>(r)] = 1;
        }
      ASSERT_GE((kept + distinct) * row_bytes, P::kFarWalkBytes) << sa::dtype_name(t);
      const Idx idx = make_idx(IndexType::i32, iv);
      const std::vector<float> w = special_weights(k, rng);
      Buf want = out0;
      reference_add(want, n, d, d, src, d, iv, w.data(), ignore);
      for (const sa::Strategy st : {sa::Strategy::count, sa::Strategy::radix})
        for (int threads : {1, 3}) {
          sa::Options o;
          o.num_threads = threads;
          o.strategy = st;
          o.ignore_index = ignore;
          Buf out = out0;
          sa::index_add_rows(mat(out, n, d, d), idx.view(), cmat(src, k, d, d), {w.data(), k, DType::f32}, o);
          ASSERT_EQ(out.bytes, want.bytes) << sa::dtype_name(t) << " D=" << d << " " << sa::strategy_name(st)
                                           << " threads=" << threads << (pat == Pattern::zipf ? " zipf" : "");
        }
    }
  }
}

// Rows wide enough for a column split: the direct walk gives the threads ranges of rows instead
// when a sample of the index shows them balanced (each shape asserts which it sees at two
// threads), and columns of every row when a hot row holds most entries; a sorted index takes
// shares of its runs or, for one long run, columns. Every dtype (dense and sparse scratches for
// bf16/fp16), ignored entries, weights, strided rows, both index types, at one to
// three threads, against the reference.
TEST(Strategies, WideRowsSplitByRowsWhenBalancedGiveTheContractBits) {
  struct Shape {
    int64_t n, k, d;
    Pattern p;
    // at two threads: 1 rows, 0 columns, 2 rows for float32/float64 (bf16/fp16 cut whole blocks of
    // 64 rows, one block here), -1 not asserted (sorted: run_sorted decides)
    int balanced;
  };
  const Shape shapes[] = {
      {256, 256, 1024, Pattern::uniform, 1}, {64, 64, 700, Pattern::uniform, 2},
      {256, 600, 1100, Pattern::uniform, 1}, {1000, 300, 1030, Pattern::uniform, 1},
      {40, 300, 1030, Pattern::hot_row, 0},  {3000, 1000, 600, Pattern::zipf, -1},
      {300, 900, 777, Pattern::sorted, -1},  {50, 400, 1030, Pattern::all_equal, -1},
  };
  uint64_t seed = 700;
  for (const Shape& sh : shapes)
    for (DType t : kDtypes) {
      const int64_t n = sh.n, k = sh.k, d = sh.d;
      sa::Options two;
      two.num_threads = 2;
      const sa::cpu::DirectSplit split = sa::cpu::direct_split({n, k, d, t}, two, sh.p == Pattern::sorted);
      ASSERT_TRUE(split.columns && split.threads == 2) << sa::dtype_name(t) << " N=" << n << " D=" << d;
      ASSERT_EQ(split.rows_when_balanced, sh.p != Pattern::sorted);
      for (int variant = 0; variant < 4; ++variant) {
        const bool weighted = variant & 1, i64 = variant & 2;
        const int64_t os = d + (variant == 1 ? 3 : 0), ss = d + (variant == 2 ? 5 : 0);
        std::mt19937_64 rng(seed++);
        const Buf out0 = special_buf(t, static_cast<size_t>(n * os), rng);
        const Buf src = special_buf(t, static_cast<size_t>(k * ss), rng);
        std::vector<int64_t> iv = make_indices(sh.p, n, k, rng);
        if (sh.p != Pattern::sorted && sh.p != Pattern::all_equal)
          for (int64_t i = 3; i < k; i += 7) iv[static_cast<size_t>(i)] = -1;
        const Idx idx = make_idx(i64 ? IndexType::i64 : IndexType::i32, iv);
        if (sh.balanced >= 0) {
          const bool narrow = sa::dtype_size(t) == 2;
          int shift = narrow ? 6 : 0;
          while ((n >> shift) >= sa::cpu::CpuPolicy::kMaxBlocks) ++shift;
          const bool want_rows = sh.balanced == 1 || (sh.balanced == 2 && !narrow);
          // as run_direct cuts them: float32/float64 ranges by their entries alone
          ASSERT_EQ(sa::cpu::cut_rows(idx.view(), n, 2, shift, narrow ? 1 : 0).balanced, want_rows)
              << sa::dtype_name(t) << " N=" << n << " K=" << k;
        }
        const std::vector<float> w = special_weights(k, rng);
        Buf want = out0;
        reference_add(want, n, d, os, src, ss, iv, weighted ? w.data() : nullptr, int64_t(-1));
        for (int threads : {1, 2, 3}) {
          const Buf out = direct_walk(out0, n, d, os, idx, src, k, ss, weighted ? w.data() : nullptr, threads, -1);
          ASSERT_EQ(out.bytes, want.bytes) << sa::dtype_name(t) << " N=" << n << " K=" << k << " D=" << d
                                           << " variant=" << variant << " threads=" << threads;
        }
      }
    }
}

// bf16/fp16 on two threads: a row split that deals the entries out to their rows' threads first
// (each shape asserts whether it does at the level in use: the AVX-512 levels deal rows of 2 and
// 4 bytes by vectors, and so at more shapes), with sparse, touched and dense scratches, ignored
// entries below and above the split, strided rows, weights, both index types; and one thread
// walking while both copy a large scratch in and back. Against the reference, and on one thread.
TEST(Strategies, TwoThreadRowSplitsGiveTheContractBits) {
  struct Shape {
    int64_t n, k, d;
    Pattern p;
    bool dealt, vector_dealt;  // else: one thread walks, two copy (below the AVX-512 levels; at them)
  };
  const Shape shapes[] = {
      {200000, 30000, 1, Pattern::uniform, true, true},  // sparse scratch
      {200000, 30000, 1, Pattern::zipf, true, true},
      {200000, 30001, 2, Pattern::uniform, true, true},  // an odd K: halves of K / 2 and K / 2 + 1 entries
      {30000, 20000, 16, Pattern::uniform, true, true},  // dense (16 columns, N up to 3 K)
      {400000, 100000, 2, Pattern::zipf, true, true},    // touched slots (hot rows repeat)
      {100000, 300000, 8, Pattern::zipf, true, true},    // dense, marked
      {60000, 40000, 4, Pattern::uniform, true, true},
      {100000, 100000, 1, Pattern::uniform, false, true},  // dense, compared with its snapshot
      {150000, 100000, 1, Pattern::uniform, false, true},  // dense (N up to 3 K), with its snapshot
      {150000, 100000, 2, Pattern::uniform, false, true},  // the same, two columns
      {50000, 100000, 1, Pattern::uniform, false, false},  // dense, with its snapshot
  };
  const bool vectors = sa::active_isa() >= sa::Isa::avx512;
  uint64_t seed = 350;
  for (const Shape& sh : shapes)
    for (DType t : {DType::bf16, DType::f16}) {
      const int64_t n = sh.n, k = sh.k, d = sh.d;
      sa::Options two;
      two.num_threads = 2;
      const sa::cpu::DirectSplit split = sa::cpu::direct_split({n, k, d, t}, two, false);
      if (vectors ? sh.vector_dealt : sh.dealt) {
        ASSERT_TRUE(split.rows && sa::cpu::direct_deals({n, k, d, t}, 2)) << sa::dtype_name(t) << " N=" << n << " D=" << d;
      } else {
        ASSERT_EQ(split.threads, 1) << sa::dtype_name(t) << " N=" << n << " D=" << d;
      }
      for (int variant = 0; variant < 4; ++variant) {
        const bool weighted = variant & 1, i64 = variant & 2;
        // ignored entries at -1, or at a row of the upper half (counted apart from that thread's)
        const int64_t ign = variant < 2 ? int64_t(-1) : n / 2 + 3;
        const int64_t os = d + (variant == 1 ? 3 : 0), ss = d + (variant == 2 ? 5 : 0);
        std::mt19937_64 rng(seed++);
        const Buf out0 = special_buf(t, static_cast<size_t>(n * os), rng);
        const Buf src = special_buf(t, static_cast<size_t>(k * ss), rng);
        std::vector<int64_t> iv = make_indices(sh.p, n, k, rng);
        for (int64_t i = 0; i < k; ++i)
          if (iv[static_cast<size_t>(i)] == ign || i % 7 == 3) iv[static_cast<size_t>(i)] = ign;
        const Idx idx = make_idx(i64 ? IndexType::i64 : IndexType::i32, iv);
        const std::vector<float> w = special_weights(k, rng);
        Buf want = out0;
        reference_add(want, n, d, os, src, ss, iv, weighted ? w.data() : nullptr, ign);
        for (int threads : {1, 2}) {
          const Buf out = direct_walk(out0, n, d, os, idx, src, k, ss, weighted ? w.data() : nullptr, threads, ign);
          ASSERT_EQ(out.bytes, want.bytes) << sa::dtype_name(t) << " N=" << n << " K=" << k << " D=" << d
                                           << " variant=" << variant << " threads=" << threads;
        }
      }
    }
  // Every entry in the first row or in the last: the cut leaves one thread no entries (first
  // row), or no rows (last row, where the cut falls at N).
  for (DType t : {DType::bf16, DType::f16})
    for (bool upper : {false, true}) {
      const int64_t n = 200000, k = 30000;
      ASSERT_TRUE(sa::cpu::direct_deals({n, k, 1, t}, 2));
      std::mt19937_64 rng(seed++);
      const Buf out0 = special_buf(t, static_cast<size_t>(n), rng);
      const Buf src = special_buf(t, static_cast<size_t>(k), rng);
      const std::vector<int64_t> iv(static_cast<size_t>(k), upper ? n - 1 : 0);
      const Idx idx = make_idx(IndexType::i32, iv);
      Buf want = out0;
      reference_add(want, n, 1, 1, src, 1, iv, nullptr, std::nullopt);
      Buf out = out0;
      sa::Options opt;
      opt.strategy = sa::Strategy::direct;
      opt.num_threads = 2;
      sa::index_add_rows(mat(out, n, 1, 1), idx.view(), cmat(src, k, 1, 1), {}, opt);
      ASSERT_EQ(out.bytes, want.bytes) << sa::dtype_name(t) << (upper ? " last row" : " first row");
    }
}

// One column of an output larger than the caches (rows prefetched ahead of the walk): the direct
// walk's column kernels, in place (float32/float64) and through a dense or sparse scratch (bf16,
// fp16), against the reference.
TEST(Strategies, OneColumnOfALargeOutputGivesTheContractBits) {
  uint64_t seed = 900;
  for (DType t : kDtypes)
    // N > 3 K: sparse scratch; N <= 3 K (one column): dense
    for (int64_t k : {int64_t(150000), int64_t(190000), int64_t(600000)})
      for (bool weighted : {false, true})
        for (int threads : {1, 2}) {
          const int64_t n = 560000;  // 1 MiB and more of bf16: prefetched
          std::mt19937_64 rng(seed++);
          const Buf out0 = special_buf(t, static_cast<size_t>(n), rng);
          const Buf src = special_buf(t, static_cast<size_t>(k), rng);
          std::vector<int64_t> iv = make_indices(seed % 2 ? Pattern::zipf : Pattern::uniform, n, k, rng);
          for (int64_t i = 0; i < k; i += 9) iv[static_cast<size_t>(i)] = -1;
          const Idx idx = make_idx(IndexType::i32, iv);
          const std::vector<float> w = special_weights(k, rng);
          Buf want = out0;
          reference_add(want, n, 1, 1, src, 1, iv, weighted ? w.data() : nullptr, int64_t(-1));
          const Buf out = direct_walk(out0, n, 1, 1, idx, src, k, 1, weighted ? w.data() : nullptr, threads, -1);
          ASSERT_EQ(out.bytes, want.bytes) << sa::dtype_name(t) << " K=" << k << (weighted ? " weighted" : "")
                                           << " threads=" << threads;
        }
}

// bf16/fp16 with more rows than entries: touched slots (a float32 slot per row, filled by the
// row's first contribution) where they fit and rows repeat, sparse ones (slots for the repeated
// rows only) elsewhere; each shape asserts which one it exercises. One column large enough to be
// prefetched, and rows of 2 to 17 columns, on 1 to 3 threads.
TEST(Strategies, TouchedAndSparseSlotsGiveTheContractBits) {
  struct Shape {
    int64_t n, k, d;
    Pattern p;
    bool touched;
  };
  // Zipf's hot rows make a load of 0.25 to 0.29 entries per row count as repeated (sampled);
  // a uniform one of 0.125 does not. (Rows of up to 16 columns, N <= 3 K, take the dense scratch
  // instead; so touched slots need N > 3 K, and a sample, from 65536 entries.)
  const Shape shapes[] = {
      {800000, 200000, 1, Pattern::zipf, true},  {400000, 100000, 2, Pattern::zipf, true},
      {700000, 200000, 2, Pattern::zipf, true},  {250000, 70000, 3, Pattern::hot_row, true},
      {300000, 80000, 5, Pattern::zipf, true},   {800000, 100000, 1, Pattern::uniform, false},
      {1700000, 50000, 1, Pattern::zipf, false}, {3000, 500, 4, Pattern::uniform, false},
      {3000, 2000, 17, Pattern::zipf, false},
  };
  uint64_t seed = 1300;
  for (const Shape& sh : shapes) {
    for (DType t : {DType::bf16, DType::f16})
      for (IndexType it : kItypes)
        for (bool weighted : {false, true}) {
          std::mt19937_64 rng(seed++);
          const Buf out0 = special_buf(t, static_cast<size_t>(sh.n * sh.d), rng);
          const Buf src = special_buf(t, static_cast<size_t>(sh.k * sh.d), rng);
          std::vector<int64_t> iv = make_indices(sh.p, sh.n, sh.k, rng);
          for (int64_t i = 0; i < sh.k; i += 11) iv[static_cast<size_t>(i)] = -1;
          const Idx idx = make_idx(it, iv);
          ASSERT_FALSE(sa::cpu::dense_scratch(sh.n, sh.k, sh.d)) << "N=" << sh.n << " K=" << sh.k << " D=" << sh.d;
          ASSERT_EQ(sa::cpu::touched_slots_pay(sh.n, sh.k, sh.d, false, sa::cpu::sampled_load(idx.view(), sh.n, -1)),
                    sh.touched)
              << "N=" << sh.n << " K=" << sh.k << " D=" << sh.d;
          const std::vector<float> w = special_weights(sh.k, rng);
          Buf want = out0;
          reference_add(want, sh.n, sh.d, sh.d, src, sh.d, iv, weighted ? w.data() : nullptr, int64_t(-1));
          for (int threads : {1, 2, 3}) {
            const Buf out =
                direct_walk(out0, sh.n, sh.d, sh.d, idx, src, sh.k, sh.d, weighted ? w.data() : nullptr, threads, -1);
            ASSERT_EQ(out.bytes, want.bytes) << sa::dtype_name(t) << (it == IndexType::i32 ? " i32" : " i64")
                                             << (weighted ? " weighted" : "") << " N=" << sh.n << " K=" << sh.k
                                             << " D=" << sh.d << " threads=" << threads;
          }
        }
  }
}

// The load that picks touched slots: K / N for a uniform index, far more for one with hot rows
// (K times the chance that two entries share a row), and K / N again below the sampling size.
TEST(Strategies, SampledLoadSeesHotRows) {
  std::mt19937_64 rng(77);
  const int64_t n = 1000000, k = 100000;
  const Idx uniform = make_idx(IndexType::i32, make_indices(Pattern::uniform, n, k, rng));
  const double lu = sa::cpu::sampled_load(uniform.view(), n, std::nullopt);
  EXPECT_GE(lu, 0.1);
  EXPECT_LT(lu, sa::cpu::CpuPolicy::kTouchedMinLoad);
  const Idx zipf = make_idx(IndexType::i64, make_indices(Pattern::zipf, n, k, rng));
  EXPECT_GT(sa::cpu::sampled_load(zipf.view(), n, std::nullopt), 10.0);
  std::vector<int64_t> one(static_cast<size_t>(k), 7);
  const Idx same = make_idx(IndexType::i32, one);
  EXPECT_NEAR(sa::cpu::sampled_load(same.view(), n, std::nullopt), static_cast<double>(k), 1.0);
  // ignored entries are not samples: all but a uniform few ignored leaves a uniform load
  for (int64_t i = 0; i < k; ++i) one[static_cast<size_t>(i)] = i % 8 == 0 ? (i * 7919) % n : 7;
  const Idx mostly_ignored = make_idx(IndexType::i32, one);
  EXPECT_LT(sa::cpu::sampled_load(mostly_ignored.view(), n, int64_t(7)), sa::cpu::CpuPolicy::kTouchedMinLoad);
  const Idx small = make_idx(IndexType::i32, std::vector<int64_t>(1000, 3));
  EXPECT_DOUBLE_EQ(sa::cpu::sampled_load(small.view(), n, std::nullopt), 1000.0 / n);
}

// float16 elements convert one at a time (a column, a short row) by the F16C instructions on the
// levels compiled with them, and in integer arithmetic on the scalar one: every fp16 bit pattern
// as out (infinities, NaNs of every payload, subnormals, both zeros) plus random non-NaN patterns
// (sums that round at every magnitude, overflow to infinity, land among the subnormals) must give
// the contract's bits on every path that converts elements: the sorted index's runs, a dense
// scratch (N <= K), a sparse one and touched slots (N > K), the direct walk in place of rows met
// once, and the planned walks.
TEST(Strategies, EveryFloat16BitPatternConvertsAsTheContractSays) {
  const int64_t n = 65536;
  std::mt19937_64 rng(900);
  Buf out0(DType::f16, static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) reinterpret_cast<uint16_t*>(out0.data())[r] = static_cast<uint16_t>(r);
  struct Case {
    const char* name;
    std::vector<int64_t> iv;
  };
  std::vector<Case> cases;
  std::vector<int64_t> iv(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) iv[static_cast<size_t>(i)] = i;
  cases.push_back({"identity (sorted runs)", iv});
  std::vector<int64_t> twice(static_cast<size_t>(2 * n));
  for (int64_t i = 0; i < 2 * n; ++i) twice[static_cast<size_t>(i)] = i / 2;
  cases.push_back({"each row twice, sorted", twice});
  std::shuffle(iv.begin(), iv.end(), rng);
  cases.push_back({"permutation (dense scratch)", iv});
  for (int64_t i = 0; i < 2 * n; ++i) twice[static_cast<size_t>(i)] = (i * 40503) % n;
  cases.push_back({"each row twice, scattered", twice});
  cases.push_back({"a quarter of the rows, some twice", make_indices(Pattern::uniform, n, n / 4, rng)});
  cases.push_back({"zipf", make_indices(Pattern::zipf, n, n / 8, rng)});
  for (const Case& c : cases) {
    const int64_t k = static_cast<int64_t>(c.iv.size());
    Buf src(DType::f16, static_cast<size_t>(k));
    for (int64_t i = 0; i < k; ++i) {  // no NaN: the sign of NaN + NaN is the operand order's, not the contract's
      uint16_t h = static_cast<uint16_t>(rng());
      while ((h & 0x7FFF) > 0x7C00) h = static_cast<uint16_t>(rng());
      reinterpret_cast<uint16_t*>(src.data())[i] = h;
    }
    const Idx idx = make_idx(IndexType::i32, c.iv);
    Buf want = out0;
    reference_add(want, n, 1, 1, src, 1, c.iv, nullptr, std::nullopt);
    for (sa::Strategy st : kStrategies)
      for (int threads : {1, 2}) {
        Buf out = out0;
        sa::Options opt;
        opt.strategy = st;
        opt.num_threads = threads;
        sa::index_add_rows(mat(out, n, 1, 1), idx.view(), cmat(src, k, 1, 1), {}, opt);
        for (int64_t e = 0; e < n; ++e)
          ASSERT_EQ(reinterpret_cast<const uint16_t*>(out.data())[e], reinterpret_cast<const uint16_t*>(want.data())[e])
              << c.name << " strategy=" << sa::strategy_name(st) << " threads=" << threads << " isa="
              << sa::isa_name(sa::active_isa()) << " row " << e << std::hex << " (out 0x" << e << ")";
      }
  }
}

// bf16/fp16 rows pass through a float32 scratch, and the way back makes every NaN the canonical
// one: untouched rows holding other NaN payloads (signalling, negative, with payload bits) must
// keep their bits, touched ones get the contract's rounding. Dense and sparse scratch, one column
// and rows wide enough for threads to split them by columns; each after a call that touched every
// row (the scratch buffers a thread keeps between calls must not remember it).
TEST(Strategies, NaNPayloadsOfUntouchedRowsKeepTheirBits) {
  uint64_t seed = 700;
  struct Shape {
    int64_t n, k, d;
  };
  for (DType t : {DType::bf16, DType::f16}) {
    const std::vector<uint16_t> nans = t == DType::bf16 ? std::vector<uint16_t>{0x7F81, 0xFFC1, 0x7FC0, 0xFFFF}
                                                        : std::vector<uint16_t>{0x7C01, 0xFE01, 0x7E00, 0xFFFF};
    for (Shape sh : {Shape{64, 300, 1}, Shape{64, 300, 2}, Shape{64, 300, 300}, Shape{64, 300, 1100}, Shape{4000, 300, 3},
                     Shape{800, 300, 1}})
      for (sa::Strategy st : kStrategies)
        for (int threads : {1, 2}) {
          std::mt19937_64 rng(seed++);
          Buf out0 = special_buf(t, static_cast<size_t>(sh.n * sh.d), rng);
          uint16_t* bits = reinterpret_cast<uint16_t*>(out0.data());
          for (int64_t r = 0; r < sh.n; r += 3)  // NaNs in touched rows (below n / 2) and untouched ones
            bits[r * sh.d + r % sh.d] = nans[static_cast<size_t>(r / 3) % nans.size()];
          const Buf src = special_buf(t, static_cast<size_t>(sh.k * sh.d), rng);
          const std::vector<int64_t> iv = make_indices(Pattern::uniform, sh.n / 2, sh.k, rng);
          const Idx idx = make_idx(IndexType::i32, iv);
          Buf want = out0;
          reference_add(want, sh.n, sh.d, sh.d, src, sh.d, iv, nullptr, std::nullopt);
          Buf out = out0;
          sa::Options opt;
          opt.strategy = st;
          opt.num_threads = threads;
          {  // a call just before, in this thread, that names every row: none of it may carry over
            std::vector<int64_t> all(static_cast<size_t>(sh.n));
            for (int64_t r = 0; r < sh.n; ++r) all[static_cast<size_t>(r)] = sh.n - 1 - r;  // not sorted
            const Idx every = make_idx(IndexType::i32, all);
            Buf other = out0;
            const Buf ones = special_buf(t, static_cast<size_t>(sh.n * sh.d), rng);
            sa::index_add_rows(mat(other, sh.n, sh.d, sh.d), every.view(), cmat(ones, sh.n, sh.d, sh.d), {}, opt);
          }
          sa::index_add_rows(mat(out, sh.n, sh.d, sh.d), idx.view(), cmat(src, sh.k, sh.d, sh.d), {}, opt);
          for (size_t e = 0; e < out.size(); ++e)
            ASSERT_EQ(reinterpret_cast<const uint16_t*>(out.data())[e], reinterpret_cast<const uint16_t*>(want.data())[e])
                << sa::dtype_name(t) << " N=" << sh.n << " K=" << sh.k << " D=" << sh.d
                << " strategy=" << sa::strategy_name(st) << " threads=" << threads << " element " << e
                << " (row " << static_cast<int64_t>(e) / sh.d << ")";
        }
  }
}

// With denormals-are-zero and flush-to-zero set (torch.set_flush_denormal(True) does), rows that
// receive nothing keep their bits, subnormals included, whichever path the scratch takes.
TEST(Strategies, UntouchedSubnormalsSurviveFlushDenormalMode) {
  const unsigned saved = _mm_getcsr();
  for (DType t : {DType::bf16, DType::f16})
    for (int64_t d : {1, 16, 33})
      for (sa::Strategy st : kStrategies) {
        const int64_t n = 8, k = 10;
        Buf out0(t, static_cast<size_t>(n * d));
        uint16_t* bits = reinterpret_cast<uint16_t*>(out0.data());
        for (size_t e = 0; e < out0.size(); ++e) bits[e] = static_cast<uint16_t>(1 + e % 5);  // subnormals
        Buf src(t, static_cast<size_t>(k * d));
        for (size_t e = 0; e < src.size(); ++e) src.set(e, 1.0);
        std::vector<int64_t> iv;
        for (int64_t i = 0; i < k; ++i) iv.push_back(i % 2 ? 7 : 0);  // rows 0 and 7 only
        const Idx idx = make_idx(IndexType::i64, iv);
        Buf out = out0;
        sa::Options opt;
        opt.strategy = st;
        opt.num_threads = 1;
        _mm_setcsr(saved | 0x8040);  // FTZ | DAZ
        sa::index_add_rows(mat(out, n, d, d), idx.view(), cmat(src, k, d, d), {}, opt);
        _mm_setcsr(saved);
        for (int64_t e = d; e < 7 * d; ++e)
          ASSERT_EQ(reinterpret_cast<const uint16_t*>(out.data())[e], bits[e])
              << sa::dtype_name(t) << " D=" << d << " strategy=" << sa::strategy_name(st) << " element " << e;
      }
}

// The floating-point control is per thread (torch.set_flush_denormal sets it on the calling one
// only): the worker threads must add under the caller's, or rows a worker sums keep subnormals the
// caller's rows flush. Subnormal weights (-2^-130) times 1: -2^-130 in every touched row with
// subnormals kept, +0 with denormals-are-zero; on two threads the bits must be one thread's.
TEST(Strategies, WorkerThreadsAddUnderTheCallersFlushDenormalMode) {
  const unsigned saved = _mm_getcsr();
  struct Shape {
    int64_t n, k, d;
  };
  for (DType t : {DType::f32, DType::bf16, DType::f16})
    for (Shape sh : {Shape{4096, 65536, 64}, Shape{200000, 400000, 1}})
      for (sa::Strategy st : kStrategies) {
        std::mt19937_64 rng(static_cast<uint64_t>(sh.d) * 7 + static_cast<uint64_t>(st));
        Buf out0(t, static_cast<size_t>(sh.n * sh.d));
        for (size_t e = 0; e < out0.size(); ++e) out0.set(e, 0.0);
        Buf src(t, static_cast<size_t>(sh.k * sh.d));
        for (size_t e = 0; e < src.size(); ++e) src.set(e, 1.0);
        const std::vector<float> w(static_cast<size_t>(sh.k), -std::ldexp(1.0f, -130));
        const Idx idx = make_idx(IndexType::i32, make_indices(Pattern::uniform, sh.n, sh.k, rng));
        auto run = [&](int threads, bool flush) {
          Buf out = out0;
          sa::Options opt;
          opt.strategy = st;
          opt.num_threads = threads;
          if (flush) _mm_setcsr(saved | 0x8040);  // FTZ | DAZ
          sa::index_add_rows(mat(out, sh.n, sh.d, sh.d), idx.view(), cmat(src, sh.k, sh.d, sh.d), {w.data(), sh.k, DType::f32},
                             opt);
          _mm_setcsr(saved);
          EXPECT_EQ(_mm_getcsr(), saved);
          return out;
        };
        // Two threads first under the default control, so that the worker threads exist (a pool
        // started with the flags set would inherit them).
        const Buf kept = run(2, false), flushed = run(1, true), flushed2 = run(2, true);
        ASSERT_NE(kept.bytes, flushed.bytes) << "denormals-are-zero made no difference";
        for (size_t e = 0; e < flushed.size(); ++e)
          ASSERT_EQ(std::memcmp(flushed.bytes.data() + e * sa::dtype_size(t), flushed2.bytes.data() + e * sa::dtype_size(t),
                                sa::dtype_size(t)),
                    0)
              << sa::dtype_name(t) << " N=" << sh.n << " K=" << sh.k << " D=" << sh.d
              << " strategy=" << sa::strategy_name(st) << " element " << e;
      }
}

// Every level rounds bf16/fp16 sums as the scalar one under each floating-point mode (MXCSR's
// denormals-are-zero and flush-to-zero: neither, either, both), sums among the subnormals and NaNs
// of several payloads included. The avx512_bf16 level rounds by VCVTNEPS2BF16, which flushes
// subnormals and keeps NaN payloads, and sends the lanes it would round otherwise to the integer
// rounding; a class test finds them, and reads a subnormal as zero under denormals-are-zero.
TEST(Strategies, EveryLevelRoundsSubnormalSumsAsScalarUnderEveryFlushMode) {
  const unsigned saved_csr = _mm_getcsr();
  const sa::Isa level = sa::active_isa();
  struct Shape {
    int64_t n, k, d;
  };
  uint64_t seed = 1100;
  for (DType t : {DType::bf16, DType::f16})
    for (unsigned mode : {0x0000u, 0x0040u, 0x8000u, 0x8040u})  // none, DAZ, FTZ, both
      for (Shape sh : {Shape{64, 300, 256}, Shape{4000, 300, 33}, Shape{300, 4000, 1}, Shape{2048, 4096, 64}})
        for (sa::Strategy st : kStrategies)
          for (int threads : {1, 2}) {
            std::mt19937_64 rng(seed++);
            Buf out0 = special_buf(t, static_cast<size_t>(sh.n * sh.d), rng);
            const std::vector<uint16_t> nans = t == DType::bf16 ? std::vector<uint16_t>{0x7F81, 0xFFC1, 0x7FC0, 0xFFFF}
                                                                : std::vector<uint16_t>{0x7C01, 0xFE01, 0x7E00, 0xFFFF};
            uint16_t* bits = reinterpret_cast<uint16_t*>(out0.data());
            for (size_t e = 0; e < out0.size(); e += 97) bits[e] = nans[e / 97 % nans.size()];
            const Buf src = special_buf(t, static_cast<size_t>(sh.k * sh.d), rng);
            const Idx idx = make_idx(IndexType::i32, make_indices(Pattern::uniform, sh.n, sh.k, rng));
            auto run = [&](sa::Isa isa) {
              EXPECT_EQ(sa::set_isa(isa), isa);
              Buf out = out0;
              sa::Options opt;
              opt.strategy = st;
              opt.num_threads = threads;
              _mm_setcsr((saved_csr & ~0x8040u) | mode);
              sa::index_add_rows(mat(out, sh.n, sh.d, sh.d), idx.view(), cmat(src, sh.k, sh.d, sh.d), {}, opt);
              _mm_setcsr(saved_csr);
              return out;
            };
            const Buf want = run(sa::Isa::scalar), got = run(level);
            sa::set_isa(level);
            for (size_t e = 0; e < got.size(); ++e)
              ASSERT_EQ(reinterpret_cast<const uint16_t*>(got.data())[e], reinterpret_cast<const uint16_t*>(want.data())[e])
                  << sa::dtype_name(t) << " mxcsr mode 0x" << std::hex << mode << std::dec << " N=" << sh.n
                  << " K=" << sh.k << " D=" << sh.d << " strategy=" << sa::strategy_name(st) << " threads=" << threads
                  << " isa=" << sa::isa_name(level) << " element " << e;
          }
}

// Two threads updating disjoint rows of one bf16/fp16 output at the same time: each call writes
// back only the rows its index names, so every update lands (a dense scratch that wrote every row
// back, or a vector store that wrote a neighbour's lane back, would restore the other thread's
// rows to what it had read). The threads start together and interleave rows (even and odd), so
// every vector of rows is written by both.
TEST(Strategies, ConcurrentCallsOnDisjointRowsAllLand) {
  for (DType t : {DType::bf16, DType::f16})
    for (int64_t d : {1, 8}) {
      const int64_t n = 4096, k = 2 * n, calls = 100;
      Buf out(t, static_cast<size_t>(n * d));
      for (size_t e = 0; e < out.size(); ++e) out.set(e, 0.0);
      Buf src(t, static_cast<size_t>(k * d));
      for (size_t e = 0; e < src.size(); ++e) src.set(e, 1.0);
      std::vector<Idx> idx;
      for (int64_t p = 0; p < 2; ++p) {
        std::vector<int64_t> iv;
        for (int64_t i = 0; i < k; ++i) iv.push_back((i % (n / 2)) * 2 + p);  // rows of parity p, four times
        idx.push_back(make_idx(IndexType::i64, iv));
      }
      std::atomic<int> ready{0};
      auto work = [&](int p) {
        sa::Options opt;
        opt.strategy = sa::Strategy::direct;
        opt.num_threads = 1;
        ready.fetch_add(1);
        while (ready.load() < 2) std::this_thread::yield();
        for (int64_t c = 0; c < calls; ++c)
          sa::index_add_rows(mat(out, n, d, d), idx[static_cast<size_t>(p)].view(), cmat(src, k, d, d), {}, opt);
      };
      std::thread a(work, 0), b(work, 1);
      a.join();
      b.join();
      for (size_t e = 0; e < out.size(); ++e)
        ASSERT_EQ(out.get(e), 4.0 * calls) << sa::dtype_name(t) << " D=" << d << " element " << e;
    }
}

// The copy back of a dense scratch writes exactly the rows it is given (marked) or the elements
// whose sum differs from the snapshot, and no neighbour in the same vector: another call may be
// updating that neighbour, so even its own value written back could undo the other call's write.
// Here out holds a sentinel that no scratch value rounds to, so any write outside the rows shows.
// Rows of one column (marked or snapshot) and of three (snapshot), back to back.
TEST(Strategies, ScratchCopyBackWritesOnlyItsRows) {
  const sa::cpu::KernelTable& kt = sa::cpu::active_kernels();
  for (DType t : {DType::bf16, DType::f16})
    for (int64_t d : {1, 3})
      for (bool snapshot : {false, true}) {
        if (d > 1 && !snapshot) continue;  // marks of wider rows take the row-by-row loop
        const int64_t n = 150;  // three words, the last partial; vectors whole and partial
        const size_t elems = static_cast<size_t>(n * d);
        std::vector<float> acc(elems), orig(elems);
        std::vector<uint64_t> rows(3, 0);
        std::vector<bool> write(elems);
        for (size_t e = 0; e < elems; ++e) {
          const int64_t r = static_cast<int64_t>(e) / d;
          acc[e] = 1.0f + static_cast<float>(e);
          // marked: whole rows; snapshot: single elements too
          const int64_t x = snapshot ? static_cast<int64_t>(e) : r;
          write[e] = (x * 7) % 3 == 0 || x % 16 == 5 || (x >= 32 && x < 48);
          orig[e] = acc[e] + (write[e] ? 0.5f : 0.0f);
          if (write[e]) rows[static_cast<size_t>(r >> 6)] |= uint64_t(1) << (r & 63);
        }
        const uint16_t sentinel = 0x7BCD;  // bf16 about 2e36, fp16 64928: no acc value rounds to it
        std::vector<uint16_t> out(elems, sentinel);
        sa::cpu::DirectJob job{};
        job.out = out.data();
        job.out_stride = d;
        job.scratch = acc.data();
        job.scratch_stride = d;
        job.row_lo = 0;
        job.row_hi = n;
        job.scratch_orig = snapshot ? orig.data() : nullptr;
        kt.scratch_copy[static_cast<int>(t)](job, snapshot ? nullptr : rows.data(), 0, 3, 0, d, true);
        for (size_t e = 0; e < elems; ++e) {
          Buf want(t, 1);
          want.set(0, acc[e]);
          const uint16_t rounded = reinterpret_cast<const uint16_t*>(want.data())[0];
          const int64_t r = static_cast<int64_t>(e) / d;
          const bool row_written = (rows[static_cast<size_t>(r >> 6)] >> (r & 63)) & 1;
          // An element of a written row whose sum did not change may be written or not (its own
          // bits, in a real call); no element of another row may be.
          if (write[e] || !row_written)
            ASSERT_EQ(out[e], write[e] ? rounded : sentinel)
                << sa::dtype_name(t) << " D=" << d << (snapshot ? " snapshot" : " marked") << " element " << e;
          else
            ASSERT_TRUE(out[e] == sentinel || out[e] == rounded) << sa::dtype_name(t) << " D=" << d << " element " << e;
        }
      }
}

// A sorted index whose ignored entries sit at its ends (padding before the first row and a
// sentinel after the last) is still a sorted index: the runs walk must skip them.
TEST(Strategies, SortedIndexWithIgnoredEndsGivesTheContractBits) {
  uint64_t seed = 500;
  for (DType t : kDtypes)
    for (int64_t ign : {int64_t(-1), int64_t(64)})
      for (int64_t d : {1, 33}) {
        std::mt19937_64 rng(seed++);
        const int64_t n = 64, k = 400;
        std::vector<int64_t> iv = make_indices(Pattern::sorted, n, k, rng);
        if (ign < 0)
          std::fill(iv.begin(), iv.begin() + 50, ign);
        else
          std::fill(iv.end() - 50, iv.end(), ign);
        const Idx idx = make_idx(IndexType::i64, iv);
        const Buf out0 = special_buf(t, static_cast<size_t>(n * d), rng);
        const Buf src = special_buf(t, static_cast<size_t>(k * d), rng);
        const std::vector<float> w = special_weights(k, rng);
        Buf want = out0;
        reference_add(want, n, d, d, src, d, iv, w.data(), ign);
        for (sa::Strategy st : kStrategies)
          for (int threads : {1, 2}) {
            Buf out = out0;
            sa::Options opt;
            opt.strategy = st;
            opt.num_threads = threads;
            opt.ignore_index = ign;
            sa::index_add_rows(mat(out, n, d, d), idx.view(), cmat(src, k, d, d), {w.data(), k, DType::f32}, opt);
            ASSERT_EQ(out.bytes, want.bytes) << sa::dtype_name(t) << " ignore=" << ign << " d=" << d
                                             << " strategy=" << sa::strategy_name(st) << " threads=" << threads;
          }
      }
}

// An ignore_index outside the int32 range names no entry of an int32 index, even one equal to a
// row modulo 2^32 (the compare is made in int64): sorted runs of 1, 2 and 40 (both walks of a
// sorted index) and a shuffled index, rows of 1 and 4 columns, every strategy, 1 and 2 threads.
TEST(Strategies, IgnoreIndexPastInt32NamesNoRowOfAnInt32Index) {
  uint64_t seed = 900;
  for (DType t : kDtypes)
    for (int64_t len : {1, 2, 40, 0})  // 0: runs of 1 to 3, shuffled
      for (int64_t d : {1, 4}) {
        std::mt19937_64 rng(seed++);
        const int64_t n = 300;
        std::vector<int64_t> iv;
        for (int64_t r = 0; r < n; ++r)
          iv.insert(iv.end(), static_cast<size_t>(len > 0 ? len : 1 + static_cast<int64_t>(rng() % 3)), r);
        if (len == 0) std::shuffle(iv.begin(), iv.end(), rng);
        const int64_t k = static_cast<int64_t>(iv.size());
        const Idx idx = make_idx(IndexType::i32, iv);
        const Buf out0 = random_buf(t, static_cast<size_t>(n * d), rng);
        const Buf src = random_buf(t, static_cast<size_t>(k * d), rng);
        Buf want = out0;
        reference_add(want, n, d, d, src, d, iv, nullptr, std::nullopt);
        for (int64_t ign : {(int64_t(1) << 32) + 5, int64_t(5) - (int64_t(1) << 32), int64_t(1) << 32})
          for (sa::Strategy st : kStrategies)
            for (int threads : {1, 2}) {
              Buf out = out0;
              sa::Options opt;
              opt.strategy = st;
              opt.num_threads = threads;
              opt.ignore_index = ign;
              sa::index_add_rows(mat(out, n, d, d), idx.view(), cmat(src, k, d, d), {}, opt);
              ASSERT_EQ(out.bytes, want.bytes) << sa::dtype_name(t) << " runs of " << len << " d=" << d
                                               << " ignore=" << ign << " strategy=" << sa::strategy_name(st)
                                               << " threads=" << threads;
            }
      }
}

// A sorted index over one-column bf16/fp16 rows: runs short on average are walked 16 entries at a
// time where the AVX-512 kernels run, long ones run by run; each mix holds runs of 1 to 40
// entries (inside a block, across blocks, longer than one), and the test checks that the policy
// reads each mix as meant. An ignored row in the middle (its blocks walked one entry at a time),
// an int64 ignore_index past the int32 range at the end, weights or none, on 1 to 3 threads (K of
// about 40k: two and three threads split it), against the reference. Then NaNs of both signs in
// out and src: the contract leaves a NaN's sign free, but these walks keep the running sum's NaN
// where two meet, as the one-entry-at-a-time walk does, so that the sign of a float16 result does
// not depend on the thread count: every thread count, the walk one entry at a time (a src stride
// of 2) and the count strategy must give the same bytes here.
TEST(Strategies, SortedOneColumnRunsGiveTheContractBits) {
  uint64_t seed = 700;
  for (bool long_mix : {false, true})
    for (DType t : {DType::bf16, DType::f16})
      for (IndexType it : kItypes)
        for (bool weighted : {false, true})
          for (int ig = 0; ig < 3; ++ig) {
            std::mt19937_64 rng(seed++);
            // Mean run lengths of about 3.4 and 11 (one run in 10 or in 2 of 1 to 40 entries); rows
            // 1 to 3 apart, one step in 16 of 30 to 90 (blocks of 16 entries whose rows span more
            // than 32, and fewer); out's rows 1 or 3 elements apart.
            const int64_t n = long_mix ? 20000 : 60000, os = (ig + weighted) % 2 == 0 ? 1 : 3;
            std::vector<int64_t> iv;
            for (int64_t r = 0; r < n;
                 r += rng() % 16 == 0 ? 30 + static_cast<int64_t>(rng() % 61) : 1 + static_cast<int64_t>(rng() % 3)) {
              const int64_t len = rng() % (long_mix ? 2 : 10) == 0 ? 1 + static_cast<int64_t>(rng() % 40)
                                                                   : 1 + static_cast<int64_t>(rng() % (long_mix ? 3 : 2));
              iv.insert(iv.end(), static_cast<size_t>(len), r);
            }
            std::optional<int64_t> ignore;
            if (ig == 1) ignore = iv[iv.size() / 2];  // a row in the middle, skipped
            if (ig == 2 && it == IndexType::i64) {
              ignore = int64_t(1) << 40;
              iv.insert(iv.end(), 37, *ignore);
            }
            const int64_t k = static_cast<int64_t>(iv.size());
            ASSERT_GE(k, 30000);
            const Idx idx = make_idx(it, iv);
            ASSERT_EQ(sa::cpu::runs_are_long(idx.view(), sa::cpu::CpuPolicy::kLongRunRounded), long_mix);
            Buf out0 = special_buf(t, static_cast<size_t>(n * os), rng);
            Buf src = special_buf(t, static_cast<size_t>(k), rng);
            const std::vector<float> w = special_weights(k, rng);
            const float* wp = weighted ? w.data() : nullptr;
            Buf want = out0;
            reference_add(want, n, 1, os, src, 1, iv, wp, ignore);
            auto walk = [&](const Buf& o0, const Buf& s0, int threads, sa::Strategy st) {
              Buf out = o0;
              sa::Options opt;
              opt.strategy = st;
              opt.num_threads = threads;
              opt.ignore_index = ignore;
              sa::index_add_rows(mat(out, n, 1, os), idx.view(), cmat(s0, k, 1, 1), {wp, k, DType::f32}, opt);
              return out;
            };
            for (int threads : {1, 2, 3}) {
              const Buf out = walk(out0, src, threads, sa::Strategy::direct);
              size_t e = 0;
              while (e < out.size() && out.get(e) == want.get(e)) ++e;
              ASSERT_EQ(out.bytes, want.bytes) << sa::dtype_name(t) << (it == IndexType::i32 ? " i32" : " i64")
                                               << (weighted ? " weighted" : "") << " ignore=" << ig << " os=" << os
                                               << " threads=" << threads
                                               << " isa=" << sa::isa_name(sa::active_isa()) << ": row " << e;
            }
            // NaNs of both signs in one in eight elements of out and src.
            const uint16_t qnan = t == DType::bf16 ? 0x7FC0 : 0x7E00;
            uint16_t* o16 = reinterpret_cast<uint16_t*>(out0.data());
            uint16_t* s16 = reinterpret_cast<uint16_t*>(src.data());
            for (int64_t r = 0; r < n; ++r)
              if (rng() % 8 == 0) o16[r * os] = static_cast<uint16_t>(qnan | (rng() % 2 ? 0x8000 : 0));
            for (int64_t i = 0; i < k; ++i)
              if (rng() % 8 == 0) s16[i] = static_cast<uint16_t>(qnan | (rng() % 2 ? 0x8000 : 0));
            Buf strided(t, static_cast<size_t>(2 * k));  // the same sources two elements apart
            for (int64_t i = 0; i < k; ++i) reinterpret_cast<uint16_t*>(strided.data())[2 * i] = s16[i];
            Buf one_at_a_time = out0;
            {
              sa::Options opt;
              opt.strategy = sa::Strategy::direct;
              opt.num_threads = 1;
              opt.ignore_index = ignore;
              sa::index_add_rows(mat(one_at_a_time, n, 1, os), idx.view(), cmat(strided, k, 1, 2), {wp, k, DType::f32},
                                 opt);
            }
            for (sa::Strategy st : {sa::Strategy::direct, sa::Strategy::count})
              for (int threads : {1, 2, 3})
                ASSERT_EQ(walk(out0, src, threads, st).bytes, one_at_a_time.bytes)
                    << sa::dtype_name(t) << (it == IndexType::i32 ? " i32" : " i64") << (weighted ? " weighted" : "")
                    << " ignore=" << ig << " NaNs, strategy=" << sa::strategy_name(st) << " threads=" << threads;
          }
}

// A sorted index's runs are judged long or short, against each threshold the policy uses, from
// sampled neighbour pairs. Runs of one fixed length that divides the sampling stride must not be
// read as one long run (every pair sampled at the same place in its run), nor long runs as short,
// in int32 and int64 indices. Lengths of at most half a threshold must read as short and of at
// least three times one as long.
TEST(Strategies, LongRunsAreJudgedWhateverTheRunLength) {
  using P = sa::cpu::CpuPolicy;
  const int64_t s = P::kRunSamples;
  auto periodic = [&](IndexType it, int64_t len, int64_t m) {
    const int64_t k = s * len * m + 1;  // a stride of len * m entries
    std::vector<int64_t> iv(static_cast<size_t>(k));
    for (int64_t i = 0; i < k; ++i) iv[static_cast<size_t>(i)] = i / len;
    return make_idx(it, iv);
  };
  for (int64_t least : {P::kLongRunRounded, P::kLongRunExact}) {
    ASSERT_GE(least, 4);
    for (IndexType it : kItypes) {
      for (int64_t len : {2, 3, 4, 5, 8, 10, 12, 16, 40, 64, 100}) {
        if (2 * len > least && len < 3 * least) continue;
        for (int64_t m : {1, 3})
          EXPECT_EQ(sa::cpu::runs_are_long(periodic(it, len, m).view(), least), len >= 3 * least)
              << "runs of " << len << ", stride " << len * m << ", threshold " << least;
      }
      std::mt19937_64 rng(41);
      for (auto [lo, hi] : {std::pair<int64_t, int64_t>{1, least - 1}, {2 * least, 4 * least}}) {
        std::vector<int64_t> iv;
        for (int64_t r = 0; iv.size() < 200000; ++r)
          iv.insert(iv.end(), static_cast<size_t>(lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1))), r);
        EXPECT_EQ(sa::cpu::runs_are_long(make_idx(it, iv).view(), least), lo > least)
            << "runs of " << lo << " to " << hi << ", threshold " << least;
      }
    }
  }
}

TEST(Strategies, PlanMethodsGiveTheSamePlan) {
  std::mt19937_64 rng(7);
  for (int64_t n : {1, 100, 70000})
    for (Pattern p : {Pattern::uniform, Pattern::zipf, Pattern::all_equal}) {
      const std::vector<int64_t> iv = make_indices(p, n, 3000, rng);
      const Idx idx = make_idx(IndexType::i64, iv);
      const sa::Plan a = sa::Plan::build(idx.view(), n, std::nullopt, sa::Strategy::count);
      const sa::Plan b = sa::Plan::build(idx.view(), n, std::nullopt, sa::Strategy::radix);
      EXPECT_EQ(a.rows(), b.rows());
      EXPECT_EQ(a.offsets(), b.offsets());
      EXPECT_EQ(a.sources(), b.sources());
    }
}

TEST(Strategies, GatherBitsAreOneRoundedProductWhateverTheSplit) {
  uint64_t seed = 900;
  for (DType t : kDtypes)
    for (IndexType it : kItypes)
      for (bool weighted : {false, true})
        for (int64_t d : {1, 2, 4, 7, 8, 16, 32, 64, 128, 256, 300})  // rows of 2 B to 2 KiB
          for (int64_t k : {1, 3, 500}) {
            std::mt19937_64 rng(seed++);
            const int64_t n = 40;
            const Buf x = special_buf(t, static_cast<size_t>(n * d), rng);
            std::vector<int64_t> iv = make_indices(Pattern::uniform, n, k, rng);
            iv[0] = -3;
            const Idx idx = make_idx(it, iv);
            const std::vector<float> w = special_weights(k, rng);
            Buf want(t, static_cast<size_t>(k * d));
            for (int64_t i = 0; i < k; ++i)
              for (int64_t j = 0; j < d; ++j) {
                if (iv[i] == -3) continue;  // zero
                const double v = x.get(iv[i] * d + j);
                if (!weighted)
                  want.set(i * d + j, v);
                else if (t == DType::f64)
                  want.set(i * d + j, static_cast<double>(w[i]) * v);
                else
                  want.set(i * d + j, w[i] * static_cast<float>(v));
              }
            for (sa::Strategy st : kStrategies)  // automatic is direct, tested apart
              for (int threads : {1, 2, 3}) {
                Buf dst = special_buf(t, static_cast<size_t>(k * d), rng);
                sa::Options opt;
                opt.num_threads = threads;
                opt.ignore_index = -3;
                opt.strategy = st;
                sa::gather_rows(mat(dst, k, d, d), cmat(x, n, d, d), idx.view(),
                                {weighted ? w.data() : nullptr, k, DType::f32}, opt);
                ASSERT_EQ(dst.bytes, want.bytes) << sa::dtype_name(t) << " d=" << d << " k=" << k
                                                 << " threads=" << threads << " " << sa::strategy_name(st);
              }
          }
}

// A large unweighted gather writes its rows by non-temporal stores (forced here: by default a
// dst that fits in an AMD L3 with its source, or one under 32 MiB on other CPUs, is not
// streamed) or by plain ones: rows that start anywhere in a cache line (a padded dst stride),
// vector-sized ends, ignored rows, every split.
TEST(Strategies, LargeGatherByStreamingStoresCopiesEveryByte) {
  struct Restore {  // the caller's setting, if any, after the test
    const char* was = std::getenv("SCATTER_ADD_GATHER_STREAM");
    std::string value = was ? was : "";
    ~Restore() {
      if (was)
        setenv("SCATTER_ADD_GATHER_STREAM", value.c_str(), 1);
      else
        unsetenv("SCATTER_ADD_GATHER_STREAM");
    }
  } restore_at_exit;
  for (const char* stream : {"1", "0"}) {
    setenv("SCATTER_ADD_GATHER_STREAM", stream, 1);
    uint64_t seed = 950;
    for (DType t : {DType::f32, DType::bf16, DType::f64})
      for (int64_t d : {150, 301, 1024}) {
        std::mt19937_64 rng(seed++);
        const size_t es = sa::dtype_size(t);
        const int64_t k = (int64_t(5) << 20) / (d * static_cast<int64_t>(es)) + 1, n = 97, ds = d + 3;
        const Buf x = special_buf(t, static_cast<size_t>(n * d), rng);
        std::vector<int64_t> iv = make_indices(Pattern::uniform, n, k, rng);
        for (int64_t i = 0; i < k; i += 7) iv[static_cast<size_t>(i)] = -1;
        const Idx idx = make_idx(IndexType::i32, iv);
        const Buf dst0 = special_buf(t, static_cast<size_t>(k * ds), rng);
        Buf want = dst0;  // the padding after each row stays as it was
        for (int64_t i = 0; i < k; ++i) {
          unsigned char* row = want.bytes.data() + static_cast<size_t>(i * ds) * es;
          const int64_t r = iv[static_cast<size_t>(i)];
          if (r < 0)
            std::memset(row, 0, static_cast<size_t>(d) * es);
          else
            std::memcpy(row, x.bytes.data() + static_cast<size_t>(r * d) * es, static_cast<size_t>(d) * es);
        }
        for (int threads : {1, 2, 3}) {
          Buf dst = dst0;
          sa::Options opt;
          opt.num_threads = threads;
          opt.ignore_index = -1;
          sa::gather_rows(mat(dst, k, d, ds), cmat(x, n, d, d), idx.view(), {}, opt);
          ASSERT_EQ(dst.bytes, want.bytes) << sa::dtype_name(t) << " d=" << d << " threads=" << threads
                                           << " stream=" << stream;
        }
      }
  }
}

// index_add_rows keeps its plan's buffers per thread between calls, up to a size: calls of
// different shapes in a row, one past that size (released after it), give their own sums.
TEST(Strategies, KeptPlanServesCallsOfEveryShapeInTurn) {
  std::mt19937_64 rng(77);
  for (int64_t k : {int64_t(3000), int64_t(3) << 20, int64_t(50), int64_t(3000)})
    for (sa::Strategy st : {sa::Strategy::count, sa::Strategy::radix}) {
      const int64_t n = k > 10000 ? 4000 : 37;
      std::vector<int64_t> iv = make_indices(Pattern::uniform, n, k, rng);
      std::vector<int32_t> i32(iv.begin(), iv.end());
      std::vector<float> src(static_cast<size_t>(k), 1.0f), out(static_cast<size_t>(n), 0.5f), want(out);
      for (int64_t i = 0; i < k; ++i) want[static_cast<size_t>(iv[static_cast<size_t>(i)])] += 1.0f;
      sa::Options opt;
      opt.strategy = st;
      sa::index_add_rows({out.data(), n, 1, 1, DType::f32}, {i32.data(), k, IndexType::i32},
                         {src.data(), k, 1, 1, DType::f32}, {}, opt);
      ASSERT_EQ(out, want) << "k=" << k << " " << sa::strategy_name(st);
    }
}

TEST(Overlap, ElementsNotByteRanges) {
  std::vector<float> m(10 * 8);
  const float* p = m.data();
  auto view = [&](int64_t off, int64_t rows, int64_t cols, int64_t stride) {
    return sa::ConstMatrix{p + off, rows, cols, stride, DType::f32};
  };
  // Column slices of one [10, 8] matrix: left and right halves share no element.
  EXPECT_FALSE(sa::views_may_overlap(view(0, 10, 4, 8), view(4, 10, 4, 8)));
  EXPECT_TRUE(sa::views_may_overlap(view(0, 10, 5, 8), view(4, 10, 4, 8)));
  // Interleaved even/odd columns (rows of 1 element, stride 2 in a [40, 2] view).
  EXPECT_FALSE(sa::views_may_overlap(view(0, 40, 1, 2), view(1, 40, 1, 2)));
  // Shifted by whole rows: row j of b is row j + 2 of a.
  EXPECT_TRUE(sa::views_may_overlap(view(0, 5, 8, 8), view(16, 5, 8, 8)));
  EXPECT_FALSE(sa::views_may_overlap(view(0, 2, 8, 8), view(16, 5, 8, 8)));
  // Right half of rows 0..4 against the left half of rows 5..9: no shared element.
  EXPECT_FALSE(sa::views_may_overlap(view(4, 5, 4, 8), view(40, 5, 4, 8)));
  // A one-row view against rows: exact.
  EXPECT_FALSE(sa::views_may_overlap(view(4, 1, 4, 0), view(8, 9, 4, 8)));
  EXPECT_TRUE(sa::views_may_overlap(view(3, 1, 2, 0), view(0, 10, 4, 8)));
  EXPECT_FALSE(sa::views_may_overlap(view(4, 1, 4, 0), view(0, 10, 4, 8)));
  // Different strides: conservative.
  EXPECT_TRUE(sa::views_may_overlap(view(0, 5, 2, 16), view(4, 4, 2, 8)));
  // Byte ranges apart, and empty views.
  EXPECT_FALSE(sa::views_may_overlap(view(0, 2, 8, 8), view(16, 2, 8, 8)));
  EXPECT_FALSE(sa::views_may_overlap(view(0, 0, 8, 8), view(0, 10, 8, 8)));
  EXPECT_FALSE(sa::views_may_overlap(view(0, 10, 0, 8), view(0, 10, 8, 8)));
}

TEST(Overlap, ColumnSlicesOfOneMatrixAreAccepted) {
  // out = left half, src = right half of the same [6, 8] buffer: legal, and computed right.
  std::vector<float> m(6 * 8);
  for (size_t i = 0; i < m.size(); ++i) m[i] = static_cast<float>(i);
  const std::vector<float> before = m;
  const Idx idx = make_idx(IndexType::i64, {2, 0, 2, 5, 1, 3});
  sa::index_add_rows({m.data(), 6, 4, 8, DType::f32}, idx.view(), sa::ConstMatrix{m.data() + 4, 6, 4, 8, DType::f32});
  for (int64_t r = 0; r < 6; ++r)
    for (int64_t j = 0; j < 4; ++j) {
      float want = before[r * 8 + j];
      for (int64_t i = 0; i < 6; ++i)
        if (idx.values[i] == r) want += before[i * 8 + 4 + j];
      EXPECT_EQ(m[r * 8 + j], want);
    }
  // A real overlap is still refused, with the output untouched.
  const std::vector<float> snapshot = m;
  EXPECT_THROW(sa::index_add_rows({m.data(), 6, 5, 8, DType::f32}, idx.view(),
                                  sa::ConstMatrix{m.data() + 4, 6, 4, 8, DType::f32}),
               sa::Error);
  EXPECT_EQ(m, snapshot);
}

TEST(BadView, HugeStrideIsAValueErrorNotOverflow) {
  std::vector<float> buf(16);
  const Idx idx = make_idx(IndexType::i64, {});
  std::vector<float> s(4);
  try {
    sa::index_add_rows({buf.data(), 3, 4, int64_t(1) << 62, DType::f32}, idx.view(), sa::ConstMatrix{s.data(), 0, 4, 4, DType::f32});
    FAIL() << "no error";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.kind(), sa::Error::Kind::value);
    EXPECT_NE(std::string(e.what()).find("out of shape [3, 4] with row stride 4611686018427387904 spans more memory than the address space"), std::string::npos) << e.what();
  }
  try {
    sa::gather_rows({buf.data(), 0, 4, 4, DType::f32}, sa::ConstMatrix{s.data(), 2, 4, int64_t(1) << 62, DType::f32}, idx.view());
    FAIL() << "no error";
  } catch (const sa::Error& e) {
    EXPECT_NE(std::string(e.what()).find("x of shape [2, 4]"), std::string::npos) << e.what();
  }
}

TEST(Overlap, StridedViewsAreDecidedOnElements) {
  std::vector<float> m(64);
  auto sv = [&](int64_t off, int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
    return sa::StridedView{m.data() + off, rows, cols, rs, cs, sizeof(float)};
  };
  // Even and odd columns of an [8, 8] matrix (b[:, ::2], b[:, 1::2]) share no element.
  EXPECT_FALSE(sa::views_may_overlap(sv(0, 8, 4, 8, 2), sv(1, 8, 4, 8, 2)));
  EXPECT_TRUE(sa::views_may_overlap(sv(0, 8, 4, 8, 2), sv(2, 8, 4, 8, 2)));
  // Transposed halves: columns 0..3 of rows 0..7 against columns 4..7, both transposed.
  EXPECT_FALSE(sa::views_may_overlap(sv(0, 4, 8, 1, 8), sv(4, 4, 8, 1, 8)));
  // Different strides: conservative.
  EXPECT_TRUE(sa::views_may_overlap(sv(0, 8, 4, 8, 2), sv(1, 4, 4, 16, 2)));
  // Against a brute-force check of every element pair, over random views of one buffer: never a
  // missed overlap, and no false one when the strides agree.
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 20000; ++trial) {
    auto pick = [&] {
      const int64_t rows = 1 + rng() % 5, cols = 1 + rng() % 5, rs = rng() % 9, cs = rng() % 4;
      const int64_t span = (rows - 1) * rs + (cols - 1) * cs;
      return sv(static_cast<int64_t>(rng() % static_cast<uint64_t>(64 - span)), rows, cols, rs, cs);
    };
    sa::StridedView a = pick(), b = rng() % 2 ? pick() : a;
    if (b.data == a.data && rng() % 2) {
      b.data = m.data() + (rng() % 4);
    }
    bool meet = false;
    for (int64_t i = 0; i < a.rows; ++i)
      for (int64_t j = 0; j < a.cols; ++j)
        for (int64_t k = 0; k < b.rows; ++k)
          for (int64_t l = 0; l < b.cols; ++l)
            meet |= static_cast<const float*>(a.data) + i * a.row_stride + j * a.col_stride ==
                    static_cast<const float*>(b.data) + k * b.row_stride + l * b.col_stride;
    const bool said = sa::views_may_overlap(a, b);
    ASSERT_TRUE(said || !meet) << "missed overlap, trial " << trial;
    if (a.row_stride == b.row_stride && a.col_stride == b.col_stride) {
      ASSERT_EQ(said, meet) << "trial " << trial << ": a at " << (static_cast<const float*>(a.data) - m.data())
                            << " [" << a.rows << ", " << a.cols << "] strides " << a.row_stride << ", " << a.col_stride
                            << "; b at " << (static_cast<const float*>(b.data) - m.data()) << " [" << b.rows << ", "
                            << b.cols << "]";
    }
  }
}

TEST(StrategySwitch, UnknownCodesAreValueErrors) {
  std::vector<float> out(4, 1.0f), src(3, 2.0f);
  const Idx idx = make_idx(IndexType::i64, {0, 1, 3});
  std::vector<float> dst(3, 5.0f);
  for (int code : {-1, 4, 7}) {
    sa::Options o;
    o.strategy = static_cast<sa::Strategy>(code);
    EXPECT_THROW(sa::index_add_rows({out.data(), 4, 1, 1, DType::f32}, idx.view(),
                                    sa::ConstMatrix{src.data(), 3, 1, 1, DType::f32}, {}, o),
                 sa::Error);
    EXPECT_EQ(out, std::vector<float>(4, 1.0f));
    EXPECT_THROW(sa::gather_rows({dst.data(), 3, 1, 1, DType::f32}, sa::ConstMatrix{out.data(), 4, 1, 1, DType::f32},
                                 idx.view(), {}, o),
                 sa::Error);
    EXPECT_EQ(dst, std::vector<float>(3, 5.0f));
    // Refused with nothing to do too.
    const Idx none = make_idx(IndexType::i64, {});
    EXPECT_THROW(sa::index_add_rows({out.data(), 4, 1, 1, DType::f32}, none.view(),
                                    sa::ConstMatrix{src.data(), 0, 1, 1, DType::f32}, {}, o),
                 sa::Error);
    EXPECT_THROW(sa::gather_rows({dst.data(), 0, 1, 1, DType::f32}, sa::ConstMatrix{out.data(), 4, 1, 1, DType::f32},
                                 none.view(), {}, o),
                 sa::Error);
  }
  EXPECT_THROW(sa::Plan::build(idx.view(), 4, std::nullopt, sa::Strategy::direct), sa::Error);
  EXPECT_THROW(sa::Plan::build(idx.view(), 4, std::nullopt, static_cast<sa::Strategy>(42)), sa::Error);
  const sa::Isa before = sa::active_isa();
  EXPECT_EQ(sa::set_isa(static_cast<sa::Isa>(-1)), sa::Isa::scalar);
  sa::set_isa(before);
}

TEST(StrategySwitch, OptionsAndSetStrategyForceOne) {
  EXPECT_STREQ(sa::strategy_name(sa::Strategy::direct), "direct");
  EXPECT_STREQ(sa::strategy_name(sa::Strategy::automatic), "auto");
  const sa::Strategy before = sa::get_strategy();
  for (sa::Strategy s : kStrategies) {
    sa::set_strategy(s);
    EXPECT_EQ(sa::get_strategy(), s);
  }
  EXPECT_THROW(sa::set_strategy(static_cast<sa::Strategy>(9)), sa::Error);
  sa::set_strategy(before);
}

// A sparse index into part of a large out (K far below N, entries in the first half of the rows,
// three quarters of them padding at an in-range ignore_index): ranges of wide float32/float64
// rows are cut by their entries alone, the ignored ones left out, so the walk still takes them,
// where a base weight per block of rows, or the padding row counted as a hot one, would leave it
// on column shares. The same bits at one to three threads.
TEST(Strategies, SparseIndexOverPartOfOutCutsRangesByItsEntries) {
  const int64_t n = 16384, k = 1024, d = 256, pad = 100;
  std::mt19937_64 rng(4242);
  std::uniform_int_distribution<int64_t> half(0, n / 2 - 1);
  std::vector<int64_t> iv(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) iv[static_cast<size_t>(i)] = i % 4 != 0 ? pad : half(rng);
  int shift = 0;
  while ((n >> shift) >= sa::cpu::CpuPolicy::kMaxBlocks) ++shift;
  for (DType t : {DType::f32, DType::f64}) {
    const Idx idx = make_idx(IndexType::i32, iv);
    EXPECT_TRUE(sa::cpu::cut_rows(idx.view(), n, 2, shift, 0, pad).balanced);
    EXPECT_FALSE(sa::cpu::cut_rows(idx.view(), n, 2, shift, 1, pad).balanced);  // a base per block
    EXPECT_FALSE(sa::cpu::cut_rows(idx.view(), n, 2, shift, 0).balanced);       // the padding row counted
    const Buf out0 = special_buf(t, static_cast<size_t>(n * d), rng);
    const Buf src = special_buf(t, static_cast<size_t>(k * d), rng);
    const std::vector<float> w = special_weights(k, rng);
    Buf want = out0;
    reference_add(want, n, d, d, src, d, iv, w.data(), pad);
    for (int threads : {1, 2, 3}) {
      const Buf out = direct_walk(out0, n, d, d, idx, src, k, d, w.data(), threads, pad);
      ASSERT_EQ(out.bytes, want.bytes) << sa::dtype_name(t) << " threads=" << threads;
    }
  }
}

// The cost model compares what each strategy takes on the threads it would get: a plan's rows
// divide over them, the direct walk of rows too narrow to split by columns does not.
TEST(StrategyChoice, ThreadsCountForAPlanNotForAWalkThatRunsAlone) {
  // 33 rows of 512 B float32 hit about 1000 times each: too narrow for a column or a row split,
  // the walk runs on one thread; a plan's rows divide over two.
  const sa::cpu::AddShape alone{33, 32768, 128, DType::f32};
  for (sa::Strategy st : {sa::Strategy::direct, sa::Strategy::count, sa::Strategy::radix})
    EXPECT_DOUBLE_EQ(sa::cpu::threaded_ns(alone, st, 1), sa::cpu::estimate_ns(alone, st)) << sa::strategy_name(st);
  EXPECT_DOUBLE_EQ(sa::cpu::threaded_ns(alone, sa::Strategy::direct, 2), sa::cpu::estimate_ns(alone, sa::Strategy::direct));
  EXPECT_LT(sa::cpu::threaded_ns(alone, sa::Strategy::count, 2), 0.7 * sa::cpu::estimate_ns(alone, sa::Strategy::count));
  // bf16 rows of 1 KiB: column shares of 512 B gain nothing, and ranges of rows, cut at 64-row
  // blocks, are not counted.
  const sa::cpu::AddShape blocks{164, 16384, 512, DType::bf16};
  EXPECT_DOUBLE_EQ(sa::cpu::threaded_ns(blocks, sa::Strategy::direct, 2), sa::cpu::estimate_ns(blocks, sa::Strategy::direct));
  // float32 / float64 rows of 1 KiB take ranges of single rows: the walk divides, and stays the
  // pick on two threads as on one.
  const sa::cpu::AddShape ranges[] = {{164, 16384, 256, DType::f32}, {164, 16384, 128, DType::f64}};
  for (const auto& s : ranges) {
    EXPECT_DOUBLE_EQ(sa::cpu::threaded_ns(s, sa::Strategy::direct, 2), sa::cpu::estimate_ns(s, sa::Strategy::direct) / 2)
        << sa::dtype_name(s.dtype);
    if (sa::get_strategy() != sa::Strategy::automatic) continue;
    sa::Options one, two;
    one.num_threads = 1;
    two.num_threads = 2;
    EXPECT_EQ(sa::cpu::choose_add(s, one), sa::Strategy::direct) << sa::dtype_name(s.dtype);
    EXPECT_EQ(sa::cpu::choose_add(s, two), sa::Strategy::direct) << sa::dtype_name(s.dtype);
  }
  // Too few rows for balanced ranges even from an even index (3 on two threads, 7 on three; the
  // walk keeps the column split there): not counted; 4 and 8 rows are.
  for (auto [n, nt, divides] : {std::tuple{int64_t(3), 2, false}, {int64_t(4), 2, true}, {int64_t(7), 3, false},
                                {int64_t(8), 3, true}}) {
    const sa::cpu::AddShape few{n, 16384, 512, DType::f32};  // 2 KiB rows: a column split on 2 and 3
    const double one = sa::cpu::estimate_ns(few, sa::Strategy::direct);
    EXPECT_DOUBLE_EQ(sa::cpu::threaded_ns(few, sa::Strategy::direct, nt), divides ? one / nt : one) << n << " rows, " << nt;
  }
  // The same rows into an out of 4 MiB: ranges of rows are not counted there.
  const sa::cpu::AddShape big_out{4096, 4096, 256, DType::f32};
  EXPECT_DOUBLE_EQ(sa::cpu::threaded_ns(big_out, sa::Strategy::direct, 2), sa::cpu::estimate_ns(big_out, sa::Strategy::direct));
  // ... unless the index names each row at most 1 / kRangesDivideSparseLoadDen times: then they are,
  // whatever the size of out, and the walk is the pick on two threads (a plan reads every source
  // row at random for few entries a row). bf16 rows stay uncounted.
  using P = sa::cpu::CpuPolicy;
  const int64_t rows = 16384, sparse_k = rows / P::kRangesDivideSparseLoadDen;
  for (const sa::cpu::AddShape& s : {sa::cpu::AddShape{rows, sparse_k, 256, DType::f32},
                                     sa::cpu::AddShape{1000000, 100000, 256, DType::f32},
                                     sa::cpu::AddShape{rows, sparse_k, 128, DType::f64}}) {
    EXPECT_DOUBLE_EQ(sa::cpu::threaded_ns(s, sa::Strategy::direct, 2), sa::cpu::estimate_ns(s, sa::Strategy::direct) / 2)
        << s.n << " " << s.k;
    if (sa::get_strategy() != sa::Strategy::automatic) continue;
    sa::Options two;
    two.num_threads = 2;
    EXPECT_EQ(sa::cpu::choose_add(s, two), sa::Strategy::direct) << s.n << " " << s.k;
  }
  const sa::cpu::AddShape denser{rows, sparse_k + 1, 256, DType::f32}, sparse_bf16{rows, sparse_k, 512, DType::bf16};
  EXPECT_DOUBLE_EQ(sa::cpu::threaded_ns(denser, sa::Strategy::direct, 2), sa::cpu::estimate_ns(denser, sa::Strategy::direct));
  // measured on two threads only: three keep the former pricing (rows of 1.5 KiB, shares of 512 B)
  const sa::cpu::AddShape three{rows, sparse_k, 384, DType::f32};
  EXPECT_DOUBLE_EQ(sa::cpu::threaded_ns(three, sa::Strategy::direct, 3), sa::cpu::estimate_ns(three, sa::Strategy::direct));
  EXPECT_DOUBLE_EQ(sa::cpu::threaded_ns(sparse_bf16, sa::Strategy::direct, 2),
                   sa::cpu::estimate_ns(sparse_bf16, sa::Strategy::direct));
  // Rows of 4 KiB split by columns in 2 KiB shares: the walk divides too.
  const sa::cpu::AddShape wide{41, 4096, 1024, DType::f32};
  EXPECT_DOUBLE_EQ(sa::cpu::threaded_ns(wide, sa::Strategy::direct, 2),
                   sa::cpu::estimate_ns(wide, sa::Strategy::direct) / 2);
}

// The serial sort of a plan on several threads: kSerialSortCachedNsPerEntry an entry while the
// sort's arrays fit in kSerialSortCachedBytes, kSerialSortNsPerEntry beyond; so two threads plan
// bf16 rows of 128 B into 6554 rows from 65536 entries, where the walk was twice as slow.
TEST(StrategyChoice, ACachedSortCostsLessOnTheSerialPart) {
  using P = sa::cpu::CpuPolicy;
  const sa::cpu::AddShape cached{6554, 65536, 64, DType::bf16};
  const double one = sa::cpu::estimate_ns(cached, sa::Strategy::count);
  const double sort = 65536.0 * P::kSerialSortCachedNsPerEntry;
  ASSERT_LT(sort, one);
  EXPECT_NEAR(sa::cpu::threaded_ns(cached, sa::Strategy::count, 2), sort + (one - sort) / 2, 1e-6 * one);
  const sa::cpu::AddShape large{100000, 1000000, 64, DType::bf16};  // 16.8 MB of arrays
  const double one_large = sa::cpu::estimate_ns(large, sa::Strategy::count);
  const double sort_large = 1e6 * P::kSerialSortNsPerEntry;
  ASSERT_LT(sort_large, one_large);
  EXPECT_NEAR(sa::cpu::threaded_ns(large, sa::Strategy::count, 2), sort_large + (one_large - sort_large) / 2,
              1e-6 * one_large);
  if (sa::get_strategy() != sa::Strategy::automatic) return;
  sa::Options two;
  two.num_threads = 2;
  EXPECT_EQ(sa::cpu::choose_add(cached, two), sa::Strategy::count);
}

// A float32/float64 row split that compacts its entries skips nothing: rows of 64 and 128 bytes
// into an out larger than the caches split over two threads, where the same rows into a smaller
// out (skipped one by one) leave one thread walking alone, and the direct walk is priced halved.
TEST(StrategyChoice, ACompactedRowSplitPaysForNarrowerRows) {
  using P = sa::cpu::CpuPolicy;
  sa::Options two;
  two.num_threads = 2;
  for (DType t : {DType::f32, DType::f64})
    for (int64_t d : {int64_t(16), int64_t(32)}) {
      const int64_t row_bytes = d * static_cast<int64_t>(sa::dtype_size(t));
      const int64_t big = P::kCompactMinOutBytes / row_bytes;
      const int64_t small = row_bytes >= P::kCompactWideRowBytes ? static_cast<int64_t>(P::kCompactWideMinOutBytes) / row_bytes / 2
                                                                 : big / 4;
      const sa::cpu::AddShape large{big, big, d, t}, cached{small, small, d, t};
      ASSERT_TRUE(sa::cpu::direct_compacts(large)) << sa::dtype_name(t) << " D=" << d;
      ASSERT_FALSE(sa::cpu::direct_compacts(cached));
      EXPECT_TRUE(sa::cpu::direct_split(large, two, false).rows) << sa::dtype_name(t) << " D=" << d;
      EXPECT_NEAR(sa::cpu::threaded_ns(large, sa::Strategy::direct, 2),
                  sa::cpu::estimate_ns(large, sa::Strategy::direct) / 2, 1e-9 * sa::cpu::estimate_ns(large, sa::Strategy::direct));
      if (row_bytes == 64) {
        EXPECT_FALSE(sa::cpu::direct_split(cached, two, false).rows) << sa::dtype_name(t);
      }
    }
  EXPECT_FALSE(sa::cpu::direct_compacts({1 << 20, 1 << 20, 8, DType::f32}));    // rows of 32 bytes
  EXPECT_FALSE(sa::cpu::direct_compacts({1 << 16, 1 << 16, 256, DType::f32}));  // rows of 1 KiB
}

// Buffers from kHugePagesFromBytes on start on a 2 MiB boundary (what transparent huge pages
// need) and hold every byte asked for; smaller ones are plain allocations; a size the rounding
// would wrap is refused. And a bf16 direct walk whose float32 scratch is larger than a thread
// keeps is allocated that way on each call and gives the reference's bits, call after call.
TEST(Strategies, LargeScratchBuffersAreHugePageAlignedAndGiveTheContractBits) {
  using P = sa::cpu::CpuPolicy;
  for (size_t bytes : {size_t(P::kHugePagesFromBytes), size_t(P::kHugePagesFromBytes) + 12345, size_t(1000)}) {
    char* p = static_cast<char*>(sa::cpu::big_alloc(bytes));
    if (bytes >= static_cast<size_t>(P::kHugePagesFromBytes)) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % (size_t(2) << 20), 0u) << bytes;
    }
    std::memset(p, 0x5a, bytes);
    EXPECT_EQ(p[bytes - 1], 0x5a);
    sa::cpu::big_free(p);
  }
  EXPECT_THROW(sa::cpu::big_alloc(SIZE_MAX), std::bad_alloc);
  EXPECT_THROW(sa::cpu::big_alloc(SIZE_MAX - (size_t(1) << 20)), std::bad_alloc);
  const int64_t d = 16, n = P::kKeptScratchBytes / (d * 4) + 4096, k = n;  // a dense scratch past the kept size
  std::mt19937_64 rng(4242);
  const Buf out0 = special_buf(DType::bf16, static_cast<size_t>(n * d), rng);
  const Buf src = special_buf(DType::bf16, static_cast<size_t>(k * d), rng);
  const std::vector<int64_t> iv = make_indices(Pattern::uniform, n, k, rng);
  const Idx idx = make_idx(IndexType::i32, iv);
  Buf want = out0;
  reference_add(want, n, d, d, src, d, iv, nullptr, -1);
  reference_add(want, n, d, d, src, d, iv, nullptr, -1);
  for (int threads : {1, 2}) {
    Buf out = out0;
    sa::Options o;
    o.num_threads = threads;
    o.strategy = sa::Strategy::direct;
    const int64_t huge_before = sa::cpu::huge_allocations().load();
    for (int call = 0; call < 2; ++call)
      sa::index_add_rows(mat(out, n, d, d), idx.view(), cmat(src, k, d, d), {nullptr, k, DType::f32}, o);
    EXPECT_GE(sa::cpu::huge_allocations().load() - huge_before, 2) << "threads=" << threads;  // a scratch a call
    ASSERT_EQ(out.bytes, want.bytes) << "threads=" << threads;
  }
}

// reserve_huge gives a vector room for n elements and leaves it empty when it had to grow (its
// callers refill it), and leaves one that has the room as it was. A plan whose buffers it grew
// past kHugePagesFromBytes is the same as one built in buffers that had the room.
TEST(Strategies, ReserveHugeGrowsEmptyAndPlansStayTheSame) {
  using P = sa::cpu::CpuPolicy;
  std::vector<int64_t> v = {1, 2, 3};
  const size_t big = static_cast<size_t>(P::kHugePagesFromBytes) / sizeof(int64_t) + 77;
  sa::cpu::reserve_huge(v, big);
  EXPECT_TRUE(v.empty());
  EXPECT_GE(v.capacity(), big);
  v.assign(5, 9);
  sa::cpu::reserve_huge(v, 4);
  EXPECT_EQ(v, std::vector<int64_t>(5, 9));
  const int64_t n = 300000, k = static_cast<int64_t>(big);  // sources of more than 4 MiB
  std::mt19937_64 rng(77);
  const std::vector<int64_t> iv = make_indices(Pattern::zipf, n, k, rng);
  const Idx idx = make_idx(IndexType::i32, iv);
  const Idx small = make_idx(IndexType::i32, {3, 1, 3, 0});
  for (sa::Strategy m : {sa::Strategy::count, sa::Strategy::radix}) {
    sa::Plan fresh, grown;
    grown.rebuild(small.view(), 4, std::nullopt, m);  // small buffers first, then grown
    grown.rebuild(idx.view(), n, std::nullopt, m);
    fresh = sa::Plan::build(idx.view(), n, std::nullopt, m);
    EXPECT_EQ(fresh.rows(), grown.rows());
    EXPECT_EQ(fresh.offsets(), grown.offsets());
    EXPECT_EQ(fresh.sources(), grown.sources());
    int64_t at = 0;  // the sources of each row in increasing order, every entry once
    for (size_t r = 0; r + 1 < fresh.offsets().size(); ++r)
      for (int64_t j = fresh.offsets()[r]; j < fresh.offsets()[r + 1]; ++j, ++at) {
        ASSERT_EQ(iv[static_cast<size_t>(fresh.sources()[static_cast<size_t>(j)])], fresh.rows()[r]);
        if (j > fresh.offsets()[r]) {
          ASSERT_LT(fresh.sources()[static_cast<size_t>(j) - 1], fresh.sources()[static_cast<size_t>(j)]);
        }
      }
    EXPECT_EQ(at, k);
  }
}

// Rows of 256 and 512 bytes compact from an out of 1 MiB, where the caches hold it: float32 D = 64
// and 128 into 4096 to 114688 rows took 0.56x to 0.83x of the time of a split skipping the other
// thread's entries one by one (policy.h, kCompactWideMinOutBytes).
TEST(StrategyChoice, WideRowsCompactFromASmallerOut) {
  using P = sa::cpu::CpuPolicy;
  sa::Options two;
  two.num_threads = 2;
  for (DType t : {DType::f32, DType::f64})
    for (int64_t row_bytes : {P::kCompactWideRowBytes, P::kCompactMaxRowBytes}) {
      const int64_t d = row_bytes / static_cast<int64_t>(sa::dtype_size(t));
      const int64_t n = static_cast<int64_t>(P::kCompactWideMinOutBytes) / row_bytes;
      EXPECT_TRUE(sa::cpu::direct_compacts({n, n, d, t})) << sa::dtype_name(t) << " D=" << d;
      EXPECT_FALSE(sa::cpu::direct_compacts({n - 1, n - 1, d, t})) << sa::dtype_name(t) << " D=" << d;
      EXPECT_TRUE(sa::cpu::direct_split({4 * n, 4 * n, d, t}, two, false).rows) << sa::dtype_name(t) << " D=" << d;
    }
  // Narrower rows keep the larger out.
  const int64_t n128 = static_cast<int64_t>(P::kCompactWideMinOutBytes) / 128 * 4;
  EXPECT_FALSE(sa::cpu::direct_compacts({n128, n128, 32, DType::f32}));
}

// An index that names each row more than kRowSplitMaxLoad times on average leaves a walk that does
// not deal its entries to one thread, compacted or not, where the threads' source streams outweigh
// the rows' work they divide (float32 D = 64, K = 8 N: a two-thread split took 1.3x to 2.2x the
// time of the plan walk on two threads); and so does one that names fewer than kRowSplitMinLoad
// (the passes over out then outweigh the walk). A split that deals its entries keeps splitting.
TEST(StrategyChoice, ARowSplitNeedsRowsNamedNeitherTooOftenNorTooRarely) {
  using P = sa::cpu::CpuPolicy;
  sa::Options two;
  two.num_threads = 2;
  const int64_t n = 65536;  // 16 MiB of float32 rows of 64 columns: compacted
  const int64_t over = static_cast<int64_t>(n * P::kRowSplitMaxLoad) + n / 2;
  ASSERT_TRUE(sa::cpu::direct_compacts({n, n, 64, DType::f32}));
  EXPECT_TRUE(sa::cpu::direct_split({n, n, 64, DType::f32}, two, false).rows);
  EXPECT_FALSE(sa::cpu::direct_split({n, over, 64, DType::f32}, two, false).rows);
  EXPECT_EQ(sa::cpu::direct_split({n, over, 64, DType::f32}, two, false).threads, 1);
  EXPECT_EQ(sa::cpu::choose_add({n, 8 * n, 64, DType::f32}, two), sa::Strategy::count);
  // bf16 rows of 128 bytes, summed in a scratch: every thread walks the whole index.
  ASSERT_FALSE(sa::cpu::direct_deals({n, n, 64, DType::bf16}, 2));
  EXPECT_TRUE(sa::cpu::direct_split({n, n, 64, DType::bf16}, two, false).rows);
  EXPECT_FALSE(sa::cpu::direct_split({n, over, 64, DType::bf16}, two, false).rows);
  const int64_t under = static_cast<int64_t>(n * P::kRowSplitMinLoad) / 2;
  EXPECT_FALSE(sa::cpu::direct_split({n, under, 64, DType::bf16}, two, false).rows);
  // bf16 rows of 8 bytes dealt out: the split stays at K = 3 N.
  ASSERT_TRUE(sa::cpu::direct_deals({100000, 300000, 4, DType::bf16}, 2));
  EXPECT_TRUE(sa::cpu::direct_split({100000, 300000, 4, DType::bf16}, two, false).rows);
}

// Run by its own CTest entry with SCATTER_ADD_CPU_STRATEGY=bogus (filtered out elsewhere).
// choose_add keeps its last pick for the next call of the same shape and threads: whatever came
// before, each call gets the pick a fresh thread (nothing kept) makes for its own shape.
TEST(StrategyChoice, AKeptPickIsThePickOfItsOwnShape) {
  if (sa::get_strategy() != sa::Strategy::automatic) GTEST_SKIP() << "SCATTER_ADD_CPU_STRATEGY forces a strategy";
  const sa::cpu::AddShape shapes[] = {
      {64, 64, 1024, DType::f32},      {128, 128, 4096, DType::f32}, {512, 1024, 2048, DType::f32},
      {33, 32768, 128, DType::f32},    {33, 32768, 128, DType::bf16}, {164, 16384, 256, DType::f32},
      {164, 16384, 256, DType::f64},   {1000000, 16, 1, DType::bf16}, {1000000, 16, 2, DType::bf16},
      {1000000, 100000, 1, DType::bf16}, {16, 16, 1, DType::bf16}, {128, 128, 1024, DType::f32},
  };
  constexpr int kThreads[] = {1, 2, 3};
  std::vector<sa::Strategy> fresh;
  std::thread([&] {
    for (const auto& s : shapes)
      for (int nt : kThreads) {
        sa::Options o;
        o.num_threads = nt;
        std::thread([&] { fresh.push_back(sa::cpu::choose_add(s, o)); }).join();  // a new thread each
      }
  }).join();
  std::vector<sa::Strategy> kinds(fresh);
  std::sort(kinds.begin(), kinds.end());
  ASSERT_GE(std::unique(kinds.begin(), kinds.end()) - kinds.begin(), 3) << "the shapes pick all three strategies";
  auto pick = [&](size_t c) {
    sa::Options o;
    o.num_threads = kThreads[c % 3];
    return sa::cpu::choose_add(shapes[c / 3], o);
  };
  for (size_t i = 0; i < fresh.size(); ++i)  // every call after every other, and after itself
    for (size_t j = 0; j < fresh.size(); ++j) {
      pick(i);
      ASSERT_EQ(pick(j), fresh[j]) << "shape " << j / 3 << " threads " << kThreads[j % 3] << " after shape " << i / 3
                                   << " threads " << kThreads[i % 3];
    }
}

TEST(StrategyChoice, GatherCopiesByTheIndexUnlessForced) {
  if (sa::get_strategy() != sa::Strategy::automatic) GTEST_SKIP() << "SCATTER_ADD_CPU_STRATEGY forces a strategy";
  for (int nt : {0, 1, 2, 3}) {
    sa::Options o;
    o.num_threads = nt;
    EXPECT_EQ(sa::cpu::choose_gather(o), sa::Strategy::direct);
  }
}

TEST(StrategyEnv, UnknownNameIsAnErrorNamingTheVariable) {
  ASSERT_STREQ(std::getenv("SCATTER_ADD_CPU_STRATEGY"), "bogus");
  std::vector<float> out(4, 0.0f), src(2, 1.0f);
  const Idx idx = make_idx(IndexType::i32, {0, 1});
  try {
    sa::index_add_rows({out.data(), 2, 1, 1, DType::f32}, idx.view(), sa::ConstMatrix{src.data(), 2, 1, 1, DType::f32});
    FAIL() << "no error";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.kind(), sa::Error::Kind::value);
    EXPECT_STREQ(e.what(), "index_add_rows: SCATTER_ADD_CPU_STRATEGY='bogus' is not one of auto, direct, count, radix");
  }
  EXPECT_EQ(out, std::vector<float>(4, 0.0f));
}

// Run by its own CTest entries, one with SCATTER_ADD_CPU_STRATEGY set to each strategy (filtered
// out elsewhere): every call of index_add_rows and gather_rows runs that one, whatever the shape,
// threads or sorted index, unless Options::strategy names another.
TEST(StrategyEnvForced, EveryCallRunsTheNamedStrategy) {
  const char* env = std::getenv("SCATTER_ADD_CPU_STRATEGY");
  ASSERT_NE(env, nullptr);
  sa::Strategy named = sa::Strategy::automatic;
  for (sa::Strategy st : kStrategies)
    if (std::strcmp(env, sa::strategy_name(st)) == 0) named = st;
  ASSERT_NE(named, sa::Strategy::automatic) << "SCATTER_ADD_CPU_STRATEGY=" << env;
  ASSERT_EQ(sa::get_strategy(), named);
  // Shapes whose model picks are direct, count and radix (StrategyChoice above).
  const sa::cpu::AddShape shapes[] = {{64, 64, 1024, DType::f32}, {33, 32768, 128, DType::bf16},
                                      {1000000, 16, 1, DType::bf16}, {1000000, 100000, 1, DType::bf16},
                                      {16, 16, 1, DType::bf16},     {164, 16384, 256, DType::f64}};
  for (const auto& s : shapes)
    for (int nt : {1, 2, 3})
      for (bool sorted : {false, true}) {
        sa::Options o;
        o.num_threads = nt;
        EXPECT_EQ(sa::cpu::choose_add(s, o, sorted), named) << s.n << " " << s.k << " " << s.d;
        EXPECT_EQ(sa::cpu::choose_gather(o), named);
        for (sa::Strategy st : kStrategies) {
          o.strategy = st;
          EXPECT_EQ(sa::cpu::choose_add(s, o, sorted), st);
          EXPECT_EQ(sa::cpu::choose_gather(o), st);
        }
      }
  // And the calls give the contract's bits under it.
  std::vector<float> out(4, 0.5f), src = {1.0f, 2.0f, 4.0f}, dst(3, 0.0f);
  const Idx idx = make_idx(IndexType::i32, {3, 0, 3});
  sa::index_add_rows({out.data(), 4, 1, 1, DType::f32}, idx.view(), sa::ConstMatrix{src.data(), 3, 1, 1, DType::f32});
  EXPECT_EQ(out, (std::vector<float>{2.5f, 0.5f, 0.5f, 5.5f}));
  sa::gather_rows({dst.data(), 3, 1, 1, DType::f32}, sa::ConstMatrix{out.data(), 4, 1, 1, DType::f32}, idx.view());
  EXPECT_EQ(dst, (std::vector<float>{5.5f, 2.5f, 5.5f}));
}

}  // namespace

TEST(BadViews, MisalignedPointersAreRefusedAndOutIsUntouched) {
  alignas(16) unsigned char buf[4096] = {};
  alignas(16) float out[8 * 4] = {};
  const float src_ok[2 * 4] = {1, 2, 3, 4, 5, 6, 7, 8};
  const int64_t idx_ok[2] = {0, 3};
  auto try_add = [&](void* o, const void* s, const void* i, const void* w) {
    try {
      sa::index_add_rows({o, 8, 4, 4, DType::f32}, {i, 2, IndexType::i64}, {s, 2, 4, 4, DType::f32},
                         {w, 2, DType::f32}, {});
    } catch (const sa::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  std::memcpy(buf + 1, src_ok, sizeof src_ok);
  std::memcpy(buf + 201, idx_ok, sizeof idx_ok);
  const float w_ok[2] = {1, 1};
  std::memcpy(buf + 403, w_ok, sizeof w_ok);
  EXPECT_NE(try_add(out, buf + 1, idx_ok, nullptr).find("src data pointer is not aligned"), std::string::npos);
  EXPECT_NE(try_add(out, src_ok, buf + 201, nullptr).find("index data pointer is not aligned"), std::string::npos);
  EXPECT_NE(try_add(out, src_ok, idx_ok, buf + 403).find("weight data pointer is not aligned"), std::string::npos);
  for (float v : out) EXPECT_EQ(v, 0.0f);
  // The output itself misaligned: refused, its bytes unchanged.
  std::memset(buf + 600, 0x5A, 8 * 4 * 4 + 1);
  EXPECT_NE(try_add(buf + 601, src_ok, idx_ok, nullptr).find("out data pointer is not aligned"), std::string::npos);
  for (int b = 601; b < 601 + 8 * 4 * 4; ++b) EXPECT_EQ(buf[b], 0x5A);
  // Aligned: accepted.
  EXPECT_EQ(try_add(out, src_ok, idx_ok, w_ok), "");
  EXPECT_EQ(out[12], 5.0f);
}

TEST(Overlap, ViewsTooLargeToExistAreAnsweredConservatively) {
  alignas(8) static double cell[4];
  // cols * 8 bytes overflows int64: such a view cannot exist; "may overlap" is the safe answer.
  const int64_t huge = int64_t(1) << 62;
  EXPECT_TRUE(sa::views_may_overlap(sa::ConstMatrix{cell, 1, huge, huge, DType::f64},
                                    sa::ConstMatrix{cell + 2, 1, 1, 1, DType::f64}));
  sa::StridedView a{cell, 2, 1, huge, 1, 8}, b{cell + 1, 1, 1, 1, 1, 8};
  EXPECT_TRUE(sa::views_may_overlap(a, b));
  sa::StridedView c{cell, huge, 1, 1, 1, 8}, d{cell, huge, 1, 1, 1, 8};
  EXPECT_TRUE(sa::views_may_overlap(c, d));
}

TEST(PlanBuild, ForcedCountOverHugeRowCountsStillBuildsThePlan) {
  const int64_t idx[3] = {int64_t(1) << 39, 5, int64_t(1) << 39};
  const sa::Plan p = sa::Plan::build({idx, 3, IndexType::i64}, int64_t(1) << 40, std::nullopt, sa::Strategy::count);
  const sa::Plan q = sa::Plan::build({idx, 3, IndexType::i64}, int64_t(1) << 40, std::nullopt, sa::Strategy::radix);
  EXPECT_EQ(p.rows(), q.rows());
  EXPECT_EQ(p.offsets(), q.offsets());
  EXPECT_EQ(p.sources(), q.sources());
}
