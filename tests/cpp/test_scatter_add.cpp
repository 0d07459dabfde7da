// GoogleTest suite of the C++ core: every dtype x index type x weight x ignore_index against a
// float64 reference, edge shapes, bitwise determinism across thread counts and runs, plan reuse,
// and bad input (an error naming the argument, and `out` left bit-for-bit unchanged).
// CTest runs it once per forced ISA level (SCATTER_ADD_CPU_ISA); `ctest --test-dir .build/release`.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <thread>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "scatter_add/scatter_add.h"
#include "test_util.h"

namespace {

// Runs index_add_rows and checks every element against a float64 reference with a bound of
// one final rounding plus (contributions + 1) accumulator roundings of the magnitudes summed.
void check_index_add(const Case& c, int64_t n, int64_t k, int64_t d, Pattern pat, uint64_t seed) {
  SCOPED_TRACE(describe(c, n, k, d));
  std::mt19937_64 rng(seed);
  const int64_t out_stride = d + (seed % 3 == 0 ? 5 : 0), src_stride = d + (seed % 2 ? 3 : 0);
  Buf out = random_buf(c.dtype, static_cast<size_t>(std::max<int64_t>(n * out_stride, 1)), rng);
  Buf src = random_buf(c.dtype, static_cast<size_t>(std::max<int64_t>(k * src_stride, 1)), rng);
  std::vector<int64_t> iv = make_indices(pat, n, k, rng);
  const int64_t ignore_value = c.ignore ? (n > 2 ? 1 : -1) : 0;
  if (c.ignore)
    for (int64_t i = 0; i < k; i += 3) iv[i] = ignore_value;
  Idx idx = make_idx(c.itype, iv);
  std::vector<float> w(static_cast<size_t>(k));
  for (auto& x : w) x = std::uniform_real_distribution<float>(-1.5f, 1.5f)(rng);

  std::vector<double> ref(static_cast<size_t>(n * d)), mag(static_cast<size_t>(n * d));
  std::vector<int> cnt(static_cast<size_t>(n), 0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < d; ++j) {
      ref[r * d + j] = out.get(r * out_stride + j);
      mag[r * d + j] = std::fabs(ref[r * d + j]);
    }
  for (int64_t i = 0; i < k; ++i) {
    if (c.ignore && iv[i] == ignore_value) continue;
    ++cnt[iv[i]];
    for (int64_t j = 0; j < d; ++j) {
      const double t = (c.weighted ? w[i] : 1.0) * src.get(i * src_stride + j);
      ref[iv[i] * d + j] += t;
      mag[iv[i] * d + j] += std::fabs(t);
    }
  }
  Buf before = out;
  sa::Options opt;
  if (c.ignore) opt.ignore_index = ignore_value;
  sa::WeightVector wv{c.weighted ? w.data() : nullptr, k, DType::f32};
  sa::index_add_rows(mat(out, n, d, out_stride), idx.view(), cmat(src, k, d, src_stride), wv, opt);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < d; ++j) {
      const double got = out.get(r * out_stride + j), want = ref[r * d + j];
      const double tol = eps_of(c.dtype) * std::fabs(want) +
                         (cnt[r] + 1) * acc_eps(c.dtype) * mag[r * d + j] * 2 + 1e-30;
      ASSERT_LE(std::fabs(got - want), tol) << "row " << r << " col " << j;
    }
    // Padding between rows is never written.
    for (int64_t j = d; j < out_stride; ++j)
      ASSERT_EQ(out.get(r * out_stride + j), before.get(r * out_stride + j));
  }
}


TEST(IndexAdd, ReportsIsa) {
  std::printf("supported ISA: %s, active ISA: %s\n", sa::isa_name(sa::supported_isa()),
              sa::isa_name(sa::active_isa()));
}

TEST(IndexAdd, MatchesFloat64ReferenceOnEveryCombination) {
  struct Shape {
    int64_t n, k, d;
    Pattern p;
  };
  const Shape shapes[] = {{37, 80, 1, Pattern::uniform},   {64, 128, 17, Pattern::moe_topk},
                          {1, 9, 33, Pattern::uniform},    {50, 0, 16, Pattern::uniform},
                          {20, 60, 65, Pattern::all_equal}, {300, 600, 130, Pattern::moe_topk},
                          {40, 200, 257, Pattern::hot_row}, {8, 24, 1000, Pattern::uniform}};
  uint64_t seed = 1;
  for (DType t : kDtypes)
    for (IndexType it : kItypes)
      for (bool w : {false, true})
        for (bool ig : {false, true})
          for (const Shape& s : shapes) check_index_add({t, it, w, ig}, s.n, s.k, s.d, s.p, seed++);
}

TEST(IndexAdd, DZeroAndKZeroAreNoOps) {
  std::mt19937_64 rng(3);
  Buf out = random_buf(DType::f32, 40, rng);
  Buf before = out;
  Buf src(DType::f32, 1);
  Idx idx = make_idx(IndexType::i64, {});
  sa::index_add_rows(mat(out, 10, 4, 4), idx.view(), cmat(src, 0, 4, 4));
  Idx idx3 = make_idx(IndexType::i64, {1, 2, 3});
  sa::index_add_rows(mat(out, 10, 0, 4), idx3.view(), cmat(src, 3, 0, 0));
  EXPECT_EQ(out.bytes, before.bytes);
}

TEST(IndexAdd, Bf16AccumulatesInFloat32) {
  // 256 additions of 1 to 256 in bf16 stay at 256 when summed in bf16 (ulp is 2), but the exact
  // sum 512 is representable: only float32 accumulation gets it.
  const int64_t k = 256;
  Buf out(DType::bf16, 1), src(DType::bf16, k);
  out.set(0, 256.0);
  for (int64_t i = 0; i < k; ++i) src.set(i, 1.0);
  Idx idx = make_idx(IndexType::i32, std::vector<int64_t>(k, 0));
  sa::index_add_rows(mat(out, 1, 1, 1), idx.view(), cmat(src, k, 1, 1));
  EXPECT_EQ(out.get(0), 512.0);
}

// Bitwise identical output for 1, 2, 3 and 8 threads and across repeated runs.
TEST(Determinism, BitwiseAcrossThreadCountsAndRuns) {
  for (DType t : kDtypes)
    for (Pattern p : {Pattern::moe_topk, Pattern::hot_row, Pattern::all_equal, Pattern::uniform}) {
      std::mt19937_64 rng(11);
      const int64_t n = 257, k = 1500, d = 300;
      const Buf out0 = random_buf(t, n * d, rng);
      const Buf src = random_buf(t, k * d, rng);
      Idx idx = make_idx(IndexType::i64, make_indices(p, n, k, rng));
      std::vector<float> w(k, 0.37f);
      std::vector<unsigned char> first;
      for (int threads : {1, 2, 3, 8, 1, 8}) {
        Buf out = out0;
        sa::Options opt;
        opt.num_threads = threads;
        sa::index_add_rows(mat(out, n, d, d), idx.view(), cmat(src, k, d, d), {w.data(), k, DType::f32}, opt);
        if (first.empty()) first = out.bytes;
        ASSERT_EQ(out.bytes, first) << sa::dtype_name(t) << " threads=" << threads;
      }
    }
}

TEST(Gather, MatchesReferenceWithWeightAndIgnore) {
  for (DType t : kDtypes)
    for (IndexType it : kItypes)
      for (bool weighted : {false, true})
        for (bool ig : {false, true}) {
          std::mt19937_64 rng(5);
          const int64_t n = 33, k = 70, d = 45;
          const Buf x = random_buf(t, n * d, rng);
          std::vector<int64_t> iv = make_indices(Pattern::uniform, n, k, rng);
          if (ig) iv[3] = iv[10] = -7;
          Idx idx = make_idx(it, iv);
          std::vector<double> w(k);
          for (auto& v : w) v = std::uniform_real_distribution<double>(-2, 2)(rng);
          sa::WeightVector wv{weighted ? w.data() : nullptr, k, DType::f64};
          sa::Options opt;
          if (ig) opt.ignore_index = -7;
          Buf dst = random_buf(t, k * d, rng);
          sa::gather_rows(mat(dst, k, d, d), cmat(x, n, d, d), idx.view(), wv, opt);
          // The same through a plan.
          Buf dst2 = random_buf(t, k * d, rng);
          const sa::Plan plan = sa::Plan::build(idx.view(), n, opt.ignore_index);
          sa::gather_rows(mat(dst2, k, d, d), cmat(x, n, d, d), plan, wv, opt);
          EXPECT_EQ(dst.bytes, dst2.bytes);
          for (int64_t i = 0; i < k; ++i)
            for (int64_t j = 0; j < d; ++j) {
              double want = 0;
              if (!(ig && iv[i] == -7)) {
                want = x.get(iv[i] * d + j);
                if (weighted) want *= (t == DType::f64 ? w[i] : static_cast<float>(w[i]));
              }
              ASSERT_NEAR(dst.get(i * d + j), want, eps_of(t) * std::fabs(want) * 2 + 1e-30)
                  << sa::dtype_name(t) << " i=" << i << " j=" << j;
            }
        }
}

TEST(Plan, ReusedPlanGivesTheSameBitsAsTheIndex) {
  std::mt19937_64 rng(9);
  const int64_t n = 100, k = 400, d = 70;
  Idx idx = make_idx(IndexType::i32, make_indices(Pattern::moe_topk, n, k, rng));
  const Buf src = random_buf(DType::bf16, k * d, rng);
  const Buf out0 = random_buf(DType::bf16, n * d, rng);
  const sa::Plan plan = sa::Plan::build(idx.view(), n);
  EXPECT_EQ(plan.num_distinct(), n);
  EXPECT_EQ(plan.offsets().back(), k);
  for (int rep = 0; rep < 3; ++rep) {
    Buf a = out0, b = out0;
    sa::index_add_rows(mat(a, n, d, d), idx.view(), cmat(src, k, d, d));
    sa::index_add_rows(mat(b, n, d, d), plan, cmat(src, k, d, d));
    ASSERT_EQ(a.bytes, b.bytes);
  }
  // Source ids within each row are in increasing order.
  for (int64_t r = 0; r < plan.num_distinct(); ++r)
    for (int64_t j = plan.offsets()[r] + 1; j < plan.offsets()[r + 1]; ++j)
      ASSERT_LT(plan.sources()[j - 1], plan.sources()[j]);
}

TEST(Plan, SortPathForFewIndicesIntoManyRows) {
  // N far above K takes the comparison-sort path; it must give the same plan as counting sort.
  std::mt19937_64 rng(4);
  const int64_t n = 1 << 20, k = 300;
  Idx idx = make_idx(IndexType::i64, make_indices(Pattern::uniform, n, k, rng));
  idx.values[7] = idx.values[8] = idx.values[100];
  const sa::Plan a = sa::Plan::build(idx.view(), n);
  const int64_t small_n = *std::max_element(idx.values.begin(), idx.values.end()) + 1;
  const sa::Plan b = sa::Plan::build(idx.view(), small_n);  // counting sort
  EXPECT_EQ(a.rows(), b.rows());
  EXPECT_EQ(a.offsets(), b.offsets());
  EXPECT_EQ(a.sources(), b.sources());
}

// --- bad input: an error naming the argument, and out left bit-for-bit unchanged -------------

template <class F>
void expect_error(F&& f, sa::Error::Kind kind, const std::string& needle) {
  try {
    f();
    FAIL() << "no error; expected one containing '" << needle << "'";
  } catch (const sa::Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(BadInput, ErrorsNameTheArgumentAndLeaveOutUntouched) {
  std::mt19937_64 rng(2);
  const int64_t n = 10, k = 6, d = 8;
  Buf out = random_buf(DType::f32, n * d, rng);
  const Buf before = out;
  Buf src = random_buf(DType::f32, k * d, rng);
  Buf src_bf = random_buf(DType::bf16, k * d, rng);
  Idx good = make_idx(IndexType::i64, {0, 1, 2, 3, 4, 5});
  Idx bad = make_idx(IndexType::i64, {0, 1, 2, 3, 10, 5});
  Idx neg = make_idx(IndexType::i32, {0, 1, -1, 3, 4, 5});
  Idx shortidx = make_idx(IndexType::i64, {0, 1});
  std::vector<float> w3(3, 1.f);
  const auto O = mat(out, n, d, d);
  const auto S = cmat(src, k, d, d);
  using K = sa::Error::Kind;
  expect_error([&] { sa::index_add_rows(O, bad.view(), S); }, K::index, "index[4] = 10");
  expect_error([&] { sa::index_add_rows(O, neg.view(), S); }, K::index, "index[2] = -1");
  sa::Options ig;
  ig.ignore_index = -1;
  expect_error([&] { sa::index_add_rows(O, bad.view(), S, {}, ig); }, K::index, "ignore_index = -1");
  expect_error([&] { sa::index_add_rows(O, good.view(), cmat(src_bf, k, d, d)); }, K::value,
               "src dtype bfloat16 does not match out dtype float32");
  expect_error([&] { sa::index_add_rows(O, shortidx.view(), S); }, K::value, "index has 2 entries");
  expect_error([&] { sa::index_add_rows(O, good.view(), cmat(src, k, d - 1, d)); }, K::value,
               "src has 7 columns but out has 8");
  expect_error([&] { sa::index_add_rows(O, good.view(), S, {w3.data(), 3, DType::f32}); }, K::value,
               "weight has 3 entries");
  expect_error([&] { sa::index_add_rows(O, good.view(), {nullptr, k, d, d, DType::f32}); }, K::value,
               "src is null");
  expect_error([&] { sa::index_add_rows({nullptr, n, d, d, DType::f32}, good.view(), S); }, K::value,
               "out is null");
  expect_error([&] { sa::index_add_rows(O, {nullptr, k, IndexType::i64}, S); }, K::value, "index is null");
  // src overlapping out: the last rows of out used as src.
  expect_error([&] { sa::index_add_rows(O, good.view(), cmat(out, k, d, d)); }, K::value,
               "src memory overlaps out");
  expect_error([&] { sa::index_add_rows({out.data(), n, d, d - 1, DType::f32}, good.view(), S); },
               K::value, "row stride");
  EXPECT_EQ(out.bytes, before.bytes);

  // gather: dst untouched on error.
  Buf dst = random_buf(DType::f32, k * d, rng);
  const Buf dst_before = dst;
  expect_error([&] { sa::gather_rows(mat(dst, k, d, d), cmat(out, n, d, d), bad.view()); }, K::index,
               "index[4] = 10");
  expect_error([&] { sa::gather_rows(mat(dst, k, d, d), cmat(dst, k, d, d), good.view()); }, K::value,
               "x memory overlaps dst");
  EXPECT_EQ(dst.bytes, dst_before.bytes);

  // Every strategy and thread count refuses a bad index before its first write.
  for (sa::Strategy st : {sa::Strategy::direct, sa::Strategy::count, sa::Strategy::radix})
    for (int threads : {1, 2, 3}) {
      sa::Options o;
      o.strategy = st;
      o.num_threads = threads;
      expect_error([&] { sa::index_add_rows(O, bad.view(), S, {}, o); }, K::index, "index[4] = 10");
      expect_error([&] { sa::index_add_rows(O, neg.view(), S, {}, o); }, K::index, "index[2] = -1");
      expect_error([&] { sa::gather_rows(mat(dst, k, d, d), cmat(out, n, d, d), bad.view(), {}, o); }, K::index,
                   "index[4] = 10");
      expect_error([&] { sa::gather_rows(mat(dst, k, d, d), cmat(out, n, d, d), neg.view(), {}, o); }, K::index,
                   "index[2] = -1");
      o.ignore_index = -1;
      expect_error([&] { sa::index_add_rows(O, bad.view(), S, {}, o); }, K::index, "ignore_index = -1");
      expect_error([&] { sa::gather_rows(mat(dst, k, d, d), cmat(out, n, d, d), bad.view(), {}, o); }, K::index,
                   "ignore_index = -1");
    }
  EXPECT_EQ(out.bytes, before.bytes);
  EXPECT_EQ(dst.bytes, dst_before.bytes);

  // A bad value first or last in an index of any length (the checks' vector bodies and tails),
  // either type, with or without an ignore_index elsewhere, is refused by every strategy.
  for (IndexType it : {IndexType::i32, IndexType::i64})
    for (int64_t len : {1, 2, 15, 16, 17, 33, 64, 100})
      for (int64_t at : {int64_t(0), len - 1})
        for (int64_t value : {n, int64_t(-2)})
          for (bool with_ignore : {false, true}) {
            std::vector<int64_t> v(static_cast<size_t>(len), 3);
            v[static_cast<size_t>(at)] = value;
            const Idx one_bad = make_idx(it, v);
            Buf many = random_buf(DType::f32, len * d, rng);
            const std::string want = "index[" + std::to_string(at) + "] = " + std::to_string(value);
            for (sa::Strategy st : {sa::Strategy::automatic, sa::Strategy::direct, sa::Strategy::count})
              for (int threads : {1, 2}) {
                sa::Options o;
                o.strategy = st;
                o.num_threads = threads;
                if (with_ignore) o.ignore_index = 7;
                expect_error([&] { sa::index_add_rows(O, one_bad.view(), cmat(many, len, d, d), {}, o); }, K::index,
                             want);
                Buf got = random_buf(DType::f32, len * d, rng);
                const Buf got_before = got;
                expect_error([&] { sa::gather_rows(mat(got, len, d, d), cmat(out, n, d, d), one_bad.view(), {}, o); },
                             K::index, want);
                EXPECT_EQ(got.bytes, got_before.bytes);
              }
          }
  EXPECT_EQ(out.bytes, before.bytes);

  // A plan for another shape is refused.
  const sa::Plan plan = sa::Plan::build(good.view(), n + 1);
  expect_error([&] { sa::index_add_rows(O, plan, S); }, K::value, "plan was built for 11 rows");
  EXPECT_EQ(out.bytes, before.bytes);
}

TEST(Isa, EveryLevelUpToTheSupportedOneAgreesWithScalar) {
  const sa::Isa saved = sa::active_isa();
  std::mt19937_64 rng(21);
  const int64_t n = 31, k = 90, d = 77;
  for (DType t : kDtypes) {
    const Buf out0 = random_buf(t, n * d, rng);
    const Buf src = random_buf(t, k * d, rng);
    Idx idx = make_idx(IndexType::i64, make_indices(Pattern::uniform, n, k, rng));
    std::vector<Buf> results;
    for (sa::Isa isa : {sa::Isa::scalar, sa::Isa::avx2, sa::Isa::avx512, sa::Isa::avx512_bf16}) {
      if (static_cast<int>(isa) > static_cast<int>(sa::supported_isa())) continue;
      ASSERT_EQ(sa::set_isa(isa), isa);
      Buf out = out0;
      sa::index_add_rows(mat(out, n, d, d), idx.view(), cmat(src, k, d, d));
      results.push_back(out);
    }
    // Unweighted sums do the same float additions in the same order on every level.
    for (const Buf& r : results)
      for (size_t i = 0; i < r.size(); ++i)
        ASSERT_EQ(r.get(i), results[0].get(i)) << sa::dtype_name(t) << " element " << i;
  }
  sa::set_isa(saved);
}

TEST(Convert, HalfAndBf16RoundTripAndRounding) {
  // Every fp16 bit pattern survives f16 -> f32 -> f16 (NaNs stay NaN).
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = sa::cpu::f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(sa::cpu::f32_to_f16(f), h) << std::hex << h;
  }
  EXPECT_EQ(sa::cpu::f32_to_f16(65520.f), 0x7C00);          // rounds to inf
  EXPECT_EQ(sa::cpu::f32_to_f16(65519.f), 0x7BFF);          // rounds to max
  EXPECT_EQ(sa::cpu::f32_to_f16(std::ldexp(1.f, -25)), 0);  // tie to even: zero
  EXPECT_EQ(sa::cpu::f32_to_bf16(1.0f + std::ldexp(1.f, -8)), 0x3F80);  // tie to even, down
  EXPECT_EQ(sa::cpu::f32_to_bf16(std::nanf("")), 0x7FC0);
}

}  // namespace

// --- thread safety and huge tensors -------------------------------------------------------------

namespace {

TEST(ThreadSafety, SixteenConcurrentCallersGetTheSerialBits) {
  const int callers = 16;
  const int64_t n = 97, k = 400, d = 130;
  std::mt19937_64 rng(31);
  std::vector<Buf> srcs, outs0;
  std::vector<Idx> idxs;
  std::vector<std::vector<float>> ws;
  for (int c = 0; c < callers; ++c) {
    const DType t = kDtypes[c % 4];
    srcs.push_back(random_buf(t, k * d, rng));
    outs0.push_back(random_buf(t, n * d, rng));
    idxs.push_back(make_idx(c % 2 ? IndexType::i32 : IndexType::i64, make_indices(Pattern::moe_topk, n, k, rng)));
    ws.emplace_back(k, 0.25f * (c + 1));
  }
  auto run = [&](int c, Buf* out, Buf* gathered) {
    sa::Options opt;
    opt.num_threads = 1 + c % 3;  // nested team sizes vary too
    const sa::WeightVector w{ws[c].data(), k, DType::f32};
    sa::index_add_rows(mat(*out, n, d, d), idxs[c].view(), cmat(srcs[c], k, d, d), w, opt);
    sa::gather_rows(mat(*gathered, k, d, d), cmat(*out, n, d, d), idxs[c].view(), w, opt);
  };
  std::vector<Buf> serial_out = outs0, serial_g;
  for (int c = 0; c < callers; ++c) {
    serial_g.emplace_back(srcs[c].dtype, static_cast<size_t>(k * d));
    run(c, &serial_out[c], &serial_g[c]);
  }
  for (int round = 0; round < 3; ++round) {
    std::vector<Buf> outs = outs0, gs;
    for (int c = 0; c < callers; ++c) gs.emplace_back(srcs[c].dtype, static_cast<size_t>(k * d));
    std::vector<std::thread> threads;
    for (int c = 0; c < callers; ++c) threads.emplace_back(run, c, &outs[c], &gs[c]);
    for (auto& t : threads) t.join();
    for (int c = 0; c < callers; ++c) {
      ASSERT_EQ(outs[c].bytes, serial_out[c].bytes) << "caller " << c;
      ASSERT_EQ(gs[c].bytes, serial_g[c].bytes) << "caller " << c;
    }
  }
}

// Offsets past 2^31 elements: a bf16 out of N*D > 2^31 (4.3 GB, allocated lazily by calloc so
// only the touched pages exist), rows written near its end, gathered back.
TEST(HugeTensors, IndicesIntoMoreThan2To31Elements) {
  const int64_t d = 32768, n = (int64_t(1) << 31) / d + 64;  // N*D = 2^31 + 2^21
  ASSERT_GT(n * d, int64_t(1) << 31);
  void* raw = std::calloc(static_cast<size_t>(n * d), 2);
  if (raw == nullptr) GTEST_FAIL() << "could not reserve " << n * d * 2 << " bytes";
  const sa::Matrix out{raw, n, d, d, DType::bf16};
  const int64_t k = 4;
  Buf src(DType::bf16, static_cast<size_t>(k * d));
  for (int64_t i = 0; i < k * d; ++i) src.set(static_cast<size_t>(i), static_cast<double>((i % 7) + 1));
  Idx idx = make_idx(IndexType::i64, {n - 1, n - 2, n - 1, 60000});
  std::vector<float> w = {1.f, 2.f, 3.f, 1.f};
  sa::index_add_rows(out, idx.view(), cmat(src, k, d, d), {w.data(), k, DType::f32});
  const uint16_t* o = static_cast<const uint16_t*>(raw);
  for (int64_t j = 0; j < d; j += 997) {
    const double s0 = src.get(j), s1 = src.get(d + j), s2 = src.get(2 * d + j), s3 = src.get(3 * d + j);
    ASSERT_EQ(sa::cpu::bf16_to_f32(o[(n - 1) * d + j]), static_cast<float>(s0 + 3 * s2)) << j;
    ASSERT_EQ(sa::cpu::bf16_to_f32(o[(n - 2) * d + j]), static_cast<float>(2 * s1)) << j;
    ASSERT_EQ(sa::cpu::bf16_to_f32(o[60000 * d + j]), static_cast<float>(s3)) << j;
  }
  Buf back(DType::bf16, static_cast<size_t>(k * d));
  sa::gather_rows(mat(back, k, d, d), out, idx.view());
  for (int64_t j = 0; j < d; j += 991) ASSERT_EQ(back.get(3 * d + j), src.get(3 * d + j));
  std::free(raw);
}

}  // namespace
