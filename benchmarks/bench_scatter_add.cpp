// Microbenchmark of the C++ core at MoE combine shapes: out[index[i]] += w[i] * src[i].
// Prints, per shape, the median ms, GB/s and the percentage of an `a += b` stream ceiling measured
// in the same run with the same threads. Bytes moved (the floor for a plan that owns each output
// row):  K*D*s (src read) + 2*R*D*s (each touched out row read and written once) + K*index bytes,
// with s the element size and R the number of distinct destination rows.
//   .build/release/benchmarks/bench_scatter_add [--quick] [--threads T] [--n N] [--d D] [--thp]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <sys/mman.h>

#include "scatter_add/scatter_add.h"

namespace sa = scatter_add;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

template <class F>
double median_seconds(F&& f, double budget_s = 0.4, int min_reps = 3, int max_reps = 50) {
  f();  // warm-up: page faults, caches, thread pool
  std::vector<double> t;
  const auto start = Clock::now();
  while (static_cast<int>(t.size()) < min_reps ||
         (seconds_since(start) < budget_s && static_cast<int>(t.size()) < max_reps)) {
    const auto t0 = Clock::now();
    f();
    t.push_back(seconds_since(t0));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// a += b over float32 buffers far larger than the last-level cache; 3 * n * 4 bytes per pass.
// This VM's bandwidth drifts by tens of percent within minutes, so each row re-measures it right
// before its own timing (as the Python benchmark does).
struct StreamCeiling {
  size_t n = size_t(64) << 20;  // 256 MiB per buffer
  std::vector<float> a = std::vector<float>(n, 1.0f), b = std::vector<float>(n, 2.0f);
  double measure(int threads, double budget_s) {
    float* pa = a.data();
    const float* pb = b.data();
    const size_t len = n;
    const double s = median_seconds(
        [&] {
#pragma omp parallel for num_threads(threads) schedule(static)
          for (size_t i = 0; i < len; ++i) pa[i] += pb[i];
        },
        budget_s);
    return 3.0 * n * sizeof(float) / s / 1e9;
  }
};

// Zeroed bytes; with transparent huge pages asked for (--thp) when the kernel's THP mode is
// "madvise", as on this machine, where plain allocations get 4 KiB pages.
struct Buffer {
  unsigned char* p = nullptr;
  size_t n = 0;
  Buffer(size_t bytes, bool thp) : n(bytes) {
    const size_t align = size_t(2) << 20;
    p = static_cast<unsigned char*>(std::aligned_alloc(align, (bytes + align - 1) / align * align));
    if (thp) madvise(p, (bytes + align - 1) / align * align, MADV_HUGEPAGE);
    std::memset(p, 0, bytes);
  }
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

enum class Dist { moe_topk, uniform, hot_row };
const char* dist_name(Dist d) {
  return d == Dist::moe_topk ? "moe_top2" : d == Dist::uniform ? "uniform" : "hot_row";
}

std::vector<int32_t> make_index(Dist d, int64_t n, int64_t k, std::mt19937_64& rng) {
  std::vector<int32_t> idx(static_cast<size_t>(k));
  std::uniform_int_distribution<int64_t> u(0, n - 1);
  for (int64_t i = 0; i < k; ++i) {
    if (d == Dist::moe_topk) {
      idx[i] = static_cast<int32_t>(i % n);  // every token once per slot: each row exactly twice
    } else if (d == Dist::uniform) {
      idx[i] = static_cast<int32_t>(u(rng));
    } else {
      idx[i] = static_cast<int32_t>(rng() % 10 == 0 ? u(rng) : 0);  // 90% of rows into row 0
    }
  }
  // MoE order: expert-sorted source rows, so destinations come shuffled.
  if (d == Dist::moe_topk) std::shuffle(idx.begin(), idx.end(), rng);
  return idx;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  int threads = sa::get_num_threads();
  int64_t only_n = 0, only_d = 0;
  bool thp = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--thp")) thp = true;
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) threads = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--n") && i + 1 < argc) only_n = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--d") && i + 1 < argc) only_d = std::atoll(argv[++i]);
  }
  sa::set_num_threads(threads);
  StreamCeiling stream;
  std::printf("scatter-add C++ microbenchmark: isa=%s threads=%d, stream ceiling (a += b) %.1f GB/s at start,"
              " re-measured before each row (ceil)\n",
              sa::isa_name(sa::active_isa()), threads, stream.measure(threads, 1.0));
  std::printf("%-9s %-5s %6s %6s %6s %9s %9s %6s %8s %8s\n", "dist", "dtype", "N", "K", "D", "ms",
              "GB/s", "ceil", "%ceil", "plan_ms");
  std::vector<int64_t> ns = quick ? std::vector<int64_t>{1024} : std::vector<int64_t>{1024, 4096, 16384};
  std::vector<int64_t> ds = quick ? std::vector<int64_t>{2048} : std::vector<int64_t>{2048, 4096};
  if (only_n > 0) ns = {only_n};
  if (only_d > 0) ds = {only_d};
  std::mt19937_64 rng(0);
  for (sa::DType dt : {sa::DType::bf16, sa::DType::f32})
    for (int64_t d : ds)
      for (int64_t n : ns)
        for (Dist dist : {Dist::moe_topk, Dist::uniform, Dist::hot_row}) {
          const int64_t k = 2 * n;
          const size_t es = sa::dtype_size(dt);
          Buffer out(static_cast<size_t>(n * d) * es, thp), src(static_cast<size_t>(k * d) * es, thp);
          for (size_t i = 0; i < src.n; i += es) src.p[i + es - 1] = 0x3c;  // ~1.0-ish values
          const std::vector<int32_t> idx = make_index(dist, n, k, rng);
          std::vector<float> w(static_cast<size_t>(k), 0.5f);
          const sa::IndexVector iv{idx.data(), k, sa::IndexType::i32};
          const sa::Matrix om{out.p, n, d, d, dt};
          const sa::ConstMatrix sm{src.p, k, d, d, dt};
          const sa::WeightVector wv{w.data(), k, sa::DType::f32};
          const double ceiling = stream.measure(threads, 0.2);
          const double s = median_seconds([&] { sa::index_add_rows(om, iv, sm, wv); });
          sa::Plan plan;
          const double ps = median_seconds([&] { plan.rebuild(iv, n); }, 0.1);
          const double bytes = double(k) * d * es + 2.0 * plan.num_distinct() * d * es + k * 4.0;
          const double gbs = bytes / s / 1e9;
          std::printf("%-9s %-5s %6lld %6lld %6lld %9.3f %9.1f %6.1f %7.1f%% %8.3f\n", dist_name(dist),
                      dt == sa::DType::bf16 ? "bf16" : "f32", (long long)n, (long long)k, (long long)d,
                      s * 1e3, gbs, ceiling, 100.0 * gbs / ceiling, ps * 1e3);
          std::fflush(stdout);
        }
  return 0;
}
