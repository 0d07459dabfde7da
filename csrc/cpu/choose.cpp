// The choice of strategy (see strategy.h): a forced one (Options, set_strategy, the environment),
// else direct for a sorted index, else the cheapest by a cost model in nanoseconds whose
// constants live in policy.h:
//   direct   K * entry + src streamed once + a destination row read and written per
//            contribution (in cache while the touched rows fit, a row from memory each beyond);
//            bf16/fp16 add their float32 scratch (dense: all N rows copied in, touched ones back;
//            touched: each touched row copied in by its first contribution and back; sparse:
//            bitmaps of N, repeated rows' slots)
//   planned  the sort (count: N + K; radix: K per 11-bit digit) + K * entry + R * row + source
//            rows read at random + each touched row read and written once
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

// Reading and writing `count` rows of `row_bytes` at random places of a working set of `ws`
// bytes: in cache, or a row fetched from memory each.
double rmw_ns(double count, double row_bytes, double ws) {
  if (ws <= P::kCacheBytes) return count * 2.0 * row_bytes * P::kNsPerByteCached;
  return count * (P::kNsPerRandomRow + 2.0 * row_bytes * P::kNsPerByteMemory);
}

// Rows an index of k uniform draws from n rows touches: n (1 - e^(-k/n)).
double touched_rows(int64_t n, int64_t k) {
  const double nd = static_cast<double>(std::max<int64_t>(n, 1));
  return nd * -std::expm1(-static_cast<double>(k) / nd);
}

double plan_ns(int64_t n, int64_t k, bool radix) {
  if (!radix) return P::kCountNsPerRow * static_cast<double>(n) + P::kCountNsPerEntry * static_cast<double>(k);
  int bits = 0;
  while (bits < 63 && (int64_t(1) << bits) < n) ++bits;
  const int passes = std::max(1, (bits + P::kRadixDigitBits - 1) / P::kRadixDigitBits);
  const int digit = (bits + passes - 1) / passes;
  return passes * (P::kRadixNsPerEntryPass * static_cast<double>(k) +
                   P::kRadixNsPerBucket * static_cast<double>(int64_t(1) << digit));
}

}  // namespace

bool plan_prefers_radix(int64_t n, int64_t k) { return plan_ns(n, k, true) < plan_ns(n, k, false); }

// The terms, for an index of k uniform draws from n rows (lambda = k / n contributions per row):
// R = n (1 - e^-lambda) rows touched, R2 = n (1 - e^-lambda (1 + lambda)) touched more than once,
// k e^-lambda contributions alone in their row. rb = D * element size, ab = D * accumulator size.
double estimate_ns(const AddShape& s, Strategy strategy) {
  const double n = static_cast<double>(std::max<int64_t>(s.n, 1)), k = static_cast<double>(s.k);
  const double es = static_cast<double>(dtype_size(s.dtype));
  const double rb = static_cast<double>(s.d) * es, ab = static_cast<double>(s.d) * 4.0;
  const double lambda = k / n;
  const double r = touched_rows(s.n, s.k);
  const double r2 = n * (1.0 - std::exp(-lambda) * (1.0 + lambda));
  const double src_stream = k * rb * P::kNsPerByteStream;
  if (strategy == Strategy::direct) {
    if (es != 2)  // the destination row itself accumulates
      return k * P::kDirectNsPerEntry + src_stream + rmw_ns(k, rb, r * rb);
    if (s.n <= s.k) {  // dense scratch: every row copied in, touched rows copied back
      // Per entry as float32's while the scratch is small, up to kDirect16NsPerEntry as it fills
      // the cache (one thread: 1.4 ns at N = 1000, 1.15 ns at 4096 rows of one column, 2.2 ns at
      // 10k, 3.5 ns at 100k).
      const double fill = std::min(1.0, n * ab / P::kCacheBytes);
      const double per_entry = P::kDirectNsPerEntry + (P::kDirect16NsPerEntry - P::kDirectNsPerEntry) * fill;
      return k * per_entry + src_stream + n * (rb + ab) * P::kNsPerByteStream +
             rmw_ns(k, ab, n * ab) + r * (ab + rb) * P::kNsPerByteStream;
    }
    if (touched_slots_pay(s.n, s.k, s.d, false))  // as dense, but each touched row copied in at random
      return k * P::kDirect16NsPerEntry + src_stream + rmw_ns(k, ab, n * ab) + rmw_ns(r, rb, n * rb) +
             r * ab * P::kNsPerByteStream;
    // sparse scratch: single contributions in place, repeated rows in the scratch
    const double single = k * std::exp(-lambda);
    return k * P::kDirect16SparseNsPerEntry + n * P::kBitmapNsPerRow + src_stream + rmw_ns(single, rb, n * rb) +
           rmw_ns(k - single, ab, r2 * ab) + r2 * (ab + rb) * 2.0 * P::kNsPerByteStream;
  }
  const bool radix = strategy == Strategy::radix || (strategy != Strategy::count && plan_prefers_radix(s.n, s.k));
  const double src = k * rb <= P::kCacheBytes ? k * (P::kNsPerCachedSourceRow + rb * P::kNsPerByteCached)
                                              : k * (P::kNsPerRandomSourceRow + rb * P::kNsPerByteMemory);
  return plan_ns(s.n, s.k, radix) + k * P::kPlannedNsPerEntry + r * P::kPlannedNsPerRow + src +
         2.0 * r * rb * P::kNsPerByteStream;
}

DirectSplit direct_split(const AddShape& s, const Options& o, bool sorted) {
  const double bytes = static_cast<double>(s.k) * static_cast<double>(s.d) * static_cast<double>(dtype_size(s.dtype)) * 3.0;
  DirectSplit split{s.d == 0 ? 1 : threads_for(o, bytes), false, false};
  const int nt = split.threads;
  split.columns = nt > 1 && s.d * static_cast<int64_t>(dtype_size(s.dtype)) >= nt * P::kMinColumnShareBytes;
  split.rows = nt > 1 && !split.columns && !sorted && direct_row_split_pays(s, nt);
  if (nt > 1 && !split.columns && !split.rows && !sorted) split.threads = 1;  // one thread walks alone
  return split;
}

double threaded_ns(const AddShape& s, Strategy strategy, int threads) {
  const double one = estimate_ns(s, strategy);
  if (threads <= 1) return one;
  Options o;
  o.num_threads = threads;
  const double es = static_cast<double>(dtype_size(s.dtype)), d = static_cast<double>(s.d), k = static_cast<double>(s.k);
  if (strategy == Strategy::direct) {  // divided only by a row split or wide column shares
    const DirectSplit split = direct_split(s, o, false);
    const bool divides = split.rows || (split.columns && d * es / split.threads >= static_cast<double>(P::kColumnShareScalesBytes));
    return divides ? one / split.threads : one;
  }
  // A plan's rows divide over the threads (each row summed by one); its sort runs on one.
  const int nt = threads_for(o, (k + static_cast<double>(P::kRowCost) * touched_rows(s.n, s.k)) * d * es);
  const bool radix = strategy == Strategy::radix || (strategy != Strategy::count && plan_prefers_radix(s.n, s.k));
  const double sort = std::min(one, std::max(plan_ns(s.n, s.k, radix), k * P::kSerialSortNsPerEntry));
  return sort + (one - sort) / nt;
}

bool touched_slots_pay(int64_t n, int64_t k, int64_t d, bool split_columns) {
  const double slots = static_cast<double>(n) * static_cast<double>(d) * 4.0;
  const double load = d == 1 ? P::kTouchedMinLoadOneColumn : P::kTouchedMinLoad;
  return n > k && !split_columns && d <= P::kTouchedMaxCols && slots <= static_cast<double>(P::kTouchedMaxBytes) &&
         static_cast<double>(k) >= load * static_cast<double>(n);
}

bool direct_row_split_pays(const AddShape& s, int nt) {
  // Neither the walk nor the source stream divides: the prefetchers stream every source row into
  // each thread, its own or not.
  const double per_entry = estimate_ns(s, Strategy::direct) / static_cast<double>(std::max<int64_t>(s.k, 1));
  const double src = static_cast<double>(s.d) * static_cast<double>(dtype_size(s.dtype)) * P::kNsPerByteStream;
  return (per_entry - P::kDirectNsPerEntry - src) * (nt - 1) > P::kRowSplitSkipNs;
}

Strategy choose_add(const AddShape& s, const Options& o, bool sorted) {
  if (static_cast<unsigned>(o.strategy) > 3u)
    throw Error(Error::Kind::value, "options.strategy has an unknown code " +
                                        std::to_string(static_cast<int>(o.strategy)) +
                                        " (auto, direct, count, radix are 0..3)");
  if (o.strategy != Strategy::automatic) return o.strategy;
  const Strategy forced = get_strategy();
  if (forced != Strategy::automatic) return forced;
  if (sorted) return Strategy::direct;
  const int nt = o.num_threads > 0 ? o.num_threads : get_num_threads();
  const double direct = threaded_ns(s, Strategy::direct, nt), count = threaded_ns(s, Strategy::count, nt),
               radix = threaded_ns(s, Strategy::radix, nt);
  if (direct <= count && direct <= radix) return Strategy::direct;
  return count <= radix ? Strategy::count : Strategy::radix;
}

}  // namespace cpu
}  // namespace scatter_add
