// libFuzzer target over the C++ core: random N, K, D, row strides, dtype, index type, weight,
// ignore_index, index values (in and out of range), overlapping buffers, threads, ISA level and
// strategy. Every call is checked against a float64 reference or against the error it must raise,
// with `out` bit-for-bit unchanged after an error; a successful call is repeated at the scalar
// level with another strategy on one thread and must give the same bits; gather (the same
// strategy) is checked exactly, and refuses a bad index with its dst unchanged. Any mismatch
// aborts.
//   make fuzz FUZZ_SECONDS=60        (corpus kept in tests/fuzz/corpus)
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "convert.h"
#include "scatter_add/scatter_add.h"

namespace sa = scatter_add;

namespace {

struct Reader {
  const uint8_t* p;
  size_t n;
  uint8_t byte() {
    if (n == 0) return 0;
    --n;
    return *p++;
  }
  int range(int lo, int hi) { return lo + byte() % (hi - lo + 1); }
};

double get(sa::DType t, const void* base, int64_t i) {
  switch (t) {
    case sa::DType::f32: return static_cast<const float*>(base)[i];
    case sa::DType::f64: return static_cast<const double*>(base)[i];
    case sa::DType::bf16: return sa::cpu::bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case sa::DType::f16: return sa::cpu::f16_to_f32(static_cast<const uint16_t*>(base)[i]);
  }
  return 0;
}

void set(sa::DType t, void* base, int64_t i, double v) {
  switch (t) {
    case sa::DType::f32: static_cast<float*>(base)[i] = static_cast<float>(v); break;
    case sa::DType::f64: static_cast<double*>(base)[i] = v; break;
    case sa::DType::bf16: static_cast<uint16_t*>(base)[i] = sa::cpu::f32_to_bf16(static_cast<float>(v)); break;
    case sa::DType::f16: static_cast<uint16_t*>(base)[i] = sa::cpu::f32_to_f16(static_cast<float>(v)); break;
  }
}

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "fuzz check failed: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader r{data, size};
  const auto dt = static_cast<sa::DType>(r.range(0, 3));
  const auto it = r.range(0, 1) ? sa::IndexType::i64 : sa::IndexType::i32;
  const int64_t n = r.range(1, 40), k = r.range(0, 60), d = r.range(0, 70);
  const int64_t os = d + r.range(0, 3), ss = d + r.range(0, 3);
  const bool weighted = r.byte() & 1, has_ignore = r.byte() & 1;
  const int64_t ignore = static_cast<int8_t>(r.byte()) % 50;
  const int overlap = r.range(0, 7);  // 0: src overlaps out; 1: index overlaps out; else none
  const int threads = r.range(1, 4);
  const sa::Isa isa = static_cast<sa::Isa>(r.range(0, 3));
  sa::set_isa(isa);
  const int strategy = r.range(1, 3);  // direct, count, radix
  const size_t es = sa::dtype_size(dt);

  // One arena so overlap can be produced on purpose: [out | src | index].
  const size_t out_elems = static_cast<size_t>(n * os), src_elems = static_cast<size_t>(k * ss);
  std::vector<unsigned char> arena((out_elems + src_elems) * es + static_cast<size_t>(k) * 8 + 64);
  void* out = arena.data();
  void* src = arena.data() + out_elems * es;
  for (size_t i = 0; i < out_elems; ++i) set(dt, out, static_cast<int64_t>(i), (static_cast<int8_t>(r.byte())) / 16.0);
  for (size_t i = 0; i < src_elems; ++i) set(dt, src, static_cast<int64_t>(i), (static_cast<int8_t>(r.byte())) / 16.0);
  std::vector<int64_t> iv(static_cast<size_t>(k));
  bool bad_index = false;
  for (int64_t i = 0; i < k; ++i) {
    const int8_t b = static_cast<int8_t>(r.byte());
    iv[i] = (b % 8 == 7) ? b : (static_cast<uint8_t>(b) % n);  // mostly valid, sometimes not
    if (!(has_ignore && iv[i] == ignore) && (iv[i] < 0 || iv[i] >= n)) bad_index = true;
  }
  std::vector<int32_t> i32(iv.begin(), iv.end());
  const void* index_data = it == sa::IndexType::i32 ? static_cast<const void*>(i32.data()) : iv.data();
  std::vector<float> w(static_cast<size_t>(k));
  for (auto& x : w) x = static_cast<int8_t>(r.byte()) / 32.0f;

  sa::Matrix om{out, n, d, os, dt};
  sa::ConstMatrix sm{src, k, d, ss, dt};
  bool expect_overlap = false;
  if (overlap == 0 && k > 0 && d > 0) {
    sm.data = out;  // src rows read out's first row
    sm.row_stride = 0;
    expect_overlap = true;
  }
  std::vector<unsigned char> index_copy;
  if (overlap == 1 && k > 0 && d > 0 && out_elems * es >= static_cast<size_t>(k) * (it == sa::IndexType::i32 ? 4 : 8)) {
    // the index placed inside out's bytes
    const size_t ib = static_cast<size_t>(k) * (it == sa::IndexType::i32 ? 4 : 8);
    std::memcpy(out, index_data, ib);
    index_data = out;
    expect_overlap = true;
  }
  const sa::IndexVector idx{index_data, k, it};
  const sa::WeightVector wv{weighted ? w.data() : nullptr, k, sa::DType::f32};
  sa::Options opt;
  opt.num_threads = threads;
  opt.strategy = static_cast<sa::Strategy>(strategy);
  if (has_ignore) opt.ignore_index = ignore;

  // Reference from the inputs as they are now.
  std::vector<double> ref(out_elems), mag(out_elems);
  std::vector<int> cnt(static_cast<size_t>(n), 0);
  for (size_t i = 0; i < out_elems; ++i) {
    ref[i] = get(dt, out, static_cast<int64_t>(i));
    mag[i] = std::fabs(ref[i]);
  }
  const std::vector<unsigned char> before(arena.begin(), arena.begin() + static_cast<long>(out_elems * es));
  const bool expect_error = (k > 0 && (expect_overlap || bad_index)) || (k > 0 && d == 0 && bad_index);
  if (!expect_error) {
    for (int64_t i = 0; i < k; ++i) {
      if (has_ignore && iv[i] == ignore) continue;
      ++cnt[iv[i]];
      for (int64_t j = 0; j < d; ++j) {
        const double t = (weighted ? w[i] : 1.0) * get(dt, sm.data, i * sm.row_stride + j);
        ref[iv[i] * os + j] += t;
        mag[iv[i] * os + j] += std::fabs(t);
      }
    }
  }
  try {
    sa::index_add_rows(om, idx, sm, wv, opt);
    if (expect_error) die("no error for bad input");
  } catch (const sa::Error& e) {
    if (!expect_error) die(e.what());
    if (!before.empty() && std::memcmp(before.data(), out, before.size()) != 0) die("out changed after an error");
    if (bad_index && !expect_overlap && d > 0) {  // gather from out by the same index: refused too
      std::vector<unsigned char> g(static_cast<size_t>(k * d) * es, 0x5A);
      const std::vector<unsigned char> g0(g);
      try {
        sa::gather_rows({g.data(), k, d, d, dt}, {out, n, d, os, dt}, idx, {}, opt);
        die("gather_rows: no error for a bad index");
      } catch (const sa::Error&) {
        if (g != g0) die("gather_rows: dst changed after an error");
      }
    }
    return 0;
  }
  // The same bits at the scalar level, with another strategy, on one thread.
  {
    std::vector<unsigned char> again(before);
    sa::Options o1 = opt;
    o1.num_threads = 1;
    o1.strategy = static_cast<sa::Strategy>(strategy % 3 + 1);
    sa::set_isa(sa::Isa::scalar);
    sa::index_add_rows({again.data(), n, d, os, dt}, idx, sm, wv, o1);
    sa::set_isa(isa);
    for (size_t e = 0; e < out_elems; ++e) {
      const bool same = std::memcmp(again.data() + e * es, static_cast<unsigned char*>(out) + e * es, es) == 0;
      if (!same && !(std::isnan(get(dt, again.data(), static_cast<int64_t>(e))) &&
                     std::isnan(get(dt, out, static_cast<int64_t>(e)))))
        die("bits differ between strategies / ISA levels / thread counts");
    }
  }
  const double eps = dt == sa::DType::bf16 ? 1.0 / 256 : dt == sa::DType::f16 ? 1.0 / 2048 : dt == sa::DType::f32 ? 1e-7 : 1e-16;
  const double acc = dt == sa::DType::f64 ? 1.2e-16 : 6e-8;
  for (int64_t row = 0; row < n; ++row)
    for (int64_t j = 0; j < os; ++j) {
      const size_t e = static_cast<size_t>(row * os + j);
      const double got = get(dt, out, static_cast<int64_t>(e));
      if (j >= d) {  // padding between rows is never written
        if (std::memcmp(before.data() + e * es, static_cast<unsigned char*>(out) + e * es, es) != 0) die("padding written");
        continue;
      }
      if (std::isnan(ref[e]) && std::isnan(got)) continue;
      const double tol = eps * std::fabs(ref[e]) + 2 * (cnt[row] + 1) * acc * mag[e] + 1e-300;
      if (!(std::fabs(got - ref[e]) <= tol)) die("index_add_rows differs from the float64 reference");
    }
  // gather back what was just written: exact copies
  if (k > 0 && d > 0) {
    std::vector<unsigned char> g(static_cast<size_t>(k * d) * es);
    sa::gather_rows({g.data(), k, d, d, dt}, {out, n, d, os, dt}, idx, {}, opt);
    for (int64_t i = 0; i < k; ++i)
      for (int64_t j = 0; j < d; ++j) {
        const bool ign = has_ignore && iv[i] == ignore;
        const double want = ign ? 0.0 : get(dt, out, iv[i] * os + j);
        const double got = get(dt, g.data(), i * d + j);
        if (!(got == want || (std::isnan(got) && std::isnan(want)))) die("gather_rows differs");
      }
  }
  return 0;
}
