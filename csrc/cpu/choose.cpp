// The choice of strategy (see strategy.h): a forced one (Options, set_strategy, the environment),
// else the cheapest by a cost model in nanoseconds whose constants live in policy.h.
//
//   direct   K * entry + src streamed once + each touched out row re-read and re-written per
//            contribution (from cache while the touched rows fit, at random rows beyond)
//            + for bf16/fp16 with repeated rows, the float32 scratch (bitmap of N, copy in/out)
//   planned  the sort (count: N + K; radix: K per digit) + K * entry + R * row + src rows read at
//            random + each touched out row read and written once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "convert.h"
#include "policy.h"
#include "strategy.h"

namespace scatter_add {

const char* strategy_name(Strategy s) {
  switch (s) {
    case Strategy::automatic: return "auto";
    case Strategy::direct: return "direct";
    case Strategy::count: return "count";
    case Strategy::radix: return "radix";
  }
  return "unknown";
}

namespace {

constexpr Strategy kAll[] = {Strategy::automatic, Strategy::direct, Strategy::count, Strategy::radix};

// -1: not read yet; else the Strategy value. Read once from SCATTER_ADD_CPU_STRATEGY.
std::atomic<int> g_strategy{-1};

Strategy strategy_from_env() {
  const char* env = std::getenv("SCATTER_ADD_CPU_STRATEGY");
  if (env == nullptr || *env == '\0') return Strategy::automatic;
  for (Strategy s : kAll)
    if (std::strcmp(env, strategy_name(s)) == 0) return s;
  throw Error(Error::Kind::value, std::string("SCATTER_ADD_CPU_STRATEGY='") + env +
                                      "' is not one of auto, direct, count, radix");
}

}  // namespace

Strategy get_strategy() {
  int v = g_strategy.load(std::memory_order_relaxed);
  if (v < 0) {
    v = static_cast<int>(strategy_from_env());
    g_strategy.store(v, std::memory_order_relaxed);
  }
  return static_cast<Strategy>(v);
}

void set_strategy(Strategy s) {
  if (static_cast<unsigned>(s) > 3u)
    throw Error(Error::Kind::value, "set_strategy: unknown strategy code " + std::to_string(static_cast<int>(s)));
  g_strategy.store(static_cast<int>(s), std::memory_order_relaxed);
}

namespace cpu {

double weight_value(const WeightVector& w, int64_t i) {
  switch (w.dtype) {
    case DType::f32: return static_cast<const float*>(w.data)[i];
    case DType::f64: return static_cast<const double*>(w.data)[i];
    case DType::bf16: return bf16_to_f32(static_cast<const uint16_t*>(w.data)[i]);
    case DType::f16: return f16_to_f32(static_cast<const uint16_t*>(w.data)[i]);
  }
  return 1.0;
}

const void* weights_as_acc(const WeightVector& w, DType data, std::vector<float>* f,
                           std::vector<double>* d) {
  if (w.data == nullptr) return nullptr;
  const DType acc = data == DType::f64 ? DType::f64 : DType::f32;
  if (w.dtype == acc) return w.data;
  if (acc == DType::f64) {
    d->resize(static_cast<size_t>(w.size));
    for (int64_t i = 0; i < w.size; ++i) (*d)[static_cast<size_t>(i)] = weight_value(w, i);
    return d->data();
  }
  f->resize(static_cast<size_t>(w.size));
  for (int64_t i = 0; i < w.size; ++i) (*f)[static_cast<size_t>(i)] = static_cast<float>(weight_value(w, i));
  return f->data();
}

int threads_for(const Options& o, double bytes) {
  int t = o.num_threads > 0 ? o.num_threads : get_num_threads();
  const double by_size = bytes / static_cast<double>(CpuPolicy::kMinBytesPerThread);
  if (by_size < t) t = std::max(1, static_cast<int>(by_size));
  return t;
}

namespace {

using P = CpuPolicy;

// Reading `rows` rows of `row_bytes` at random places of an array of `array_bytes`.
double random_rows_ns(double rows, double row_bytes, double array_bytes) {
  if (array_bytes <= static_cast<double>(P::kCacheBytes)) return rows * row_bytes * P::kNsPerByteStream;
  return rows * std::max(row_bytes, 64.0) * P::kNsPerByteRandom;
}

double plan_ns(int64_t n, int64_t k, bool radix) {
  if (!radix) return P::kCountNsPerRow * static_cast<double>(n) + P::kCountNsPerEntry * static_cast<double>(k);
  int bits = 0;
  while (bits < 63 && (int64_t(1) << bits) < n) ++bits;
  const int passes = (bits + P::kRadixDigitBits - 1) / P::kRadixDigitBits;
  const int digit = passes > 0 ? (bits + passes - 1) / passes : 0;
  return passes * (P::kRadixNsPerEntryPass * static_cast<double>(k) +
                   P::kRadixNsPerBucket * static_cast<double>(int64_t(1) << digit));
}

}  // namespace

bool plan_prefers_radix(int64_t n, int64_t k) { return plan_ns(n, k, true) < plan_ns(n, k, false); }

double estimate_ns(const AddShape& s, Strategy strategy) {
  const double n = static_cast<double>(s.n), k = static_cast<double>(s.k);
  const double es = static_cast<double>(dtype_size(s.dtype));
  const double rb = static_cast<double>(s.d) * es;
  // Expected distinct rows of k uniform draws from n (an upper bound for skewed indices' cost).
  const double r = s.n > 0 ? n * -std::expm1(-k / n) : 0.0;
  const double src_stream = k * rb * P::kNsPerByteStream;
  if (strategy == Strategy::direct) {
    double ns = k * P::kDirectNsPerEntry + src_stream;
    const double touched = r * rb;
    if (touched <= static_cast<double>(P::kCacheBytes))
      ns += 2.0 * random_rows_ns(r, rb, n * rb) + 2.0 * (k - r) * rb * P::kNsPerByteStream;
    else
      ns += 2.0 * random_rows_ns(k, rb, n * rb);
    if (es == 2 && k - r >= 1.0)  // repeated rows: the float32 scratch
      ns += n * P::kScratchNsPerRow + r * (rb + 2.0 * rb) * 2.0 * P::kNsPerByteStream;
    return ns;
  }
  const bool radix = strategy == Strategy::radix || (strategy != Strategy::count && plan_prefers_radix(s.n, s.k));
  return plan_ns(s.n, s.k, radix) + k * P::kPlannedNsPerEntry + r * P::kPlannedNsPerRow +
         random_rows_ns(k, rb, k * rb) + 2.0 * random_rows_ns(r, rb, n * rb);
}

Strategy choose_add(const AddShape& s, const Options& o) {
  if (o.strategy != Strategy::automatic) return o.strategy;
  const Strategy forced = get_strategy();
  if (forced != Strategy::automatic) return forced;
  const bool radix = plan_prefers_radix(s.n, s.k);
  const Strategy planned = radix ? Strategy::radix : Strategy::count;
  return estimate_ns(s, Strategy::direct) <= estimate_ns(s, planned) ? Strategy::direct : planned;
}

}  // namespace cpu
}  // namespace scatter_add
