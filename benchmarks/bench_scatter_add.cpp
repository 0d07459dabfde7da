// Microbenchmark of the C++ core: out[index[i]] += w[i] * src[i].
// Default: MoE combine shapes; prints, per shape, the median ms, GB/s and the percentage of an
// `a += b` stream ceiling measured in the same run with the same threads. Bytes moved (the floor
// for a plan that owns each output row):  K*D*s (src read) + 2*R*D*s (each touched out row read
// and written once) + K*index bytes, with s the element size and R the number of distinct
// destination rows.
// --strategies: shapes from every corner of the sweep (tiny D, N >> K, K >> N, one hot row, MoE),
// each strategy forced in turn: total us, and for the planned ones the sort and the row walk
// apart; plus what the cost model estimates and picks.
// --calibrate: one thread, thread CPU time (robust to a loaded machine), every strategy over a
// grid of D x N/K x dtype x index distribution; prints, per shape, each strategy's time, the best,
// the cost model's pick and how much slower the pick is than the best (the measurements behind
// policy.h), then the worst picks. With --threads T (T > 1) before it: the same grid on T threads,
// the least wall time of a few calls, scored against the pick for T threads (choose_add).
//   .build/release/benchmarks/bench_scatter_add [--quick] [--threads T] [--n N] [--d D] [--thp]
//   .build/release/benchmarks/bench_scatter_add --strategies [--threads T]
//   .build/release/benchmarks/bench_scatter_add [--threads T] --calibrate [FILE.csv]  (measure; save)
//   .build/release/benchmarks/bench_scatter_add --evaluate FILE.csv      (re-score the cost model)
//   .build/release/benchmarks/bench_scatter_add --fit FILE.csv...         (search its constants)
//   .build/release/benchmarks/bench_scatter_add --matmul [--threads T]  (small_matmul, _nn)
//   .build/release/benchmarks/bench_scatter_add --random-rows [--threads T]  (the bandwidth cells' bound)
// --matmul: the MoE experts' products at the sizes of bench_moe.py's blocks: an expert's forward
// (x @ W.T, small_matmul) and its backward (g @ W and g.T @ x, small_matmul_nn) at 1 to 512 rows:
// median ms and GFLOPS.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#include <sys/mman.h>
#include <time.h>

#include "scatter_add/scatter_add.h"
#include "strategy.h"

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

// Index values for the strategy table: uniform, sorted, power law (zipf ~1.2, ranks scattered),
// all in one row, MoE top-2 (each row twice, expert-sorted sources).
std::vector<int32_t> strategy_index(const std::string& dist, int64_t n, int64_t k, std::mt19937_64& rng) {
  std::vector<int32_t> idx(static_cast<size_t>(k));
  std::uniform_int_distribution<int64_t> u(0, n - 1);
  std::uniform_real_distribution<double> x(0.0, 1.0);
  for (int64_t i = 0; i < k; ++i) {
    if (dist == "zipf") {
      const double r = std::pow(1.0 - x(rng), -1.0 / 0.2) - 1.0;
      const uint64_t rank = r > 1e18 ? 0 : static_cast<uint64_t>(r) % static_cast<uint64_t>(n);
      idx[i] = static_cast<int32_t>((rank * 2654435761u) % static_cast<uint64_t>(n));
    } else if (dist == "one") {
      idx[i] = 0;
    } else if (dist == "moe") {
      idx[i] = static_cast<int32_t>(i % n);
    } else {
      idx[i] = static_cast<int32_t>(u(rng));
    }
  }
  if (dist == "sorted") std::sort(idx.begin(), idx.end());
  if (dist == "moe") std::shuffle(idx.begin(), idx.end(), rng);
  return idx;
}

void strategy_table(int threads) {
  struct Shape {
    int64_t n, k, d;
    sa::DType dt;
    const char* dist;
  };
  const Shape shapes[] = {
      {16, 16, 1, sa::DType::f32, "uniform"},          {4096, 4096, 1, sa::DType::f32, "uniform"},
      {262144, 4096, 1, sa::DType::f32, "uniform"},    {262144, 4096, 8, sa::DType::f32, "uniform"},
      {262144, 4096, 8, sa::DType::bf16, "uniform"},   {1000000, 100000, 1, sa::DType::f32, "uniform"},
      {1000000, 100000, 32, sa::DType::f32, "uniform"}, {1000000, 100000, 256, sa::DType::f32, "uniform"},
      {1000000, 100000, 32, sa::DType::bf16, "uniform"}, {100000, 1000000, 1, sa::DType::f32, "uniform"},
      {100000, 1000000, 1, sa::DType::bf16, "uniform"}, {1000, 1000000, 2, sa::DType::f32, "sorted"},
      {100000, 1000000, 64, sa::DType::f32, "zipf"},    {100000, 1000000, 64, sa::DType::bf16, "zipf"},
      {4096, 65536, 1, sa::DType::f32, "one"},          {4096, 65536, 16, sa::DType::bf16, "one"},
      {8192, 16384, 2048, sa::DType::bf16, "moe"},      {8192, 16384, 2048, sa::DType::f32, "moe"},
      {32768, 65536, 128, sa::DType::bf16, "moe"},      {2048, 4096, 4096, sa::DType::bf16, "uniform"},
  };
  std::printf("strategies, threads=%d isa=%s: median us per call; plan = the sort alone, walk = the row pass\n",
              threads, sa::isa_name(sa::active_isa()));
  std::printf("%8s %8s %5s %-8s %-7s | %9s %9s %9s %9s | %8s %8s %8s | %9s %9s %9s | %s\n", "N", "K", "D",
              "dtype", "dist", "auto", "direct", "count", "radix", "plan_c", "plan_r", "walk", "est_dir",
              "est_cnt", "est_rdx", "pick");
  std::mt19937_64 rng(1);
  for (const Shape& sh : shapes) {
    const size_t es = sa::dtype_size(sh.dt);
    Buffer out(static_cast<size_t>(sh.n * sh.d) * es, false), src(static_cast<size_t>(sh.k * sh.d) * es, false);
    for (size_t i = 0; i < src.n; i += es) src.p[i + es - 1] = 0x3c;
    const std::vector<int32_t> idx = strategy_index(sh.dist, sh.n, sh.k, rng);
    const sa::IndexVector iv{idx.data(), sh.k, sa::IndexType::i32};
    const sa::Matrix om{out.p, sh.n, sh.d, sh.d, sh.dt};
    const sa::ConstMatrix sm{src.p, sh.k, sh.d, sh.d, sh.dt};
    double t[4];
    for (int s = 0; s < 4; ++s) {
      sa::Options o;
      o.num_threads = threads;
      o.strategy = static_cast<sa::Strategy>(s);
      t[s] = median_seconds([&] { sa::index_add_rows(om, iv, sm, {}, o); }, 0.2);
    }
    sa::Plan plan;
    const double pc = median_seconds([&] { plan.rebuild(iv, sh.n, std::nullopt, sa::Strategy::count); }, 0.1);
    const double pr = median_seconds([&] { plan.rebuild(iv, sh.n, std::nullopt, sa::Strategy::radix); }, 0.1);
    sa::Options o;
    o.num_threads = threads;
    const double walk = median_seconds([&] { sa::index_add_rows(om, plan, sm, {}, o); }, 0.2);
    const sa::cpu::AddShape as{sh.n, sh.k, sh.d, sh.dt};
    std::printf("%8lld %8lld %5lld %-8s %-7s | %9.1f %9.1f %9.1f %9.1f | %8.1f %8.1f %8.1f | %9.1f %9.1f %9.1f | %s\n",
                (long long)sh.n, (long long)sh.k, (long long)sh.d, sa::dtype_name(sh.dt), sh.dist, t[0] * 1e6,
                t[1] * 1e6, t[2] * 1e6, t[3] * 1e6, pc * 1e6, pr * 1e6, walk * 1e6,
                sa::cpu::estimate_ns(as, sa::Strategy::direct) / 1e3, sa::cpu::estimate_ns(as, sa::Strategy::count) / 1e3,
                sa::cpu::estimate_ns(as, sa::Strategy::radix) / 1e3,
                sa::strategy_name(sa::cpu::choose_add(as, sa::Options{})));
    std::fflush(stdout);
  }
}

double clock_seconds(clockid_t clock) {
  timespec ts;
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// Least time of a few calls after a warm-up (at least `reps`, more while under 50 ms), by `clock`:
// CLOCK_THREAD_CPUTIME_ID for one thread (robust to a loaded machine), CLOCK_MONOTONIC for several.
template <class F>
double least_time(F&& f, clockid_t clock = CLOCK_THREAD_CPUTIME_ID, int reps = 3) {
  f();
  double best = 1e30, spent = 0;
  for (int i = 0; i < reps || (spent < 0.05 && i < 20); ++i) {
    const double t0 = clock_seconds(clock);
    f();
    const double t = clock_seconds(clock) - t0;
    best = std::min(best, t);
    spent += t;
  }
  return best;
}

// One calibration measurement: a shape and each strategy's best thread CPU seconds.
struct CalRow {
  std::string dtype, dist;
  int64_t n, k, d;
  double t[4];  // [1..3]: direct, count, radix
  int threads = 1;
};

// Prints each shape's times, the best strategy, the cost model's pick and its regret (pick / best),
// then the geometric mean and the worst picks.
void report_regret(const std::vector<CalRow>& rows) {
  std::printf("%-8s %-7s %8s %8s %5s | %10s %10s %10s | %-6s %-6s %6s\n", "dtype", "dist", "N", "K", "D",
              "direct", "count", "radix", "best", "pick", "regret");
  std::vector<std::pair<double, std::string>> lines;
  double lg = 0;
  for (const CalRow& r : rows) {
    const sa::DType dt = r.dtype == "bfloat16" ? sa::DType::bf16 : sa::DType::f32;
    const int best = static_cast<int>(std::min_element(r.t + 1, r.t + 4) - r.t);
    sa::Options as_timed;  // the threads the calibration's times were taken on
    as_timed.num_threads = r.threads;
    const sa::Strategy pick = sa::cpu::choose_add({r.n, r.k, r.d, dt}, as_timed);
    const double regret = r.t[static_cast<int>(pick)] / r.t[best];
    char line[256];
    std::snprintf(line, sizeof line, "%-8s %-7s %8lld %8lld %5lld | %10.1f %10.1f %10.1f | %-6s %-6s %5.2fx",
                  r.dtype.c_str(), r.dist.c_str(), (long long)r.n, (long long)r.k, (long long)r.d, r.t[1] * 1e6,
                  r.t[2] * 1e6, r.t[3] * 1e6, sa::strategy_name(static_cast<sa::Strategy>(best)),
                  sa::strategy_name(pick), regret);
    std::printf("%s\n", line);
    lines.emplace_back(regret, line);
    lg += std::log(regret);
  }
  std::sort(lines.begin(), lines.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::printf("\nregret of the cost model's pick: geometric mean %.3fx over %zu shapes; worst:\n",
              std::exp(lg / static_cast<double>(rows.size())), rows.size());
  for (size_t i = 0; i < lines.size() && i < 12; ++i) std::printf("%s\n", lines[i].second.c_str());
}

// Measures every strategy over the grid (one thread, thread CPU time); writes `csv` if given.
void calibrate(const char* csv, int threads) {
  sa::set_num_threads(threads);
  if (threads == 1)
    std::printf("calibration: 1 thread, thread CPU time, isa=%s, us per call; 'regret' = pick / best\n",
                sa::isa_name(sa::active_isa()));
  else
    std::printf("calibration: %d threads, least wall time, isa=%s, us per call; 'regret' = pick / best\n", threads,
                sa::isa_name(sa::active_isa()));
  const int64_t max_bytes = int64_t(16) << 20;
  std::mt19937_64 rng(3);
  std::vector<CalRow> rows;
  for (sa::DType dt : {sa::DType::f32, sa::DType::bf16})
    for (int64_t d : {1, 4, 16, 64, 256, 1024, 4096})
      for (double ratio : {0.01, 0.1, 1.0, 10.0, 100.0})
        for (const char* dist : {"uniform", "zipf"}) {
          const int64_t big = std::max<int64_t>(1, std::min<int64_t>(1000000, max_bytes / (4 * d)));
          const int64_t n = ratio >= 1 ? big : std::max<int64_t>(1, static_cast<int64_t>(big * ratio));
          const int64_t k = ratio >= 1 ? std::max<int64_t>(1, static_cast<int64_t>(big / ratio)) : big;
          const size_t es = sa::dtype_size(dt);
          Buffer out(static_cast<size_t>(n * d) * es, false), src(static_cast<size_t>(k * d) * es, false);
          for (size_t i = 0; i < src.n; i += es) src.p[i + es - 1] = 0x3a;
          const std::vector<int32_t> idx = strategy_index(dist, n, k, rng);
          const sa::IndexVector iv{idx.data(), k, sa::IndexType::i32};
          const sa::Matrix om{out.p, n, d, d, dt};
          const sa::ConstMatrix sm{src.p, k, d, d, dt};
          CalRow row{sa::dtype_name(dt), dist, n, k, d, {0, 0, 0, 0}, threads};
          for (int s = 1; s < 4; ++s) {
            sa::Options o;
            o.num_threads = threads;
            o.strategy = static_cast<sa::Strategy>(s);
            const auto call = [&] { sa::index_add_rows(om, iv, sm, {}, o); };
            row.t[s] = threads == 1 ? least_time(call) : least_time(call, CLOCK_MONOTONIC, 5);
          }
          rows.push_back(row);
          std::fprintf(stderr, "\r%zu/140 shapes", rows.size());
        }
  std::fprintf(stderr, "\n");
  if (csv != nullptr) {
    FILE* f = std::fopen(csv, "w");
    for (const CalRow& r : rows)
      std::fprintf(f, "%s,%s,%lld,%lld,%lld,%.9g,%.9g,%.9g%s\n", r.dtype.c_str(), r.dist.c_str(), (long long)r.n,
                   (long long)r.k, (long long)r.d, r.t[1], r.t[2], r.t[3],
                   r.threads == 1 ? "" : (",threads=" + std::to_string(r.threads)).c_str());
    std::fclose(f);
  }
  report_regret(rows);
}

std::vector<CalRow> read_calibration(const char* csv) {
  std::vector<CalRow> rows;
  FILE* f = std::fopen(csv, "r");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot read %s\n", csv);
    std::exit(1);
  }
  char line[512], dt[32], dist[32];
  long long n, k, d;
  double a, b, c;
  int threads;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    int got = std::sscanf(line, "%31[^,],%31[^,],%lld,%lld,%lld,%lf,%lf,%lf,threads=%d", dt, dist, &n, &k, &d, &a,
                                &b, &c, &threads);
    if (got < 8) continue;
    if (got == 8 && std::strstr(line, "threads=") != nullptr) got = -1;  // a threads column with no count
    if (got < 0 || (got == 9 && threads < 1)) {
      std::fprintf(stderr, "%s: a row with a bad threads column, left out: %s", csv, line);
      continue;
    }
    rows.push_back({dt, dist, n, k, d, {0, a, b, c}, got == 9 ? threads : 1});
  }
  std::fclose(f);
  return rows;
}

// Re-scores a saved calibration against the cost model as built now.
void evaluate(const char* csv) { report_regret(read_calibration(csv)); }

// Mean log regret of model m's one-thread picks over a calibration's one-thread rows.
double log_regret(const std::vector<CalRow>& rows, const sa::cpu::CostModel& m) {
  double lg = 0;
  size_t counted = 0;
  for (const CalRow& r : rows) {
    if (r.threads != 1) continue;  // the threads' terms are not the model's constants
    ++counted;
    const sa::DType dt = r.dtype == "bfloat16" ? sa::DType::bf16 : sa::DType::f32;
    const double best = *std::min_element(r.t + 1, r.t + 4);
    lg += std::log(r.t[static_cast<int>(sa::cpu::cheapest_add({r.n, r.k, r.d, dt}, m))] / best);
  }
  return lg / static_cast<double>(std::max<size_t>(counted, 1));
}

// Searches the cost model's constants for the least regret over several calibrations (each
// weighing the same, whatever its size): coordinate descent, each constant scaled by a few
// factors in turn, a change kept only if it lowers the mean log regret by more than 0.01%, until a
// pass keeps none. Prints the constants that moved and each calibration's regret before and
// after; policy.h is edited by hand.
void fit(const std::vector<const char*>& files) {
  std::vector<std::vector<CalRow>> sets;
  for (const char* f : files) sets.push_back(read_calibration(f));
  // Each calibration with one-thread rows weighs the same; the others score nothing here.
  auto has_one_thread = [](const std::vector<CalRow>& rows) {
    return std::any_of(rows.begin(), rows.end(), [](const CalRow& r) { return r.threads == 1; });
  };
  const size_t scored = static_cast<size_t>(std::count_if(sets.begin(), sets.end(), has_one_thread));
  auto score = [&](const sa::cpu::CostModel& m) {
    double s = 0;
    for (const auto& rows : sets) s += log_regret(rows, m);
    return s / static_cast<double>(std::max<size_t>(scored, 1));
  };
  const sa::cpu::CostModel start = sa::cpu::policy_cost_model();
  sa::cpu::CostModel best = start;
  double best_score = score(best);
  const double factors[] = {0.5, 0.7, 0.85, 0.95, 1.05, 1.2, 1.4, 2.0};
  for (int pass = 0; pass < 20; ++pass) {
    bool moved = false;
    for (const sa::cpu::CostTerm& t : sa::cpu::cost_terms()) {
      sa::cpu::CostModel trial_best = best;
      double trial_score = best_score;
      for (double f : factors) {
        sa::cpu::CostModel trial = best;
        trial.*t.value *= f;
        const double s = score(trial);
        if (s < trial_score - 1e-4) {
          trial_score = s;
          trial_best = trial;
        }
      }
      if (trial_score < best_score) {
        best = trial_best;
        best_score = trial_score;
        moved = true;
      }
    }
    if (!moved) break;
  }
  std::printf("fitted over %zu calibrations: mean log regret %.4f -> %.4f\n", files.size(), score(start), best_score);
  for (const sa::cpu::CostTerm& t : sa::cpu::cost_terms())
    if (best.*t.value != start.*t.value)
      std::printf("  %-26s %10.4g -> %.4g\n", t.name, start.*t.value, best.*t.value);
  for (size_t i = 0; i < files.size(); ++i) {
    if (!has_one_thread(sets[i]))
      std::printf("  %s: no one-thread rows, not fitted (--evaluate scores its picks)\n", files[i]);
    else
      std::printf("  %s: geometric-mean regret %.3fx -> %.3fx\n", files[i], std::exp(log_regret(sets[i], start)),
                  std::exp(log_regret(sets[i], best)));
  }
}

void matmul_table(int threads) {
  struct Shape {
    const char* name;
    int64_t out, in;
  };
  const Shape shapes[] = {{"mixtral up", 7168, 1024}, {"mixtral down", 1024, 3584},
                          {"qwen3 up", 768, 1024}, {"qwen3 down", 1024, 384}};
  std::printf("small_matmul, isa=%s threads=%d: median ms (GFLOPS); W [out, in] bf16, m rows\n",
              sa::isa_name(sa::active_isa()), threads);
  std::printf("%-13s %5s %5s %5s %18s %18s %18s\n", "weight", "out", "in", "m", "x @ W.T", "g @ W (nn)",
              "g.T @ x (nn)");
  std::mt19937 rng(1);
  for (const Shape& sh : shapes)
    for (int64_t m : {1, 4, 16, 128, 512}) {
      auto bf16 = [&](size_t n) {
        std::vector<uint16_t> v(n);
        for (auto& e : v) e = static_cast<uint16_t>(0x3f00 + (rng() & 0xff));
        return v;
      };
      const std::vector<uint16_t> w = bf16(static_cast<size_t>(sh.out * sh.in)), x = bf16(static_cast<size_t>(m * sh.in)),
                                  g = bf16(static_cast<size_t>(m * sh.out)), gt = bf16(static_cast<size_t>(sh.out * m));
      std::vector<uint16_t> y(static_cast<size_t>(m * sh.out)), gx(static_cast<size_t>(m * sh.in)),
          gw(static_cast<size_t>(sh.out * sh.in));
      const double flops = 2.0 * static_cast<double>(m * sh.out * sh.in);
      bool ok = true;
      const double fwd = median_seconds([&] {
        ok &= sa::small_matmul({y.data(), m, sh.out, sh.out, sa::DType::bf16}, {x.data(), m, sh.in, sh.in, sa::DType::bf16},
                               {w.data(), sh.out, sh.in, sh.in, sa::DType::bf16});
      }, 0.2);
      const double dx = median_seconds([&] {
        ok &= sa::small_matmul_nn({gx.data(), m, sh.in, sh.in, sa::DType::bf16}, {g.data(), m, sh.out, sh.out, sa::DType::bf16},
                                  {w.data(), sh.out, sh.in, sh.in, sa::DType::bf16});
      }, 0.2);
      const double dw = median_seconds([&] {
        ok &= sa::small_matmul_nn({gw.data(), sh.out, sh.in, sh.in, sa::DType::bf16}, {gt.data(), sh.out, m, m, sa::DType::bf16},
                                  {x.data(), m, sh.in, sh.in, sa::DType::bf16});
      }, 0.2);
      if (!ok) {
        std::printf("no small_matmul kernel at isa=%s\n", sa::isa_name(sa::active_isa()));
        return;
      }
      std::printf("%-13s %5lld %5lld %5lld %9.3f (%6.1f) %9.3f (%6.1f) %9.3f (%6.1f)\n", sh.name, (long long)sh.out,
                  (long long)sh.in, (long long)m, fwd * 1e3, flops / fwd / 1e9, dx * 1e3, flops / dx / 1e9, dw * 1e3,
                  flops / dw / 1e9);
      std::fflush(stdout);
    }
}

// --random-rows: the sweep's bandwidth cells (rows of 256 B to 16 KiB, uniform or MoE top-2
// destinations) against what this memory system gives their traffic with no order to keep. The
// bound adds each source row into its destination row as 32-bit floats (the same bytes whatever
// the dtype), each thread half of the entries in turn, destination rows prefetched whole 0, 2, 8
// or 32 entries ahead (the fastest counts): the bytes of a scatter-add of random rows with none
// of its work. It is not exact (both threads may add into one row at once), so it is a bound and
// no strategy. Per cell: median ms of ours and the bound, each as a percentage of the stream
// ceiling measured right before the cell.
void random_rows_table(int threads) {
  struct Cell {
    int64_t n, k, d;
    Dist dist;
  };
  const Cell cells[] = {{262144, 262144, 64, Dist::uniform},
                        {65536, 65536, 256, Dist::uniform},
                        {16384, 32768, 1024, Dist::moe_topk},
                        {4096, 8192, 4096, Dist::moe_topk}};
  StreamCeiling stream;
  std::printf("random rows: ours against an unordered add of the same bytes (see the source), threads=%d, isa=%s\n",
              threads, sa::isa_name(sa::active_isa()));
  std::printf("%-9s %-5s %6s %6s %5s %7s %6s %8s %6s %9s %6s %12s\n", "dist", "dtype", "N", "K", "D", "MB", "ceil",
              "ours_ms", "%ceil", "bound_ms", "%ceil", "ours/bound");
  std::mt19937_64 rng(0);
  for (sa::DType dt : {sa::DType::f32, sa::DType::bf16})
    for (const Cell& c : cells) {
      const size_t es = sa::dtype_size(dt);
      Buffer out(static_cast<size_t>(c.n * c.d) * es, false), src(static_cast<size_t>(c.k * c.d) * es, false);
      // Sources of both signs (finite read as dtype elements or, by the bound, as 32-bit words),
      // so that every call changes the rows as the sweep's values do; zeros left them as they were.
      for (size_t i = 0; i < src.n; i += es) src.p[i + es - 1] = (i / es) % 2 ? 0xbc : 0x3c;
      const std::vector<int32_t> idx = make_index(c.dist, c.n, c.k, rng);
      const sa::IndexVector iv{idx.data(), c.k, sa::IndexType::i32};
      const sa::Matrix om{out.p, c.n, c.d, c.d, dt};
      const sa::ConstMatrix sm{src.p, c.k, c.d, c.d, dt};
      const int64_t words = c.d * static_cast<int64_t>(es) / 4;  // 32-bit words per row
      float* o = reinterpret_cast<float*>(out.p);
      const float* x = reinterpret_cast<const float*>(src.p);
      const int32_t* ix = idx.data();
      const int64_t k = c.k;
      auto part = [&](int t, int nt, int64_t ahead) {
        const int64_t lo = k * t / nt, hi = k * (t + 1) / nt;
        for (int64_t i = lo; i < hi; ++i) {
          if (ahead > 0 && i + ahead < hi)
            for (int64_t w = 0; w < words; w += 16) __builtin_prefetch(o + ix[i + ahead] * words + w, 1);
          float* orow = o + ix[i] * words;
          const float* srow = x + i * words;
#pragma omp simd
          for (int64_t w = 0; w < words; ++w) orow[w] += srow[w];
        }
      };
      auto bound = [&](int64_t ahead) {
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
        part(omp_get_thread_num(), omp_get_num_threads(), ahead);
#else
        std::vector<std::thread> pool;
        for (int t = 1; t < threads; ++t) pool.emplace_back(part, t, threads, ahead);
        part(0, threads, ahead);
        for (auto& th : pool) th.join();
#endif
      };
      std::vector<char> seen(static_cast<size_t>(c.n), 0);
      int64_t distinct = 0;
      for (int32_t r : idx) distinct += seen[r] ? 0 : (seen[r] = 1);
      const double bytes = double(c.k) * c.d * es + 2.0 * distinct * c.d * es + c.k * 4.0;
      const double ceiling = stream.measure(threads, 0.2);
      // interleaved, so that this machine's drifting bandwidth hits all alike; the bound is the
      // fastest of the unordered loops, destination rows prefetched 0, 2, 8 or 32 entries ahead
      const int64_t aheads[] = {0, 2, 8, 32};
      std::vector<std::vector<double>> t(5);
      sa::index_add_rows(om, iv, sm);
      for (int64_t a : aheads) bound(a);
      for (int r = 0; r < 9; ++r) {
        auto t0 = Clock::now();
        sa::index_add_rows(om, iv, sm);
        t[0].push_back(seconds_since(t0));
        for (int v = 0; v < 4; ++v) {
          t0 = Clock::now();
          bound(aheads[v]);
          t[v + 1].push_back(seconds_since(t0));
        }
      }
      std::vector<double> med;
      for (auto& v : t) {
        std::sort(v.begin(), v.end());
        med.push_back(v[v.size() / 2]);
      }
      const double so = med[0], sb = *std::min_element(med.begin() + 1, med.end());
      std::printf("%-9s %-5s %6lld %6lld %5lld %7.0f %6.1f %8.2f %5.0f%% %9.2f %5.0f%% %11.2fx\n", dist_name(c.dist),
                  dt == sa::DType::bf16 ? "bf16" : "f32", (long long)c.n, (long long)c.k, (long long)c.d, bytes / 1e6,
                  ceiling, so * 1e3, 100.0 * bytes / so / 1e9 / ceiling, sb * 1e3, 100.0 * bytes / sb / 1e9 / ceiling,
                  so / sb);
      std::fflush(stdout);
    }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  int threads = sa::get_num_threads();
  bool threads_given = false;
  int64_t only_n = 0, only_d = 0;
  bool thp = false, strategies = false, matmul = false, random_rows = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--thp")) thp = true;
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) {
      threads = std::max(1, std::atoi(argv[++i]));
      threads_given = true;
    }
    if (!std::strcmp(argv[i], "--n") && i + 1 < argc) only_n = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--d") && i + 1 < argc) only_d = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--strategies")) strategies = true;
    if (!std::strcmp(argv[i], "--matmul")) matmul = true;
    if (!std::strcmp(argv[i], "--random-rows")) random_rows = true;
    if (!std::strcmp(argv[i], "--calibrate")) {
      calibrate(i + 1 < argc ? argv[i + 1] : nullptr, threads_given ? threads : 1);
      return 0;
    }
    if (!std::strcmp(argv[i], "--evaluate") && i + 1 < argc) {
      evaluate(argv[i + 1]);
      return 0;
    }
    if (!std::strcmp(argv[i], "--fit") && i + 1 < argc) {
      fit(std::vector<const char*>(argv + i + 1, argv + argc));
      return 0;
    }
  }
  sa::set_num_threads(threads);
  if (strategies) {
    strategy_table(threads);
    return 0;
  }
  if (matmul) {
    matmul_table(threads);
    return 0;
  }
  if (random_rows) {
    random_rows_table(threads);
    return 0;
  }
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
