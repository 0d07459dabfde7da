// small_matmul (y = x @ w.T in bfloat16, an expert's products): against a float64 reference
// within one float32 summation bound and one bf16 rounding, the same bits on 1 to 3 threads and
// whatever the number of x rows, strided views, special values, the level it declines (scalar),
// and bad input leaving y untouched; small_matmul_grouped, its blocks in one call. Where the CPU
// has AMX, the avx512_bf16 entry runs these on the tiles and a second entry without them.
#include <cpuid.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "scatter_add/scatter_add.h"
#include "test_util.h"

namespace {

// y [m, o] = x [m, h] @ w.T, w [o, h] (small_matmul), or, with nn, x @ w, w [h, o]
// (small_matmul_nn); every view with `pad` elements past its rows (twice that for w).
struct Mm {
  int64_t m, o, h, xs, ws, ys;
  bool nn;
  Buf x, w, y;
  Mm(int64_t m_, int64_t o_, int64_t h_, int64_t pad, std::mt19937_64& rng, bool nn_ = false)
      : m(m_), o(o_), h(h_), xs(h_ + pad), ws((nn_ ? o_ : h_) + 2 * pad), ys(o_ + pad), nn(nn_),
        x(random_buf(DType::bf16, static_cast<size_t>(std::max<int64_t>(m * xs, 1)), rng)),
        w(random_buf(DType::bf16, static_cast<size_t>(std::max<int64_t>((nn_ ? h : o) * ws, 1)), rng)),
        y(random_buf(DType::bf16, static_cast<size_t>(std::max<int64_t>(m * ys, 1)), rng)) {}
  sa::Matrix ym() { return {y.data(), m, o, ys, DType::bf16}; }
  sa::ConstMatrix xm() const { return {x.data(), m, h, xs, DType::bf16}; }
  sa::ConstMatrix wm() const { return nn ? sa::ConstMatrix{w.data(), h, o, ws, DType::bf16} : sa::ConstMatrix{w.data(), o, h, ws, DType::bf16}; }
  // w's element of column c of x's rows and column r of y's
  double wat(int64_t c, int64_t r) const { return w.get(static_cast<size_t>(nn ? c * ws + r : r * ws + c)); }
  bool run(int threads) {
    sa::Options opt;
    opt.num_threads = threads;
    return (nn ? sa::small_matmul_nn : sa::small_matmul)(ym(), xm(), wm(), opt);
  }
};

// call() throws Error of kind value naming `what`, and y is as it was.
template <class Call>
void expect_value_error(const char* what, Call&& call, const Buf& y, const Buf& before) {
  try {
    call();
    ADD_FAILURE() << "no error for " << what;
  } catch (const sa::Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    EXPECT_EQ(e.kind(), sa::Error::Kind::value);
  }
  EXPECT_EQ(y.bytes, before.bytes) << what;
}

bool served() { return sa::active_isa() >= sa::Isa::avx2; }

TEST(SmallMatmul, MatchesFloat64WithinOneRounding) {
  std::mt19937_64 rng(7);
  for (int64_t m : {1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 17, 26, 47})
    for (int64_t h : {0, 1, 17, 31, 32, 33, 64, 100, 1030})
      for (int64_t o : {1, 5, 9, 33, 70}) {
        Mm t(m, o, h, (m + h) % 3 == 0 ? 0 : 7, rng);
        const Buf before = t.y;
        const bool ran = t.run(2);
        ASSERT_EQ(ran, served()) << "isa=" << sa::isa_name(sa::active_isa());
        if (!ran) {
          ASSERT_EQ(t.y.bytes, before.bytes) << "a declined call wrote y";
          continue;
        }
        for (int64_t i = 0; i < m; ++i)
          for (int64_t r = 0; r < t.ys; ++r) {
            const size_t at = static_cast<size_t>(i * t.ys + r);
            if (r >= o) {  // padding past the view stays as it was
              ASSERT_EQ(t.y.get(at), before.get(at)) << "m=" << m << " o=" << o << " h=" << h;
              continue;
            }
            double ref = 0, mag = 0;
            for (int64_t c = 0; c < h; ++c) {
              const double p = t.x.get(static_cast<size_t>(i * t.xs + c)) * t.w.get(static_cast<size_t>(r * t.ws + c));
              ref += p;
              mag += std::fabs(p);
            }
            // float32 sums: at most h + 16 roundings of 2^-24 of the magnitudes; then one bf16 rounding.
            const double bound = static_cast<double>(h + 16) * std::ldexp(mag, -24) + std::ldexp(std::fabs(ref), -8) + 1e-30;
            ASSERT_LE(std::fabs(t.y.get(at) - ref), bound)
                << "m=" << m << " o=" << o << " h=" << h << " row " << i << " col " << r << ": " << t.y.get(at)
                << " want " << ref;
          }
      }
}

TEST(SmallMatmul, SameBitsOnEveryThreadCount) {
  if (!served()) GTEST_SKIP() << "no small_matmul kernel below avx2 (isa=" << sa::isa_name(sa::active_isa()) << ")";
  std::mt19937_64 rng(11);
  for (int64_t m : {1, 2, 3, 8, 19})
    for (int64_t o : {31, 200, 1000}) {
      Mm t(m, o, 300, 0, rng);
      ASSERT_TRUE(t.run(1));
      const Buf one = t.y;
      for (int threads : {2, 3}) {
        ASSERT_TRUE(t.run(threads));
        ASSERT_EQ(t.y.bytes, one.bytes) << "m=" << m << " o=" << o << " threads=" << threads;
      }
    }
}

TEST(SmallMatmul, SpecialValues) {
  if (!served()) GTEST_SKIP() << "no small_matmul kernel below avx2";
  std::mt19937_64 rng(3);
  Mm t(2, 40, 70, 0, rng);
  t.x.set(5, std::nan(""));                    // row 0: every result NaN
  t.w.set(static_cast<size_t>(3 * 70 + 69), INFINITY);  // column 3, in the tail: +-inf unless NaN
  ASSERT_TRUE(t.run(2));
  for (int64_t r = 0; r < 40; ++r) ASSERT_TRUE(std::isnan(t.y.get(static_cast<size_t>(r)))) << r;
  const double xv = t.x.get(70 + 69);
  ASSERT_EQ(t.y.get(static_cast<size_t>(40 + 3)), xv > 0 ? INFINITY : -INFINITY);
  // float32 range: bf16 products far past bf16's largest value sum without overflow
  Mm big(1, 1, 40, 0, rng);
  for (int64_t c = 0; c < 40; ++c) {
    big.x.set(static_cast<size_t>(c), 1e30);
    big.w.set(static_cast<size_t>(c), c % 2 ? 1e-30 : 2e-30);
  }
  ASSERT_TRUE(big.run(1));
  EXPECT_NEAR(big.y.get(0), 60.0, 60.0 * std::ldexp(1.0, -7));
}

// Each element's bits do not depend on the rows around it: a call of many rows equals calls of
// its rows one at a time (the kernels pass many rows in blocks of a few).
TEST(SmallMatmul, RowsGiveTheBitsOfOneRowCalls) {
  if (!served()) GTEST_SKIP() << "no small_matmul kernel below avx2";
  std::mt19937_64 rng(13);
  // (70 rows of 16000 columns: three passes of the AMX kernel, of 32, 32 and 6 rows)
  for (auto [m, h] : {std::pair<int64_t, int64_t>{2, 130}, {5, 130}, {9, 130}, {24, 130}, {37, 130}, {70, 16000}}) {
    Mm t(m, 45, h, 3, rng);
    ASSERT_TRUE(t.run(2));
    for (int64_t i = 0; i < m; ++i) {
      Buf one = random_buf(DType::bf16, static_cast<size_t>(45), rng);
      sa::Options opt;
      opt.num_threads = 1;
      ASSERT_TRUE(sa::small_matmul({one.data(), 1, 45, 45, DType::bf16},
                                   {static_cast<const uint16_t*>(t.x.data()) + i * t.xs, 1, h, t.xs, DType::bf16},
                                   t.wm(), opt));
      for (int64_t r = 0; r < 45; ++r)
        ASSERT_EQ(one.get(static_cast<size_t>(r)), t.y.get(static_cast<size_t>(i * t.ys + r)))
            << "m=" << m << " row " << i << " col " << r;
    }
  }
}

// CPUID and XCR0 say the CPU has AMX-TILE and AMX-BF16 and the OS enables their state.
bool cpu_has_amx() {
  unsigned a, b, c, d;
  if (__get_cpuid_max(0, nullptr) < 7) return false;
  __cpuid_count(7, 0, a, b, c, d);
  if (!((d >> 24) & 1u) || !((d >> 22) & 1u)) return false;
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & (3u << 17)) == (3u << 17);
}

// The tiles run exactly where the level, the CPU, the build and SCATTER_ADD_CPU_AMX allow, and
// set_amx_tiles and set_isa turn them off and on again.
TEST(SmallMatmul, TilesWhereTheCpuLevelAndBuildHaveThem) {
  const char* env = std::getenv("SCATTER_ADD_CPU_AMX");
  const bool off = env != nullptr && std::strcmp(env, "0") == 0;
  const bool level = sa::active_isa() == sa::Isa::avx512_bf16;
  EXPECT_EQ(sa::amx_tiles(), level && cpu_has_amx() && SCATTER_ADD_TESTS_AMX && !off)
      << "isa=" << sa::isa_name(sa::active_isa()) << " SCATTER_ADD_CPU_AMX=" << (env ? env : "(unset)");
  const bool was = sa::amx_tiles();
  EXPECT_FALSE(sa::set_amx_tiles(false));
  std::mt19937_64 rng(17);
  Mm t(3, 40, 64, 0, rng);
  EXPECT_EQ(t.run(2), served());  // the level's vector kernel
  EXPECT_EQ(sa::set_amx_tiles(true), level && cpu_has_amx() && SCATTER_ADD_TESTS_AMX);
  const sa::Isa isa = sa::active_isa();
  sa::set_isa(sa::Isa::avx512);
  EXPECT_FALSE(sa::amx_tiles());
  sa::set_isa(isa);
  sa::set_amx_tiles(was);
  EXPECT_EQ(sa::amx_tiles(), was);
}

// Rows of more than 65536 columns take the level's vector kernel even where the tiles are on.
// Told apart by a subnormal input, which the tiles count as zero and the vector kernels do not:
// x[0][5] = 1e-39 times w[r][5] = 1e30 is 1e-9 by the vector kernel, 0 on the tiles.
TEST(SmallMatmul, RowsPastTheTilesWidthTakeTheVectorKernel) {
  if (!served()) GTEST_SKIP() << "no small_matmul kernel below avx2";
  std::mt19937_64 rng(19);
  const bool was = sa::amx_tiles();
  const bool tiles = sa::set_amx_tiles(true);
  for (int64_t h : {int64_t{65536}, int64_t{70000}}) {
    Mm t(1, 3, h, 0, rng);
    std::fill(t.x.bytes.begin(), t.x.bytes.end(), 0);
    std::fill(t.w.bytes.begin(), t.w.bytes.end(), 0);
    t.x.set(5, 1e-39);
    for (int64_t r = 0; r < 3; ++r) t.w.set(static_cast<size_t>(r * t.ws + 5), 1e30);
    ASSERT_TRUE(t.run(2));
    const bool on_tiles = tiles && h <= 65536;
    for (int64_t r = 0; r < 3; ++r) {
      if (on_tiles) {
        EXPECT_EQ(t.y.get(static_cast<size_t>(r)), 0.0) << "h=" << h;
      } else {
        EXPECT_NEAR(t.y.get(static_cast<size_t>(r)), t.x.get(5) * 1e30, 1e-11) << "h=" << h;
      }
    }
  }
  sa::set_amx_tiles(was);
}

TEST(SmallMatmul, DeclinesTheScalarLevel) {
  std::mt19937_64 rng(5);
  const sa::Isa was = sa::active_isa();
  sa::set_isa(sa::Isa::scalar);
  Mm u(2, 10, 20, 0, rng);
  const Buf ub = u.y;
  EXPECT_FALSE(u.run(2));
  EXPECT_EQ(u.y.bytes, ub.bytes);
  sa::set_isa(was);
}

TEST(SmallMatmul, BadInputNamesTheArgumentAndLeavesYUntouched) {
  std::mt19937_64 rng(9);
  Mm t(2, 10, 20, 0, rng);
  const Buf before = t.y;
  Buf xf = random_buf(DType::f32, 40, rng);
  expect_value_error("x dtype is float32", [&] { sa::small_matmul(t.ym(), {xf.data(), 2, 20, 20, DType::f32}, t.wm()); }, t.y, before);
  expect_value_error("x has 19 columns but w has 20", [&] { sa::small_matmul(t.ym(), {t.x.data(), 2, 19, 20, DType::bf16}, t.wm()); }, t.y, before);
  expect_value_error("y has shape [2, 10] but x @ w.T has shape [2, 9]", [&] { sa::small_matmul(t.ym(), t.xm(), {t.w.data(), 9, 20, 20, DType::bf16}); }, t.y, before);
  Buf shared = random_buf(DType::bf16, 220, rng);  // y [2, 10] inside w [10, 20]
  const Buf shared_before = shared;
  expect_value_error("w memory overlaps y",
               [&] { sa::small_matmul({static_cast<uint16_t*>(shared.data()) + 20, 2, 10, 10, DType::bf16}, t.xm(), {shared.data(), 10, 20, 20, DType::bf16}); },
               shared, shared_before);
  expect_value_error("y row stride 5 is smaller", [&] { sa::small_matmul({t.y.data(), 2, 10, 5, DType::bf16}, t.xm(), t.wm()); }, t.y, before);
}

// small_matmul_grouped: w [groups * o, h] (an [E, o, h] parameter), block g the rows
// [ends[g - 1], ends[g]) of x and y; each block has the bits of small_matmul on it alone, on any
// thread count, and rows past the last block are not written.
TEST(SmallMatmulGrouped, BlocksHaveTheBitsOfOneCallEach) {
  if (!served()) GTEST_SKIP() << "no small_matmul kernel below avx2";
  std::mt19937_64 rng(23);
  const std::vector<std::vector<int64_t>> cases = {{1}, {0, 2, 0, 1, 3}, {5, 1, 0, 9, 2, 2}, {0, 0, 7}, {0}};
  for (const auto& rows : cases)
    for (int64_t o : {3, 40, 100}) {
      const int64_t groups = static_cast<int64_t>(rows.size()), h = 70, pad = 4;
      std::vector<int64_t> ends;
      int64_t total = 0;
      for (int64_t r : rows) ends.push_back(total += r);
      const int64_t m = total + 2;  // two rows past the last block
      Buf x = random_buf(DType::bf16, static_cast<size_t>(m * h + 1), rng);
      Buf w = random_buf(DType::bf16, static_cast<size_t>(groups * o * (h + pad)), rng);
      const sa::ConstMatrix xm{x.data(), m, h, h, DType::bf16}, wm{w.data(), groups * o, h, h + pad, DType::bf16};
      std::vector<unsigned char> first;
      for (int threads : {1, 2, 3}) {
        Buf y = random_buf(DType::bf16, static_cast<size_t>(m * o), rng);
        const Buf before = y;
        sa::Options opt;
        opt.num_threads = threads;
        ASSERT_TRUE(sa::small_matmul_grouped({y.data(), m, o, o, DType::bf16}, xm, wm, ends.data(), groups, opt));
        ASSERT_TRUE(std::equal(y.bytes.begin() + total * o * 2, y.bytes.end(), before.bytes.begin() + total * o * 2))
            << "a row past the last block was written";
        for (int64_t g = 0, start = 0; g < groups; start = ends[static_cast<size_t>(g++)]) {
          const int64_t end = ends[static_cast<size_t>(g)];
          if (end == start) continue;
          Buf one = random_buf(DType::bf16, static_cast<size_t>((end - start) * o), rng);
          ASSERT_TRUE(sa::small_matmul({one.data(), end - start, o, o, DType::bf16},
                                       {static_cast<const uint16_t*>(x.data()) + start * h, end - start, h, h, DType::bf16},
                                       {static_cast<const uint16_t*>(w.data()) + g * o * (h + pad), o, h, h + pad, DType::bf16}));
          ASSERT_TRUE(std::equal(one.bytes.begin(), one.bytes.end(), y.bytes.begin() + start * o * 2))
              << "group " << g << " o=" << o << " threads=" << threads;
        }
        if (threads == 1) first.assign(y.bytes.begin(), y.bytes.begin() + total * o * 2);
        else ASSERT_TRUE(std::equal(first.begin(), first.end(), y.bytes.begin())) << "threads=" << threads;
      }
    }
}

// The ends may lie in y's memory (the C++ caller's choice): they are read before y is written.
TEST(SmallMatmulGrouped, EndsInsideYAreReadBeforeTheWrites) {
  if (!served()) GTEST_SKIP() << "no small_matmul kernel below avx2";
  std::mt19937_64 rng(31);
  const int64_t m = 8, o = 16, h = 32, groups = 3;
  Buf x = random_buf(DType::bf16, static_cast<size_t>(m * h), rng), w = random_buf(DType::bf16, static_cast<size_t>(groups * o * h), rng);
  std::vector<int64_t> store(static_cast<size_t>(m * o * 2 / 8));  // y's bf16 elements, 8-byte aligned
  int64_t* ends = store.data();
  ends[0] = 2, ends[1] = 5, ends[2] = 8;
  const int64_t want_ends[] = {2, 5, 8};
  Buf want = random_buf(DType::bf16, static_cast<size_t>(m * o), rng);
  const sa::ConstMatrix xm{x.data(), m, h, h, DType::bf16}, wm{w.data(), groups * o, h, h, DType::bf16};
  ASSERT_TRUE(sa::small_matmul_grouped({want.data(), m, o, o, DType::bf16}, xm, wm, want_ends, groups));
  sa::Options one;
  one.num_threads = 1;
  ASSERT_TRUE(sa::small_matmul_grouped({store.data(), m, o, o, DType::bf16}, xm, wm, ends, groups, one));
  ASSERT_EQ(0, std::memcmp(store.data(), want.data(), static_cast<size_t>(m * o * 2)));
}

TEST(SmallMatmulGrouped, BadInputNamesTheArgumentAndLeavesYUntouched) {
  std::mt19937_64 rng(29);
  Buf x = random_buf(DType::bf16, 8 * 16, rng), w = random_buf(DType::bf16, 3 * 5 * 16, rng);
  Buf y = random_buf(DType::bf16, 8 * 5, rng);
  const Buf before = y;
  const sa::Matrix ym{y.data(), 8, 5, 5, DType::bf16};
  const sa::ConstMatrix xm{x.data(), 8, 16, 16, DType::bf16}, wm{w.data(), 15, 16, 16, DType::bf16};
  const int64_t good[] = {2, 4, 8}, down[] = {2, 4, 3}, past[] = {2, 4, 9}, negative[] = {-1, 4, 8};
  expect_value_error("groups must be at least 1, got 0", [&] { sa::small_matmul_grouped(ym, xm, wm, good, 0); }, y, before);
  expect_value_error("ends is null", [&] { sa::small_matmul_grouped(ym, xm, wm, nullptr, 3); }, y, before);
  expect_value_error("w has 15 rows, not a multiple of groups = 2", [&] { sa::small_matmul_grouped(ym, xm, wm, good, 2); }, y, before);
  expect_value_error("ends[2] = 3 is smaller than ends[1] = 4", [&] { sa::small_matmul_grouped(ym, xm, wm, down, 3); }, y, before);
  expect_value_error("ends[2] = 9 is past x's 8 rows", [&] { sa::small_matmul_grouped(ym, xm, wm, past, 3); }, y, before);
  expect_value_error("ends[0] = -1 is negative", [&] { sa::small_matmul_grouped(ym, xm, wm, negative, 3); }, y, before);
  expect_value_error("x has 12 columns but w has 16", [&] { sa::small_matmul_grouped(ym, {x.data(), 8, 12, 16, DType::bf16}, wm, good, 3); }, y, before);
  expect_value_error("y has shape [8, 5] but x @ w.T has shape [8, 3]", [&] { sa::small_matmul_grouped(ym, xm, {w.data(), 9, 16, 16, DType::bf16}, good, 3); }, y, before);
  Buf shared = random_buf(DType::bf16, 15 * 16, rng);  // y [8, 5] inside w's last expert
  const Buf shared_before = shared;
  expect_value_error("w memory overlaps y",
                     [&] { sa::small_matmul_grouped({static_cast<uint16_t*>(shared.data()) + 190, 8, 5, 5, DType::bf16}, xm, {shared.data(), 15, 16, 16, DType::bf16}, good, 3); },
                     shared, shared_before);
}

TEST(SmallMatmulNN, MatchesFloat64WithinOneRounding) {
  std::mt19937_64 rng(17);
  for (int64_t m : {1, 2, 5, 6, 7, 13})
    for (int64_t h : {0, 1, 3, 64, 300})
      for (int64_t o : {1, 15, 16, 17, 40, 70}) {
        Mm t(m, o, h, (m + o) % 3 == 0 ? 0 : 5, rng, true);
        const Buf before = t.y;
        const bool ran = t.run(2);
        ASSERT_EQ(ran, served());
        if (!ran) {
          ASSERT_EQ(t.y.bytes, before.bytes);
          continue;
        }
        for (int64_t i = 0; i < m; ++i)
          for (int64_t r = 0; r < t.ys; ++r) {
            const size_t at = static_cast<size_t>(i * t.ys + r);
            if (r >= o) {
              ASSERT_EQ(t.y.get(at), before.get(at)) << "m=" << m << " o=" << o << " h=" << h;
              continue;
            }
            double ref = 0, mag = 0;
            for (int64_t c = 0; c < h; ++c) {
              const double p = t.x.get(static_cast<size_t>(i * t.xs + c)) * t.wat(c, r);
              ref += p;
              mag += std::fabs(p);
            }
            const double bound = static_cast<double>(h + 1) * std::ldexp(mag, -24) + std::ldexp(std::fabs(ref), -8) + 1e-30;
            ASSERT_LE(std::fabs(t.y.get(at) - ref), bound)
                << "m=" << m << " o=" << o << " h=" << h << " row " << i << " col " << r;
          }
      }
}

// Each element is its products' FMA chain in order of h: the same bits on any thread count and
// for its row alone, and the float32 sum done the same way in scalar code.
TEST(SmallMatmulNN, BitsOfTheOrderedFmaChain) {
  if (!served()) GTEST_SKIP() << "no small_matmul_nn kernel at the scalar level";
  std::mt19937_64 rng(19);
  for (int64_t m : {1, 7, 20})
    for (int64_t o : {33, 100, 500}) {
      Mm t(m, o, 90, 2, rng, true);
      ASSERT_TRUE(t.run(1));
      const Buf one = t.y;
      for (int threads : {2, 3}) {
        ASSERT_TRUE(t.run(threads));
        ASSERT_EQ(t.y.bytes, one.bytes) << "m=" << m << " o=" << o << " threads=" << threads;
      }
      for (int64_t i = 0; i < m; ++i)
        for (int64_t r = 0; r < o; ++r) {
          float acc = 0;
          for (int64_t c = 0; c < t.h; ++c)
            acc = std::fma(static_cast<float>(t.x.get(static_cast<size_t>(i * t.xs + c))),
                           static_cast<float>(t.wat(c, r)), acc);
          Buf want = random_buf(DType::bf16, 1, rng);
          want.set(0, acc);
          ASSERT_EQ(t.y.get(static_cast<size_t>(i * t.ys + r)), want.get(0)) << "m=" << m << " row " << i << " col " << r;
        }
    }
}

TEST(SmallMatmulNN, BadInputNamesTheArgumentAndLeavesYUntouched) {
  std::mt19937_64 rng(23);
  Mm t(2, 10, 20, 0, rng, true);
  const Buf before = t.y;
  expect_value_error("x has 20 columns but w has 19 rows", [&] { sa::small_matmul_nn(t.ym(), t.xm(), {t.w.data(), 19, 10, 10, DType::bf16}); }, t.y, before);
  expect_value_error("y has shape [2, 10] but x @ w has shape [2, 9]", [&] { sa::small_matmul_nn(t.ym(), t.xm(), {t.w.data(), 20, 9, 10, DType::bf16}); }, t.y, before);
  expect_value_error("w memory overlaps y", [&] { sa::small_matmul_nn(t.ym(), t.xm(), {t.y.data(), 20, 10, 10, DType::bf16}); }, t.y, before);
}

}  // namespace
