// The CUDA kernels' own code (csrc/cuda/kernels.cuh), run on the CPU: the plan's per-element steps
// (key_of, run_at, put_run, conclude) over a stable sort as CUB's leaves it, then every warp task
// and every lane of add_rows and gather_rows. Tasks share nothing (no shuffles, no shared memory),
// so running them one after another is what the GPU computes; to stand for the GPU's free order,
// the run lists (filled by atomics on the device) are shuffled and the tasks run in a random order.
// Checks, for every dtype x index type x weight x ignore_index x shape x layout, on ordinary data
// and on data whose sums are subnormal:
//   - one set of bits: index_add and gather (one call, and through a reused plan) equal the CPU
//     core's output bit for bit at every ISA level this CPU has, hot rows included; forced core
//     strategies agree too;
//   - a row's bits depend only on its own contributions (hot rows; another row gets one more);
//   - a bad index is reported at its first position with its value, and nothing is written;
// and, through the C API (no GPU needed: these errors come before any CUDA call), that bad
// arguments are refused with a clear error naming the argument, leaving the output untouched.
// `make cuda` builds and runs it (also under ASan+UBSan).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.cuh"
#include "scatter_add/scatter_add.h"
#include "scatter_add_cuda.h"

namespace sa = scatter_add;
namespace kn = scatter_add::cuda::kernels;

namespace {

int failures = 0, checks = 0;
int64_t hot_rows_checked = 0;

#define EXPECT(cond, ...)                                \
  do {                                                   \
    ++checks;                                            \
    if (!(cond)) {                                       \
      ++failures;                                        \
      if (failures <= 20) {                              \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
        std::printf(__VA_ARGS__);                        \
        std::printf("\n");                               \
      }                                                  \
    }                                                    \
  } while (0)

template <class T> constexpr sa::DType dtype_of();
template <> constexpr sa::DType dtype_of<float>() { return sa::DType::f32; }
template <> constexpr sa::DType dtype_of<double>() { return sa::DType::f64; }
template <> constexpr sa::DType dtype_of<__nv_bfloat16>() { return sa::DType::bf16; }
template <> constexpr sa::DType dtype_of<__half>() { return sa::DType::f16; }
template <class I> constexpr sa::IndexType itype_of() { return sizeof(I) == 4 ? sa::IndexType::i32 : sa::IndexType::i64; }

// The scale that puts uniform(-2, 2) data, and the sums of a few such terms, in the storage type's
// subnormal range (below 2^-126 for float32 and bfloat16, 2^-14 for float16, 2^-1022 for float64).
template <class T> double subnormal_scale() { return 0x1p-136; }
template <> double subnormal_scale<double>() { return 0x1p-1040; }
template <> double subnormal_scale<__half>() { return 0x1p-20; }

// A [rows, cols] matrix with a row stride and a leading offset (to misalign it), in raw storage.
template <class T>
struct Mat {
  std::vector<T> buf;
  int64_t rows, cols, stride, offset;
  // Exactly the bytes the view spans (the last row ends the buffer), so that AddressSanitizer
  // (make cuda runs an ASan build too) sees any read or write past it.
  Mat(int64_t r, int64_t c, int64_t s, int64_t off)
      : buf(size_t(std::max<int64_t>(off + (r > 0 ? (r - 1) * s + c : 0), 1))), rows(r), cols(c), stride(s), offset(off) {}
  T* data() { return buf.data() + offset; }
  const T* data() const { return buf.data() + offset; }
  sa::Matrix view() { return {data(), rows, cols, stride, dtype_of<T>()}; }
  bool same_bits(const Mat& o) const { return std::memcmp(buf.data(), o.buf.data(), buf.size() * sizeof(T)) == 0; }
  bool row_bits(int64_t r, const Mat& o) const {
    return std::memcmp(data() + r * stride, o.data() + r * o.stride, sizeof(T) * size_t(cols)) == 0;
  }
};

template <class T>
void fill(Mat<T>& m, std::mt19937& g, bool subnormal) {
  std::uniform_real_distribution<double> u(-2, 2);
  const double scale = subnormal ? subnormal_scale<T>() : 1.0;
  for (auto& v : m.buf) v = kn::from_acc<T, kn::acc_t<T>>(static_cast<kn::acc_t<T>>(u(g) * scale));
}

// What Plan::build leaves in device memory, built by the kernels' own per-element functions.
struct SimPlan {
  int64_t k = 0, n = 0;
  std::vector<uint32_t> keys, ids, sorted_keys;
  std::vector<kn::Run> runs;
  kn::Header h{};
  kn::Report report{};
};

template <class I>
SimPlan sim_build(const std::vector<I>& index, int64_t n, std::optional<int64_t> ignore, std::mt19937& g) {
  SimPlan p;
  p.k = static_cast<int64_t>(index.size());
  p.n = n;
  const uint32_t cap = static_cast<uint32_t>(std::max<int64_t>(1, std::min(p.k, n)));
  p.keys.assign(size_t(p.k), 0);
  unsigned long long bad = kn::kNoBad;
  for (int64_t i = 0; i < p.k; ++i) {
    bool ok;
    p.keys[size_t(i)] = kn::key_of(index.data(), i, n, ignore.has_value(), ignore.value_or(0), &ok);
    if (!ok && bad == kn::kNoBad) bad = static_cast<unsigned long long>(i);
  }
  // CUB's stable radix sort of (key, id) pairs.
  p.ids.resize(size_t(p.k));
  std::iota(p.ids.begin(), p.ids.end(), 0u);
  std::stable_sort(p.ids.begin(), p.ids.end(), [&](uint32_t a, uint32_t b) { return p.keys[a] < p.keys[b]; });
  p.sorted_keys.resize(size_t(p.k));
  for (int64_t i = 0; i < p.k; ++i) p.sorted_keys[size_t(i)] = p.keys[p.ids[size_t(i)]];
  p.runs.assign(cap, kn::Run{~0u, ~0u, ~0u, 0u});
  p.h.n_normal = p.h.n_hot = 0;
  p.h.kept = static_cast<uint32_t>(p.k);
  for (int64_t pos = 0; pos < p.k; ++pos) {
    kn::Run r{};
    const kn::RunKind kind = kn::run_at(p.sorted_keys.data(), p.k, pos, static_cast<uint32_t>(n), &r);
    if (kind == kn::RunKind::sentinel) p.h.kept = static_cast<uint32_t>(pos);
    if (kind == kn::RunKind::normal) kn::put_run(p.runs.data(), cap, kind, p.h.n_normal++, r);
    if (kind == kn::RunKind::hot) kn::put_run(p.runs.data(), cap, kind, p.h.n_hot++, r);
  }
  EXPECT(p.h.n_normal + p.h.n_hot <= cap, "runs overflow: %u + %u > %u", p.h.n_normal, p.h.n_hot, cap);
  // The device appends with atomics: any order.
  std::shuffle(p.runs.begin(), p.runs.begin() + p.h.n_normal, g);
  std::shuffle(p.runs.end() - p.h.n_hot, p.runs.end(), g);
  kn::conclude(&p.h, bad, index.data(), &p.report, false);
  return p;
}

std::vector<int64_t> shuffled(int64_t n, std::mt19937& g) {
  std::vector<int64_t> o(size_t(std::max<int64_t>(n, 0)));
  std::iota(o.begin(), o.end(), int64_t(0));
  std::shuffle(o.begin(), o.end(), g);
  return o;
}

// add_rows over a plan: every task, every lane, in a random order.
template <class T>
void sim_add(Mat<T>& out, const SimPlan& p, Mat<T>& src, const kn::acc_t<T>* w, std::mt19937& g) {
  if (p.h.bad != kn::kNoBad || p.k == 0 || out.cols == 0) return;
  const int vec = kn::vec_width<T>(out.cols, {{out.data(), out.stride}, {src.data(), src.stride}});
  kn::with_variant<T>(vec, w != nullptr, [&](auto v, auto weighted) {
    constexpr int V = decltype(v)::value;
    const kn::AddArgs<T> a{out.data(), out.stride, src.data(), src.stride, w, p.ids.data(), p.runs.data(),
                           static_cast<uint32_t>(p.runs.size()), &p.h, out.cols,
                           kn::ceil_div(out.cols, kn::kTileCols<V>), kn::ceil_div(out.cols, kn::kNarrowCols<T, V>)};
    for (const int64_t t : shuffled(kn::add_tasks(a, p.h.n_normal, p.h.n_hot), g))
      for (int lane = 0; lane < 32; ++lane) kn::add_task<T, V, decltype(weighted)::value>(a, t, lane, p.h.n_hot);
  });
}

template <class T, class I>
void sim_gather_tasks(Mat<T>& dst, Mat<T>& x, const I* index, int64_t k, bool has_ignore, int64_t ignore,
                      const kn::acc_t<T>* w, std::mt19937& g) {
  if (k == 0 || dst.cols == 0) return;
  const int vec = kn::vec_width<T>(dst.cols, {{dst.data(), dst.stride}, {x.data(), x.stride}});
  kn::with_variant<T>(vec, w != nullptr, [&](auto v, auto weighted) {
    constexpr int V = decltype(v)::value;
    const int64_t tiles = kn::ceil_div(dst.cols, kn::kTileCols<V>);
    const kn::GatherArgs<T, I> a{dst.data(), dst.stride, x.data(), x.stride, index, k, has_ignore, ignore, w,
                                 dst.cols, tiles};
    for (const int64_t t : shuffled(k * tiles, g))
      for (int lane = 0; lane < 32; ++lane) kn::gather_tile<T, I, V, decltype(weighted)::value>(a, t, lane);
  });
}

// gather without a plan: check_index, then gather_rows, whose block 0 concludes the check.
template <class T, class I>
kn::Report sim_gather(Mat<T>& dst, Mat<T>& x, const std::vector<I>& index, const kn::acc_t<T>* w,
                      std::optional<int64_t> ignore, std::mt19937& g) {
  const int64_t k = static_cast<int64_t>(index.size());
  unsigned long long bad = kn::kNoBad;
  for (int64_t i = 0; i < k; ++i) {
    bool ok;
    kn::key_of(index.data(), i, x.rows, ignore.has_value(), ignore.value_or(0), &ok);
    if (!ok && bad == kn::kNoBad) bad = static_cast<unsigned long long>(i);
  }
  kn::Report report{};
  kn::conclude<I>(nullptr, bad, index.data(), &report, false);
  if (bad == kn::kNoBad) sim_gather_tasks(dst, x, index.data(), k, ignore.has_value(), ignore.value_or(0), w, g);
  return report;
}

// gather through a plan: its keys, with n for ignored entries.
template <class T>
void sim_gather_plan(Mat<T>& dst, Mat<T>& x, const SimPlan& p, const kn::acc_t<T>* w, std::mt19937& g) {
  if (p.h.bad != kn::kNoBad) return;
  sim_gather_tasks(dst, x, p.keys.data(), p.k, true, p.n, w, g);
}

struct Shape {
  const char* name;
  int64_t n, k, d;
  int hot;  // 0: uniform over [0, n); 1: MoE top-2 (each row twice); 2: 90% to row 1;
            // 3: half to row 0, half to the last row; 4: row r gets r + 1 contributions
};

struct Layout {
  const char* name;
  int64_t pad_out, pad_src, off_out, off_src;  // extra stride and leading offset, in elements
};

template <class I>
std::vector<I> make_index(const Shape& s, std::optional<int64_t> ignore, std::mt19937& g) {
  std::vector<I> idx(size_t(s.k));
  std::uniform_int_distribution<int64_t> row(0, std::max<int64_t>(s.n - 1, 0));
  int64_t r4 = 0, left4 = 1;
  for (int64_t i = 0; i < s.k; ++i) {
    int64_t v = row(g);
    if (s.hot == 1) v = (i / 2 + (i % 2) * (s.n / 2)) % s.n;
    if (s.hot == 2 && g() % 10 != 0) v = 1 % s.n;
    if (s.hot == 3) v = g() % 2 == 0 ? 0 : s.n - 1;
    if (s.hot == 4) {
      v = r4;
      if (--left4 == 0) left4 = ++r4 + 1;
    }
    if (ignore && s.hot != 4 && g() % 7 == 0) v = *ignore;
    idx[size_t(i)] = static_cast<I>(v);
  }
  if (s.hot == 1 || s.hot == 4) std::shuffle(idx.begin(), idx.end(), g);
  return idx;
}

// The CPU core's output at the current ISA level (and with a forced strategy when given).
template <class T, class I>
Mat<T> core_add(const Mat<T>& out, const std::vector<I>& idx, Mat<T>& src, const sa::WeightVector& wv,
                std::optional<int64_t> ignore, sa::Strategy strategy = sa::Strategy::automatic) {
  Mat<T> ref = out;
  sa::Options opt;
  opt.ignore_index = ignore;
  opt.strategy = strategy;
  sa::index_add_rows(ref.view(), sa::IndexVector{idx.data(), int64_t(idx.size()), itype_of<I>()}, src.view(), wv, opt);
  return ref;
}

template <class T, class I>
void run_case(const Shape& s, const Layout& L, bool weighted, std::optional<int64_t> ignore, bool subnormal,
              bool strategies, std::mt19937& g) {
  using A = kn::acc_t<T>;
  const std::string what = std::string(sa::dtype_name(dtype_of<T>())) + (sizeof(I) == 4 ? " i32 " : " i64 ") +
                           s.name + " " + L.name + (weighted ? " weighted" : "") + (subnormal ? " subnormal" : "") +
                           (ignore ? " ignore=" + std::to_string(*ignore) : "");
  const char* w_ = what.c_str();
  const std::vector<I> idx = make_index<I>(s, ignore, g);
  std::vector<A> w(size_t(s.k));
  std::uniform_real_distribution<double> u(-1.5, 1.5);
  for (auto& v : w) v = static_cast<A>(u(g));
  const A* wp = weighted ? w.data() : nullptr;
  const sa::WeightVector wv =
      weighted ? sa::WeightVector{w.data(), s.k, sizeof(A) == 8 ? sa::DType::f64 : sa::DType::f32} : sa::WeightVector{};
  sa::Options opt;
  opt.ignore_index = ignore;
  const sa::IndexVector iv{idx.data(), s.k, itype_of<I>()};

  // index_add, one call: plan + rows, against the core (every row, hot ones included).
  Mat<T> out(s.n, s.d, s.d + L.pad_out, L.off_out), src(s.k, s.d, s.d + L.pad_src, L.off_src);
  fill(out, g, subnormal);
  fill(src, g, subnormal);
  const Mat<T> out0 = out;
  const Mat<T> ref = core_add(out0, idx, src, wv, ignore);
  const SimPlan plan = sim_build(idx, s.n, ignore, g);
  EXPECT(plan.h.bad == kn::kNoBad && plan.report.done == 1 && plan.report.bad == kn::kNoBad,
         "%s: plan reported bad index %llu", w_, plan.h.bad);
  sim_add(out, plan, src, wp, g);
  for (int64_t r = 0; r < s.n; ++r)
    EXPECT(out.row_bits(r, ref), "%s: index_add row %lld differs from the CPU core", w_, (long long)r);
  hot_rows_checked += plan.h.n_hot;
  if (strategies)
    for (const sa::Strategy st : {sa::Strategy::direct, sa::Strategy::count, sa::Strategy::radix})
      EXPECT(out.same_bits(core_add(out0, idx, src, wv, ignore, st)), "%s: differs from the core's %s strategy", w_,
             sa::strategy_name(st));

  // The same plan reused for a second call with other data (as forward and backward share one).
  {
    Mat<T> out2 = out0, src2 = src;
    fill(src2, g, subnormal);
    const Mat<T> ref2 = core_add(out0, idx, src2, wv, ignore);
    sim_add(out2, plan, src2, wp, g);
    EXPECT(out2.same_bits(ref2), "%s: index_add through a reused plan differs from the CPU core", w_);
  }

  // gather, one call and through the plan.
  Mat<T> dst(s.k, s.d, s.d + L.pad_src, L.off_src), x(s.n, s.d, s.d + L.pad_out, L.off_out);
  fill(dst, g, subnormal);
  fill(x, g, subnormal);
  Mat<T> gref = dst;
  sa::gather_rows(gref.view(), x.view(), iv, wv, opt);
  {
    Mat<T> d1 = dst, d2 = dst;
    const kn::Report rep = sim_gather(d1, x, idx, wp, ignore, g);
    EXPECT(rep.done == 1 && rep.bad == kn::kNoBad, "%s: gather reported bad index %llu", w_, rep.bad);
    EXPECT(d1.same_bits(gref), "%s: gather differs from the CPU core", w_);
    sim_gather_plan(d2, x, plan, wp, g);
    EXPECT(d2.same_bits(gref), "%s: gather through the plan differs from the CPU core", w_);
  }

  // Bad values (-1, or n + 5 when -1 is ignore_index, then n at the end): the first one is
  // reported with its value, and nothing is written, by either op, with or without the plan.
  for (const int64_t p0 : {int64_t(0), s.k / 2}) {
    if (s.k < 2 || s.n < 1) break;
    std::vector<I> badidx = idx;
    const int64_t p1 = s.k - 1;
    const int64_t v0 = ignore == -1 ? s.n + 5 : -1;
    badidx[size_t(p1)] = static_cast<I>(s.n);
    badidx[size_t(p0)] = static_cast<I>(v0);
    const SimPlan bp = sim_build(badidx, s.n, ignore, g);
    EXPECT(bp.h.bad == static_cast<unsigned long long>(p0) && bp.h.bad_value == v0 && bp.report.done == 1 &&
               bp.report.bad == bp.h.bad && bp.report.value == v0,
           "%s: bad index %lld = %lld not reported (got %llu = %lld)", w_, (long long)p0, (long long)v0, bp.report.bad,
           bp.report.value);
    Mat<T> before = out;
    sim_add(out, bp, src, wp, g);
    EXPECT(out.same_bits(before), "%s: index_add wrote despite a bad index", w_);
    Mat<T> dbefore = dst;
    const kn::Report rep = sim_gather(dst, x, badidx, wp, ignore, g);
    EXPECT(rep.bad == static_cast<unsigned long long>(p0) && rep.value == v0, "%s: gather bad index not reported", w_);
    EXPECT(dst.same_bits(dbefore), "%s: gather wrote despite a bad index", w_);
    sim_gather_plan(dst, x, bp, wp, g);
    EXPECT(dst.same_bits(dbefore), "%s: gather through a bad plan wrote", w_);
  }
}

// A row's bits depend only on its own contributions: one more contribution to another row (a
// new source 0, which shifts every sorted position of the hot row by one) leaves the hot row's
// bits as they were.
template <class T>
void run_independence(std::mt19937& g) {
  using A = kn::acc_t<T>;
  for (const int64_t k : {int64_t(700), int64_t(5000)}) {
    for (const int64_t d : {int64_t(8), int64_t(136)}) {
      const int64_t n = 6, hot = 3;
      std::vector<int32_t> idx(static_cast<size_t>(k));
      for (auto& v : idx) v = g() % 4 != 0 ? int32_t(hot) : int32_t(g() % n);
      Mat<T> out(n, d, d, 0), src(k, d, d, 0);
      fill(out, g, false);
      fill(src, g, false);
      std::vector<A> w(static_cast<size_t>(k));
      for (auto& v : w) v = static_cast<A>(std::uniform_real_distribution<double>(-1, 1)(g));
      for (const int32_t other : {int32_t(hot - 1), int32_t(hot + 1)}) {
        std::vector<int32_t> idx2 = idx;
        idx2.insert(idx2.begin(), other);
        Mat<T> src2(k + 1, d, d, 0);
        fill(src2, g, false);
        std::memcpy(src2.data() + d, src.data(), sizeof(T) * size_t(k * d));
        std::vector<A> w2 = w;
        w2.insert(w2.begin(), A(0.5));
        Mat<T> o1 = out, o2 = out;
        sim_add(o1, sim_build(idx, n, std::nullopt, g), src, w.data(), g);
        sim_add(o2, sim_build(idx2, n, std::nullopt, g), src2, w2.data(), g);
        EXPECT(o1.row_bits(hot, o2), "%s K=%lld D=%lld: the hot row changed when row %d got one more contribution",
               sa::dtype_name(dtype_of<T>()), (long long)k, (long long)d, other);
        EXPECT(!o1.row_bits(other, o2), "%s: row %d did not change (the test would prove nothing)",
               sa::dtype_name(dtype_of<T>()), other);
      }
    }
  }
}

// How much of the matrix runs: everything (at one ISA level), the contiguous layout on both kinds
// of data (at the other levels), or a memory-error sweep (the ASan build: every shape and code
// path, misaligned and padded layouts, ordinary data).
enum class Scope { full, level, quick };

template <class T, class I>
void run_all(std::mt19937& g, Scope scope) {
  const Shape shapes[] = {
      {"N=1,K=1,D=1", 1, 1, 1, 0},
      {"uniform D=3", 7, 20, 3, 0},
      {"moe D=64", 16, 32, 64, 1},
      {"moe D=520 (partial tile)", 24, 48, 520, 1},
      {"uniform D=1000", 40, 90, 1000, 0},
      {"hot row D=136", 5, 300, 136, 2},
      {"hot row K=900 D=40", 4, 900, 40, 2},
      {"two hot rows D=24", 3, 600, 24, 3},
      {"run lengths 1..81 D=8", 81, 81 * 82 / 2, 8, 4},
      {"K=5000 D=4", 300, 5000, 4, 0},
      {"K=0", 33, 0, 16, 0},
      {"D=0", 9, 12, 0, 0},
      {"K>>N D=8", 3, 200, 8, 0},
      {"N>>K D=8", 5000, 20, 8, 0},
  };
  const Layout layouts[] = {
      {"contiguous", 0, 0, 0, 0},
      {"padded rows", 8, 16, 0, 0},
      {"src stride +1", 0, 1, 0, 0},
      {"out offset +1", 0, 0, 1, 0},
  };
  for (const auto& s : shapes)
    for (const auto& L : layouts) {
      const int li = static_cast<int>(&L - layouts);
      if (scope == Scope::level && li != 0) continue;
      if (scope == Scope::quick && li != 1 && li != 2) continue;
      for (bool weighted : {false, true})
        for (std::optional<int64_t> ignore : {std::optional<int64_t>{}, std::optional<int64_t>{-1}, std::optional<int64_t>{2}}) {
          if (scope != Scope::full && ignore == 2) continue;
          for (bool subnormal : {false, true}) {
            if (subnormal && (scope == Scope::quick || li == 1 || li == 3)) continue;
            run_case<T, I>(s, L, weighted, ignore, subnormal, scope == Scope::full && li == 0 && !subnormal, g);
          }
        }
    }
}

template <class T>
void run_dtype(std::mt19937& g, Scope scope) {
  run_all<T, int32_t>(g, scope);
  run_all<T, int64_t>(g, scope);
  if (scope == Scope::full) run_independence<T>(g);
}

// ---- the C API's argument checks (they all come before the first CUDA call) ------------------
template <class F>
void expect_error(const char* what, const std::string& fragment, F&& f) {
  try {
    f();
    EXPECT(false, "%s: no error (expected '%s')", what, fragment.c_str());
  } catch (const sa::Error& e) {
    EXPECT(e.kind() == sa::Error::Kind::value && std::string(e.what()).find(fragment) != std::string::npos,
           "%s: got '%s', expected '%s'", what, e.what(), fragment.c_str());
  } catch (const std::exception& e) {
    EXPECT(false, "%s: got '%s' (not scatter_add::Error), expected '%s'", what, e.what(), fragment.c_str());
  }
}

void run_api_checks() {
  namespace sc = scatter_add::cuda;
  std::vector<float> out_buf(64, 1.5f), src_buf(64, 2.0f), w(8, 1.0f);
  const std::vector<float> out0 = out_buf;
  std::vector<int32_t> idx = {0, 1, 2, 3};
  alignas(256) static unsigned char ws[4096];
  const sa::IndexVector iv{idx.data(), 4, sa::IndexType::i32};
  const sa::ConstMatrix src{src_buf.data(), 4, 8, 8, sa::DType::f32};
  const sa::Matrix out{out_buf.data(), 4, 8, 8, sa::DType::f32};
  const sa::Matrix expanded{out_buf.data(), 4, 8, 0, sa::DType::f32};  // torch's expand(4, 8)
  const sa::Matrix rows_alias{out_buf.data(), 4, 8, 4, sa::DType::f32};
  cudaStream_t s = nullptr;

  expect_error("expanded out", "index_add_rows: out row stride 0 is smaller than its row length 8 (rows would alias)",
               [&] { sc::index_add_rows(expanded, iv, src, {}, std::nullopt, ws, sizeof(ws), s); });
  expect_error("overlapping rows", "out row stride 4 is smaller than its row length 8",
               [&] { sc::index_add_rows(rows_alias, iv, src, {}, std::nullopt, ws, sizeof(ws), s); });
  expect_error("expanded dst", "gather_rows: dst row stride 0 is smaller than its row length 8 (rows would alias)",
               [&] { sc::gather_rows(expanded, src, iv, {}, std::nullopt, ws, sizeof(ws), s); });
  expect_error("src overlaps out", "src memory overlaps out",
               [&] { sc::index_add_rows(out, iv, sa::ConstMatrix{out_buf.data() + 8, 4, 8, 8, sa::DType::f32}, {},
                                        std::nullopt, ws, sizeof(ws), s); });
  expect_error("weight dtype", "weight must be float32 with 4 entries, got float64",
               [&] { sc::index_add_rows(out, iv, src, {w.data(), 4, sa::DType::f64}, std::nullopt, ws, sizeof(ws), s); });
  expect_error("weight length", "weight has 3 entries but index has 4",
               [&] { sc::index_add_rows(out, iv, src, {w.data(), 3, sa::DType::f32}, std::nullopt, ws, sizeof(ws), s); });
  expect_error("null workspace", "workspace is null",
               [&] { sc::index_add_rows(out, iv, src, {}, std::nullopt, nullptr, 0, s); });
  expect_error("misaligned workspace", "-byte aligned",
               [&] { sc::index_add_rows(out, iv, src, {}, std::nullopt, ws + 8, sizeof(ws) - 8, s); });
  expect_error("misaligned gather workspace", "workspace at",
               [&] { sc::gather_rows(out, src, iv, {}, std::nullopt, ws + 4, sizeof(ws) - 4, s); });
  expect_error("small gather workspace", "workspace of 16 bytes is smaller than",
               [&] { sc::gather_rows(out, src, iv, {}, std::nullopt, ws, 16, s); });
  expect_error("workspace overlaps out", "workspace memory overlaps out",
               [&] { sc::index_add_rows(out, iv, src, {}, std::nullopt, out_buf.data(), 256, s); });
  expect_error("K >= 2^31 sizing", "fewer than 2^31 rows and indices, got N=10 K=2147483648",
               [&] { sc::workspace_bytes(int64_t(1) << 31, 10); });
  expect_error("K >= 2^31 plan sizing", "got N=10 K=2147483648", [&] { sc::Plan::bytes(int64_t(1) << 31, 10); });
  expect_error("N >= 2^31 sizing", "got N=2147483648 K=4", [&] { sc::workspace_bytes(4, int64_t(1) << 31); });
  expect_error("K >= 2^31 call", "got N=4 K=2147483648", [&] {
    // A [2^31, 8] src view that is never read: the limit is checked before anything is sized.
    const sa::ConstMatrix big{src_buf.data(), int64_t(1) << 31, 8, 0, sa::DType::f32};
    sc::index_add_rows(out, sa::IndexVector{idx.data(), int64_t(1) << 31, sa::IndexType::i32}, big, {}, std::nullopt,
                       ws, sizeof(ws), s);
  });
  expect_error("empty plan", "plan is empty", [&] { sc::index_add_rows(out, sc::Plan{}, src, {}, s); });
  expect_error("misaligned plan memory", "memory at",
               [&] { sc::Plan::build(iv, 4, std::nullopt, ws + 8, sizeof(ws) - 8, s); });
  expect_error("index type", "index must be int32 or int64",
               [&] { sc::Plan::build({idx.data(), 4, static_cast<sa::IndexType>(7)}, 4, std::nullopt, ws, sizeof(ws), s); });
  EXPECT(out_buf == out0, "the output changed after argument errors");

  // Valid arguments pass the checks: the call gets as far as CUDA (no GPU here: a CUDA error; on
  // a GPU machine these host buffers are refused as memory the GPU cannot read).
  try {
    sc::index_add_rows(out, iv, src, {}, std::nullopt, ws, sizeof(ws), s);
    EXPECT(false, "a call with host buffers succeeded");
  } catch (const sa::Error& e) {
    EXPECT(std::string(e.what()).find("host memory the GPU cannot read") != std::string::npos,
           "valid arguments refused: %s", e.what());
  } catch (const std::runtime_error& e) {
    EXPECT(std::string(e.what()).find("scatter_add CUDA:") == 0, "unexpected error: %s", e.what());
  }
  EXPECT(out_buf == out0, "the output changed");
}

}  // namespace

int main(int argc, char** argv) {
  // --quick (the ASan build): one ISA level and the memory-error sweep. Otherwise the whole matrix
  // at the best level, and every other level this CPU has as a reference in turn: the core gives
  // one set of bits at all of them (fma at the scalar level too), and so must the CUDA kernels.
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const sa::Isa best = sa::supported_isa();
  int levels = 0;
  for (const sa::Isa isa : {best, sa::Isa::scalar, sa::Isa::avx2, sa::Isa::avx512, sa::Isa::avx512_bf16}) {
    if ((levels > 0 && (quick || isa == best)) || sa::set_isa(isa) != isa) continue;
    const Scope scope = quick ? Scope::quick : isa == best ? Scope::full : Scope::level;
    std::mt19937 g(12345);
    const int before = failures;
    run_dtype<float>(g, scope);
    run_dtype<double>(g, scope);
    run_dtype<__nv_bfloat16>(g, scope);
    run_dtype<__half>(g, scope);
    std::printf("host_sim: CPU core at %s (%s): %d failures\n", sa::isa_name(isa),
                scope == Scope::full ? "every case" : scope == Scope::level ? "contiguous layout" : "quick sweep",
                failures - before);
    ++levels;
  }
  run_api_checks();
  std::printf("host_sim: %d checks, %d failures (%lld hot rows of more than %u contributions)\n", checks, failures,
              (long long)hot_rows_checked, kn::kHotRun);
  return failures == 0 && levels > 0 ? 0 : 1;
}
