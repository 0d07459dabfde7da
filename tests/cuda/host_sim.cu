// The CUDA kernels' own code (csrc/cuda/kernels.cuh), run on the CPU: every warp task and every
// lane of check_index, add_rows and gather_rows, one after another, over a plan built on the host
// as the launcher's CUB call builds it (a stable sort of (key, id) pairs). The tasks share
// nothing (no shuffles, no shared memory), so running them in sequence is what the GPU computes.
// Checks, for every dtype x index type x weight x ignore_index x shape x layout:
//   - the result equals the CPU core's bit for bit (the core at an FMA level: same roundings);
//   - a bad index is reported at its first position and nothing is written.
// Needs no GPU: `make cuda` builds and runs it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kernels.cuh"
#include "scatter_add/scatter_add.h"

namespace sa = scatter_add;
namespace kn = scatter_add::cuda::kernels;

namespace {

int failures = 0, checks = 0;
bool fma_reference = true;  // the CPU core has an FMA level to compare weighted index_add with
int64_t long_rows_checked = 0;

template <class T> double as_double(T v) { return double(kn::to_acc<T, kn::acc_t<T>>(v)); }
// Unit roundoff of the accumulator, and of the stored type (relative).
template <class T> constexpr double kEpsAcc = sizeof(kn::acc_t<T>) == 8 ? 0x1p-53 : 0x1p-24;
template <class T> constexpr double kUlp = 0x1p-24;
template <> constexpr double kUlp<double> = 0x1p-53;
template <> constexpr double kUlp<__nv_bfloat16> = 0x1p-8;
template <> constexpr double kUlp<__half> = 0x1p-11;

#define EXPECT(cond, ...)                       \
  do {                                          \
    ++checks;                                   \
    if (!(cond)) {                              \
      ++failures;                               \
      if (failures <= 20) {                     \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
        std::printf(__VA_ARGS__);               \
        std::printf("\n");                      \
      }                                         \
    }                                           \
  } while (0)

template <class T> constexpr sa::DType dtype_of();
template <> constexpr sa::DType dtype_of<float>() { return sa::DType::f32; }
template <> constexpr sa::DType dtype_of<double>() { return sa::DType::f64; }
template <> constexpr sa::DType dtype_of<__nv_bfloat16>() { return sa::DType::bf16; }
template <> constexpr sa::DType dtype_of<__half>() { return sa::DType::f16; }
template <class I> constexpr sa::IndexType itype_of() { return sizeof(I) == 4 ? sa::IndexType::i32 : sa::IndexType::i64; }

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
};

template <class T>
void fill(Mat<T>& m, std::mt19937& g) {
  std::uniform_real_distribution<double> u(-2, 2);
  for (auto& v : m.buf) v = kn::from_acc<T, kn::acc_t<T>>(static_cast<kn::acc_t<T>>(u(g)));
}

struct Plan {  // the device workspace's arrays, K entries each
  std::vector<uint32_t> keys, ids, keys_out, ids_out;
};

// What cub::DeviceRadixSort::SortPairs (stable) leaves in the workspace.
void build_plan(Plan& p, int64_t k) {
  std::vector<uint32_t> order(k);
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return p.keys[a] < p.keys[b]; });
  p.keys_out.assign(k, 0);
  p.ids_out.assign(k, 0);
  for (int64_t i = 0; i < k; ++i) {
    p.keys_out[i] = p.keys[order[i]];
    p.ids_out[i] = p.ids[order[i]];
  }
}

template <class T, class I>
unsigned long long sim_index_add(Mat<T>& out, const std::vector<I>& index, Mat<T>& src, const kn::acc_t<T>* w,
                                 std::optional<int64_t> ignore) {
  const int64_t k = static_cast<int64_t>(index.size()), n = out.rows;
  unsigned long long bad = kn::kNoBad;
  Plan p;
  p.keys.assign(k, 0);
  p.ids.assign(k, 0);
  const kn::KeyArgs<I> ka{index.data(), k, n, ignore.has_value(), ignore.value_or(0), p.keys.data(), p.ids.data(), &bad};
  for (int64_t i = 0; i < k; ++i) kn::check_one(ka, i);
  if (k == 0 || out.cols == 0) return bad;
  build_plan(p, k);
  const int vec = kn::vec_width<T>(out.cols, {{out.data(), out.stride}, {src.data(), src.stride}});
  kn::with_variant<T>(vec, w != nullptr, [&](auto v, auto weighted) {
    constexpr int V = decltype(v)::value;
    const int64_t tiles = kn::tiles<V>(out.cols);
    // The long runs' scratch, sized to the element (ASan sees any access past it).
    const int64_t blocks = (k + kn::kSegment - 1) / kn::kSegment;
    std::vector<kn::acc_t<T>> tail(size_t(blocks * out.cols)), head(size_t(blocks * out.cols));
    std::vector<uint32_t> long_start(size_t(blocks), ~0u);
    const kn::AddArgs<T> a{out.data(), out.stride, src.data(), src.stride, w, p.keys_out.data(), p.ids_out.data(), k,
                           static_cast<uint32_t>(n), out.cols, tiles, &bad, tail.data(), head.data(),
                           long_start.data()};
    for (int64_t t = 0; t < k * tiles; ++t)
      for (int lane = 0; lane < 32; ++lane) kn::add_tile<T, V, decltype(weighted)::value>(a, t, lane);
    if (k > kn::kSegment)  // the launcher's second kernel
      for (int64_t t = 0; t < blocks * tiles; ++t)
        for (int lane = 0; lane < 32; ++lane) kn::finish_tile<T, V>(a, t, lane);
  });
  return bad;
}

template <class T, class I>
unsigned long long sim_gather(Mat<T>& dst, Mat<T>& x, const std::vector<I>& index, const kn::acc_t<T>* w,
                              std::optional<int64_t> ignore) {
  const int64_t k = static_cast<int64_t>(index.size());
  unsigned long long bad = kn::kNoBad;
  const kn::KeyArgs<I> ka{index.data(), k, x.rows, ignore.has_value(), ignore.value_or(0), nullptr, nullptr, &bad};
  for (int64_t i = 0; i < k; ++i) kn::check_one(ka, i);
  if (k == 0 || dst.cols == 0) return bad;
  const int vec = kn::vec_width<T>(dst.cols, {{dst.data(), dst.stride}, {x.data(), x.stride}});
  kn::with_variant<T>(vec, w != nullptr, [&](auto v, auto weighted) {
    constexpr int V = decltype(v)::value;
    const int64_t tiles = kn::tiles<V>(dst.cols);
    const kn::GatherArgs<T, I> a{dst.data(), dst.stride, x.data(), x.stride, index.data(), k, ignore.has_value(),
                                 ignore.value_or(0), w, dst.cols, tiles, &bad};
    for (int64_t t = 0; t < k * tiles; ++t)
      for (int lane = 0; lane < 32; ++lane) kn::gather_tile<T, I, V, decltype(weighted)::value>(a, t, lane);
  });
  return bad;
}

struct Shape {
  const char* name;
  int64_t n, k, d;
  int hot;  // 0: uniform over [0, n); 1: MoE top-2 (each row twice); 2: 90% to row 1;
            // 3: half to row 0, half to the last row
};

struct Layout {
  const char* name;
  int64_t pad_out, pad_src, off_out, off_src;  // extra stride and leading offset, in elements
};

template <class I>
std::vector<I> make_index(const Shape& s, std::optional<int64_t> ignore, std::mt19937& g) {
  std::vector<I> idx(s.k);
  std::uniform_int_distribution<int64_t> row(0, std::max<int64_t>(s.n - 1, 0));
  for (int64_t i = 0; i < s.k; ++i) {
    int64_t v = row(g);
    if (s.hot == 1) v = (i / 2 + (i % 2) * (s.n / 2)) % s.n;
    if (s.hot == 2 && g() % 10 != 0) v = 1 % s.n;
    if (s.hot == 3) v = g() % 2 == 0 ? 0 : s.n - 1;
    if (ignore && g() % 7 == 0) v = *ignore;
    idx[i] = static_cast<I>(v);
  }
  if (s.hot == 1) std::shuffle(idx.begin(), idx.end(), g);
  return idx;
}

template <class T, class I>
void run_case(const Shape& s, const Layout& L, bool weighted, std::optional<int64_t> ignore, std::mt19937& g) {
  using A = kn::acc_t<T>;
  const std::string what = std::string(sa::dtype_name(dtype_of<T>())) + (sizeof(I) == 4 ? " i32 " : " i64 ") +
                           s.name + " " + L.name + (weighted ? " weighted" : "") +
                           (ignore ? " ignore=" + std::to_string(*ignore) : "");
  const std::vector<I> idx = make_index<I>(s, ignore, g);
  std::vector<A> w(s.k);
  std::uniform_real_distribution<double> u(-1.5, 1.5);
  for (auto& v : w) v = static_cast<A>(u(g));
  const A* wp = weighted ? w.data() : nullptr;
  const sa::WeightVector wv = weighted ? sa::WeightVector{w.data(), s.k, sizeof(A) == 8 ? sa::DType::f64 : sa::DType::f32}
                                       : sa::WeightVector{};
  sa::Options opt;
  opt.ignore_index = ignore;
  const sa::IndexVector iv{idx.data(), s.k, itype_of<I>()};

  // index_add
  Mat<T> out(s.n, s.d, s.d + L.pad_out, L.off_out), src(s.k, s.d, s.d + L.pad_src, L.off_src);
  fill(out, g);
  fill(src, g);
  const Mat<T> out0 = out;
  Mat<T> ref = out;
  sa::index_add_rows(ref.view(), iv, src.view(), wv, opt);
  const unsigned long long bad = sim_index_add(out, idx, src, wp, ignore);
  EXPECT(bad == kn::kNoBad, "%s: index_add reported bad index %llu", what.c_str(), bad);
  // Rows of at most kSegment contributions: the CPU core's bits. Longer rows are summed in
  // pieces: within the float64 reference's rounding bound.
  std::vector<int64_t> count(size_t(s.n), 0);
  for (const I v : idx)
    if (!(ignore && v == *ignore)) ++count[size_t(v)];
  for (int64_t r = 0; r < s.n; ++r) {
    const T* o = out.data() + r * out.stride;
    const T* c = ref.data() + r * ref.stride;
    if (count[r] <= kn::kSegment) {
      if (!weighted || fma_reference)
        EXPECT(std::memcmp(o, c, sizeof(T) * s.d) == 0, "%s: index_add row %lld differs from the CPU core",
               what.c_str(), (long long)r);
      continue;
    }
    for (int64_t col = 0; col < s.d; ++col) {
      double exact = as_double(out0.data()[r * out0.stride + col]), mag = std::fabs(exact);
      for (int64_t i = 0; i < s.k; ++i) {
        if (int64_t(idx[i]) != r) continue;
        const double t = (weighted ? double(w[i]) : 1.0) * as_double(src.data()[i * src.stride + col]);
        exact += t;
        mag += std::fabs(t);
      }
      const double bound = double(count[r] + 2) * kEpsAcc<T> * mag + std::fabs(exact) * kUlp<T> + 1e-300;
      const double err = std::fabs(as_double(o[col]) - exact);
      EXPECT(err <= bound, "%s: long row %lld col %lld: error %g > bound %g", what.c_str(), (long long)r,
             (long long)col, err, bound);
    }
    ++long_rows_checked;
  }

  // gather
  Mat<T> dst(s.k, s.d, s.d + L.pad_src, L.off_src), x(s.n, s.d, s.d + L.pad_out, L.off_out);
  fill(dst, g);
  fill(x, g);
  Mat<T> gref = dst;
  sa::gather_rows(gref.view(), x.view(), iv, wv, opt);
  const unsigned long long gbad = sim_gather(dst, x, idx, wp, ignore);
  EXPECT(gbad == kn::kNoBad, "%s: gather reported bad index %llu", what.c_str(), gbad);
  EXPECT(dst.same_bits(gref), "%s: gather differs from the CPU core", what.c_str());

  // Bad values (-1, or n + 5 when -1 is ignore_index, then n at the end): the first one is
  // reported and nothing is written, by either op.
  for (const int64_t p0 : {int64_t(0), s.k / 2}) {
    if (s.k < 2 || s.n < 1) break;
    std::vector<I> badidx = idx;
    const int64_t p1 = s.k - 1;
    badidx[p1] = static_cast<I>(s.n);
    badidx[p0] = static_cast<I>(ignore == -1 ? s.n + 5 : -1);
    Mat<T> before = out;
    EXPECT(sim_index_add(out, badidx, src, wp, ignore) == static_cast<unsigned long long>(p0),
           "%s: bad index not reported at %lld", what.c_str(), (long long)p0);
    EXPECT(out.same_bits(before), "%s: index_add wrote despite a bad index", what.c_str());
    Mat<T> dbefore = dst;
    EXPECT(sim_gather(dst, x, badidx, wp, ignore) == static_cast<unsigned long long>(p0),
           "%s: gather bad index not reported", what.c_str());
    EXPECT(dst.same_bits(dbefore), "%s: gather wrote despite a bad index", what.c_str());
  }
}

template <class T, class I>
void run_all(std::mt19937& g) {
  const Shape shapes[] = {
      {"N=1,K=1,D=1", 1, 1, 1, 0},
      {"uniform D=3", 7, 20, 3, 0},
      {"moe D=64", 16, 32, 64, 1},
      {"moe D=520 (partial tile)", 24, 48, 520, 1},
      {"uniform D=1000", 40, 90, 1000, 0},
      {"hot row D=136", 5, 300, 136, 2},
      {"hot row over 8 blocks D=64", 4, 2000, 64, 2},
      {"two long runs D=40", 3, 1200, 40, 3},
      {"short runs across block edges D=16", 300, 600, 16, 0},
      {"K=0", 33, 0, 16, 0},
      {"D=0", 9, 12, 0, 0},
      {"K>>N D=8", 3, 200, 8, 0},
  };
  const Layout layouts[] = {
      {"contiguous", 0, 0, 0, 0},
      {"padded rows", 8, 16, 0, 0},
      {"src stride +1", 0, 1, 0, 0},
      {"out offset +1", 0, 0, 1, 0},
  };
  for (const auto& s : shapes)
    for (const auto& L : layouts)
      for (bool weighted : {false, true})
        for (std::optional<int64_t> ignore : {std::optional<int64_t>{}, std::optional<int64_t>{-1}, std::optional<int64_t>{2}})
          run_case<T, I>(s, L, weighted, ignore, g);
}

template <class T>
void run_dtype(std::mt19937& g) {
  run_all<T, int32_t>(g);
  run_all<T, int64_t>(g);
}

}  // namespace

int main() {
  // The CUDA kernels fuse w * x + acc (one rounding) like the core's AVX2/AVX-512 paths; the
  // scalar path rounds twice, so on a CPU without AVX2 weighted index_add is not compared.
  // Every FMA level this CPU has is a reference in turn.
  int levels = 0;
  for (const sa::Isa isa : {sa::Isa::avx2, sa::Isa::avx512, sa::Isa::avx512_bf16, sa::Isa::scalar}) {
    if (sa::set_isa(isa) != isa || (isa == sa::Isa::scalar && levels > 0)) continue;
    fma_reference = isa != sa::Isa::scalar;
    if (!fma_reference) std::printf("host_sim: no FMA level on this CPU: weighted index_add results not compared\n");
    std::mt19937 g(12345);
    const int before = failures;
    run_dtype<float>(g);
    run_dtype<double>(g);
    run_dtype<__nv_bfloat16>(g);
    run_dtype<__half>(g);
    std::printf("host_sim: CPU core at %s: %d failures\n", sa::isa_name(isa), failures - before);
    ++levels;
  }
  std::printf("host_sim: %d checks, %d failures (%lld rows of more than %lld contributions)\n", checks, failures,
              (long long)long_rows_checked, (long long)kn::kSegment);
  return failures == 0 && levels > 0 ? 0 : 1;
}
