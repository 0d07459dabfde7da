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

int threads_for(const Options& o, double bytes, int64_t min_per_thread) {
  int t = o.num_threads > 0 ? o.num_threads : get_num_threads();
  const double by_size = bytes / static_cast<double>(min_per_thread);
  if (by_size < t) t = std::max(1, static_cast<int>(by_size));
  return t;
}

int row_threads_for(const Options& o, double bytes, DType t) {
  return threads_for(o, bytes,
                     dtype_size(t) == 2 ? CpuPolicy::kRows16MinBytesPerThread : CpuPolicy::kRowsMinBytesPerThread);
}

namespace {

using P = CpuPolicy;

// Reading and writing `count` rows of `row_bytes` at random places of a working set of `ws`
// bytes: in cache, or a row fetched from memory each.
double rmw_ns(const CostModel& m, double count, double row_bytes, double ws) {
  if (ws <= m.cache_bytes) return count * 2.0 * row_bytes * m.ns_per_byte_cached;
  return count * (m.ns_per_random_row + 2.0 * row_bytes * m.ns_per_byte_memory);
}

// Rows an index of k uniform draws from n rows touches: n (1 - e^(-k/n)).
double touched_rows(int64_t n, int64_t k) {
  const double nd = static_cast<double>(std::max<int64_t>(n, 1));
  return nd * -std::expm1(-static_cast<double>(k) / nd);
}

double plan_ns(const CostModel& m, int64_t n, int64_t k, bool radix) {
  if (!radix) return m.count_ns_per_row * static_cast<double>(n) + m.count_ns_per_entry * static_cast<double>(k);
  int bits = 0;
  while (bits < 63 && (int64_t(1) << bits) < n) ++bits;
  const int passes = std::max(1, (bits + P::kRadixDigitBits - 1) / P::kRadixDigitBits);
  const int digit = (bits + passes - 1) / passes;
  return passes * (m.radix_ns_per_entry_pass * static_cast<double>(k) +
                   m.radix_ns_per_bucket * static_cast<double>(int64_t(1) << digit));
}

bool prefers_radix(const CostModel& m, int64_t n, int64_t k) { return plan_ns(m, n, k, true) < plan_ns(m, n, k, false); }

}  // namespace

const CostModel& policy_cost_model() {
  static const CostModel m{P::kDirectNsPerEntry,     P::kDirect16NsPerEntry,  P::kDirect16SparseNsPerEntry,
                           P::kPlannedNsPerEntry,    P::kPlannedNsPerRow,     P::kNsPerByteStream,
                           P::kNsPerByteCached,      P::kNsPerByteMemory,     P::kNsPerRandomRow,
                           P::kNsPerRandomSourceRow, P::kNsPerCachedSourceRow, P::kCacheBytes,
                           P::kBitmapNsPerRow,       P::kCountNsPerRow,       P::kCountNsPerEntry,
                           P::kRadixNsPerEntryPass,  P::kRadixNsPerBucket};
  return m;
}

const std::vector<CostTerm>& cost_terms() {
  static const std::vector<CostTerm> terms = {
      {"kDirectNsPerEntry", &CostModel::direct_ns_per_entry},
      {"kDirect16NsPerEntry", &CostModel::direct16_ns_per_entry},
      {"kDirect16SparseNsPerEntry", &CostModel::direct16_sparse_ns_per_entry},
      {"kPlannedNsPerEntry", &CostModel::planned_ns_per_entry},
      {"kPlannedNsPerRow", &CostModel::planned_ns_per_row},
      {"kNsPerByteStream", &CostModel::ns_per_byte_stream},
      {"kNsPerByteCached", &CostModel::ns_per_byte_cached},
      {"kNsPerByteMemory", &CostModel::ns_per_byte_memory},
      {"kNsPerRandomRow", &CostModel::ns_per_random_row},
      {"kNsPerRandomSourceRow", &CostModel::ns_per_random_source_row},
      {"kNsPerCachedSourceRow", &CostModel::ns_per_cached_source_row},
      {"kCacheBytes", &CostModel::cache_bytes},
      {"kBitmapNsPerRow", &CostModel::bitmap_ns_per_row},
      {"kCountNsPerRow", &CostModel::count_ns_per_row},
      {"kCountNsPerEntry", &CostModel::count_ns_per_entry},
      {"kRadixNsPerEntryPass", &CostModel::radix_ns_per_entry_pass},
      {"kRadixNsPerBucket", &CostModel::radix_ns_per_bucket},
  };
  return terms;
}

bool plan_prefers_radix(int64_t n, int64_t k) { return prefers_radix(policy_cost_model(), n, k); }

// The terms, for an index of k uniform draws from n rows (lambda = k / n contributions per row):
// R = n (1 - e^-lambda) rows touched, R2 = n (1 - e^-lambda (1 + lambda)) touched more than once,
// k e^-lambda contributions alone in their row. rb = D * element size, ab = D * accumulator size.
double estimate_ns(const AddShape& s, Strategy strategy, const CostModel& m) {
  const double n = static_cast<double>(std::max<int64_t>(s.n, 1)), k = static_cast<double>(s.k);
  const double es = static_cast<double>(dtype_size(s.dtype));
  const double rb = static_cast<double>(s.d) * es, ab = static_cast<double>(s.d) * 4.0;
  const double lambda = k / n;
  const double r = touched_rows(s.n, s.k);
  const double r2 = n * (1.0 - std::exp(-lambda) * (1.0 + lambda));
  const double src_stream = k * rb * m.ns_per_byte_stream;
  if (strategy == Strategy::direct) {
    if (es != 2)  // the destination row itself accumulates
      return k * m.direct_ns_per_entry + src_stream + rmw_ns(m, k, rb, r * rb);
    if (s.n <= s.k) {  // dense scratch: every row copied in, touched rows copied back
      // Per entry as float32's while the scratch is small, up to kDirect16NsPerEntry as it fills
      // the cache (one thread: 1.4 ns at N = 1000, 1.15 ns at 4096 rows of one column, 2.2 ns at
      // 10k, 3.5 ns at 100k).
      const double fill = std::min(1.0, n * ab / m.cache_bytes);
      const double per_entry = m.direct_ns_per_entry + (m.direct16_ns_per_entry - m.direct_ns_per_entry) * fill;
      return k * per_entry + src_stream + n * (rb + ab) * m.ns_per_byte_stream + rmw_ns(m, k, ab, n * ab) +
             r * (ab + rb) * m.ns_per_byte_stream;
    }
    if (touched_slots_pay(s.n, s.k, s.d, false, lambda))  // as dense, but each touched row copied in at random
      return k * m.direct16_ns_per_entry + src_stream + rmw_ns(m, k, ab, n * ab) + rmw_ns(m, r, rb, n * rb) +
             r * ab * m.ns_per_byte_stream;
    // sparse scratch: single contributions in place, repeated rows in the scratch
    const double single = k * std::exp(-lambda);
    return k * m.direct16_sparse_ns_per_entry + n * m.bitmap_ns_per_row + src_stream + rmw_ns(m, single, rb, n * rb) +
           rmw_ns(m, k - single, ab, r2 * ab) + r2 * (ab + rb) * 2.0 * m.ns_per_byte_stream;
  }
  const bool radix = strategy == Strategy::radix || (strategy != Strategy::count && prefers_radix(m, s.n, s.k));
  const double src = k * rb <= m.cache_bytes ? k * (m.ns_per_cached_source_row + rb * m.ns_per_byte_cached)
                                             : k * (m.ns_per_random_source_row + rb * m.ns_per_byte_memory);
  return plan_ns(m, s.n, s.k, radix) + k * m.planned_ns_per_entry + r * m.planned_ns_per_row + src +
         2.0 * r * rb * m.ns_per_byte_stream;
}

Strategy cheapest_add(const AddShape& s, const CostModel& m) {
  const double direct = estimate_ns(s, Strategy::direct, m), count = estimate_ns(s, Strategy::count, m),
               radix = estimate_ns(s, Strategy::radix, m);
  if (direct <= count && direct <= radix) return Strategy::direct;
  return count <= radix ? Strategy::count : Strategy::radix;
}

DirectSplit direct_split(const AddShape& s, const Options& o, bool sorted) {
  const double bytes = static_cast<double>(s.k) * static_cast<double>(s.d) * static_cast<double>(dtype_size(s.dtype)) * 3.0;
  DirectSplit split{s.d == 0 ? 1 : threads_for(o, bytes), false, false, false};
  const int64_t row_bytes = s.d * static_cast<int64_t>(dtype_size(s.dtype));
  if (split.threads > 1 && row_bytes >= split.threads * P::kMinColumnShareBytes)  // wide rows: threads pay later
    split.threads = row_threads_for(o, bytes, s.dtype);
  const int nt = split.threads;
  split.columns = nt > 1 && s.d * static_cast<int64_t>(dtype_size(s.dtype)) >= nt * P::kMinColumnShareBytes;
  split.rows = nt > 1 && !split.columns && !sorted && direct_row_split_pays(s, nt);
  split.rows_when_balanced = split.columns && !sorted;
  if (nt > 1 && !split.columns && !split.rows && !sorted) split.threads = 1;  // one thread walks alone
  return split;
}

double threaded_ns(const AddShape& s, Strategy strategy, int threads) {
  const double one = estimate_ns(s, strategy);
  if (threads <= 1) return one;
  Options o;
  o.num_threads = threads;
  const double es = static_cast<double>(dtype_size(s.dtype)), d = static_cast<double>(s.d), k = static_cast<double>(s.k);
  if (strategy == Strategy::direct) {  // divided by a row split, ranges of rows or wide column shares
    const DirectSplit split = direct_split(s, o, false);
    // float32/float64 rows wide enough for a column split take ranges of single rows when the
    // index balances them (policy.h, kRowsBalanceNum): counted as divided, as an index without a
    // hot row gives, where out is small (kRangesDivideMaxOutBytes) or the index sparse over it
    // (kRangesDivideSparseLoadDen), and has rows enough for shares
    // that even an even index balances (N = 3 on two threads cuts 2:1 and keeps the column split).
    // bf16/fp16 cut whole blocks of rows and are not counted.
    const int64_t nt = split.threads, most = (s.n + nt - 1) / std::max<int64_t>(nt, 1);
    const bool even_cut = most * nt * P::kRowsBalanceDen <= s.n * P::kRowsBalanceNum;
    // Few entries per row, on the two threads that were measured (kRangesDivideSparseLoadDen).
    const bool sparse = nt == 2 && s.k <= s.n / P::kRangesDivideSparseLoadDen;
    const bool ranges = split.rows_when_balanced && es != 2.0 && even_cut &&
                        (sparse || static_cast<double>(s.n) * d * es <= static_cast<double>(P::kRangesDivideMaxOutBytes));
    const bool divides = split.rows || ranges ||
                         (split.columns && d * es / split.threads >= static_cast<double>(P::kColumnShareScalesBytes));
    return divides ? one / split.threads : one;
  }
  // A plan's rows divide over the threads (each row summed by one); its sort runs on one.
  const int nt = row_threads_for(o, (k + static_cast<double>(P::kRowCost) * touched_rows(s.n, s.k)) * d * es, s.dtype);
  const bool radix = strategy == Strategy::radix || (strategy != Strategy::count && plan_prefers_radix(s.n, s.k));
  const double sort_bytes = 16.0 * k + 8.0 * static_cast<double>(s.n);  // the sort's arrays
  const double per_entry = sort_bytes <= static_cast<double>(P::kSerialSortCachedBytes) ? P::kSerialSortCachedNsPerEntry
                                                                                        : P::kSerialSortNsPerEntry;
  const double sort = std::min(one, std::max(plan_ns(policy_cost_model(), s.n, s.k, radix), k * per_entry));
  return sort + (one - sort) / nt;
}

bool touched_slots_fit(int64_t n, int64_t k, int64_t d, bool split_columns) {
  const double slots = static_cast<double>(n) * static_cast<double>(d) * 4.0;
  return n > k && !split_columns && d <= P::kTouchedMaxCols && slots <= static_cast<double>(P::kTouchedMaxBytes);
}

bool dense_scratch(int64_t n, int64_t k, int64_t d) {
  if (n <= k) return true;
  const double slots = static_cast<double>(n) * static_cast<double>(d) * 4.0;
  return d <= P::kDenseMaxCols && n <= P::kDenseRowsPerEntry * k &&
         (d == 1 || slots <= static_cast<double>(P::kDenseMaxBytes));
}

bool touched_slots_pay(int64_t n, int64_t k, int64_t d, bool split_columns, double load) {
  return touched_slots_fit(n, k, d, split_columns) && load >= P::kTouchedMinLoad;
}

bool runs_are_long(const IndexVector& index, int64_t min_mean) {
  const int64_t k = index.size;
  auto value = [&](int64_t i) {
    return index.type == IndexType::i64 ? static_cast<const int64_t*>(index.data)[i]
                                        : static_cast<int64_t>(static_cast<const int32_t*>(index.data)[i]);
  };
  // A run ends where a neighbour differs: the share of sampled pairs that do not gives the mean
  // run length.
  const int64_t step = std::max<int64_t>(1, (k - 1) / P::kRunSamples);
  int64_t same = 0, probes = 0;
  for (int64_t j = 0; j * step + 1 < k; ++j, ++probes) {
    const uint64_t spread = (static_cast<uint64_t>(j) * 0x9E3779B97F4A7C15ull) >> 33;
    const int64_t i = std::min(k - 2, j * step + static_cast<int64_t>(spread % static_cast<uint64_t>(step)));
    same += value(i) == value(i + 1);
  }
  // A mean length of L or more: at least (L - 1) / L of the pairs inside a run.
  return probes > 0 && same * min_mean >= probes * (min_mean - 1);
}

double sampled_load(const IndexVector& index, int64_t n, std::optional<int64_t> ignore) {
  const int64_t k = index.size;
  const double lambda = static_cast<double>(k) / static_cast<double>(std::max<int64_t>(n, 1));
  if (lambda >= P::kTouchedMinLoad || k < P::kLoadSampleMinEntries) return lambda;
  // Pairs of sampled entries that name one row, counted in an open-addressing table.
  constexpr int kBits = 13, kSize = 1 << kBits;
  static_assert(2 * P::kLoadSamples <= kSize, "the table must stay at most half full");
  std::vector<int64_t> rows(kSize, -1);
  std::vector<int64_t> seen(kSize, 0);
  const int64_t step = std::max<int64_t>(1, k / P::kLoadSamples);
  int64_t samples = 0, pairs = 0;
  for (int64_t i = 0; i < k && samples < P::kLoadSamples; i += step) {
    const int64_t r = index.type == IndexType::i64 ? static_cast<const int64_t*>(index.data)[i]
                                                    : static_cast<const int32_t*>(index.data)[i];
    if (ignore && r == *ignore) continue;
    uint64_t h = (static_cast<uint64_t>(r) * 0x9E3779B97F4A7C15ull) >> (64 - kBits);
    while (rows[h] != -1 && rows[h] != r) h = (h + 1) & (kSize - 1);
    rows[h] = r;
    pairs += seen[h]++;
    ++samples;
  }
  if (samples < 2) return lambda;
  const double chance = static_cast<double>(pairs) / (0.5 * static_cast<double>(samples) * static_cast<double>(samples - 1));
  return std::max(lambda, static_cast<double>(k) * chance);
}

bool direct_deals(const AddShape& s, int nt) {
  const double row_bytes = static_cast<double>(s.d) * static_cast<double>(dtype_size(s.dtype));
  return nt == 2 && dtype_size(s.dtype) == 2 && row_bytes <= static_cast<double>(P::kDealMaxRowBytes) &&
         static_cast<double>(s.k) * (16.0 + row_bytes) <= static_cast<double>(P::kDealMaxBytes);
}

bool direct_compacts(const AddShape& s) {
  const double row_bytes = static_cast<double>(s.d) * static_cast<double>(dtype_size(s.dtype));
  const double min_out = static_cast<double>(row_bytes >= static_cast<double>(P::kCompactWideRowBytes)
                                                  ? P::kCompactWideMinOutBytes
                                                  : P::kCompactMinOutBytes);
  return row_bytes >= static_cast<double>(P::kCompactMinRowBytes) &&
         row_bytes <= static_cast<double>(P::kCompactMaxRowBytes) && static_cast<double>(s.n) * row_bytes >= min_out;
}

bool direct_row_split_pays(const AddShape& s, int nt) {
  const double per_entry = estimate_ns(s, Strategy::direct) / static_cast<double>(std::max<int64_t>(s.k, 1));
  // Where the index names each row many times, the rows' work that a split divides is small
  // beside the source rows and the index that every thread reads (CpuPolicy::kRowSplitMaxLoad).
  const double load = static_cast<double>(s.k) / static_cast<double>(std::max<int64_t>(s.n, 1));
  if (dtype_size(s.dtype) >= 4 && direct_compacts(s))  // each thread walks only its own entries
    return load <= P::kRowSplitMaxLoad && per_entry * (nt - 1) / nt > P::kCompactNsPerEntry;
  if (direct_deals(s, nt)) {
    // The AVX-512 levels deal rows of 2 and 4 bytes by vectors (KernelTable::deal).
    const double row_bytes = static_cast<double>(s.d) * static_cast<double>(dtype_size(s.dtype));
    const bool vector = active_isa() >= Isa::avx512 && (row_bytes == 2.0 || row_bytes == 4.0);
    return per_entry * (nt - 1) / nt > (vector ? P::kDealVectorNsPerEntry : P::kDealNsPerEntry);
  }
  // Neither the walk nor the source stream divides: the prefetchers stream every source row into
  // each thread, its own or not. Where the index names few rows the call is mostly its passes
  // over out (CpuPolicy::kRowSplitMinLoad).
  if (load > P::kRowSplitMaxLoad || load < P::kRowSplitMinLoad) return false;
  const double src = static_cast<double>(s.d) * static_cast<double>(dtype_size(s.dtype)) * P::kNsPerByteStream;
  return (per_entry - P::kDirectNsPerEntry - src) * (nt - 1) > P::kRowSplitSkipNs;
}

Strategy forced_strategy(const Options& o) {
  if (static_cast<unsigned>(o.strategy) > 3u)
    throw Error(Error::Kind::value, "options.strategy has an unknown code " +
                                        std::to_string(static_cast<int>(o.strategy)) +
                                        " (auto, direct, count, radix are 0..3)");
  return o.strategy != Strategy::automatic ? o.strategy : get_strategy();
}

Strategy choose_gather(const Options& o) {
  const Strategy forced = forced_strategy(o);
  // By the index wherever the cost model chooses: a plan built for the call never paid
  // (CpuPolicy, "gather: by the index or by a plan").
  return forced != Strategy::automatic ? forced : Strategy::direct;
}

Strategy choose_add(const AddShape& s, const Options& o, bool sorted) {
  const Strategy forced = forced_strategy(o);
  if (forced != Strategy::automatic) return forced;
  if (sorted) return Strategy::direct;
  const int nt = o.num_threads > 0 ? o.num_threads : get_num_threads();
  // The model's pick depends on the shape and the threads alone. A loop of calls of one shape
  // (a decode step's) asks again and again: the last answer is kept (the model takes about
  // 180 ns, a tenth of a small call).
  struct Last {
    AddShape s;
    int nt;
    Strategy pick;
  };
  thread_local Last last{{-1, -1, -1, DType::f32}, 0, Strategy::direct};
  if (last.s.n == s.n && last.s.k == s.k && last.s.d == s.d && last.s.dtype == s.dtype && last.nt == nt)
    return last.pick;
  const double direct = threaded_ns(s, Strategy::direct, nt), count = threaded_ns(s, Strategy::count, nt),
               radix = threaded_ns(s, Strategy::radix, nt);
  const Strategy pick = direct <= count && direct <= radix ? Strategy::direct
                        : count <= radix                   ? Strategy::count
                                                           : Strategy::radix;
  last = {s, nt, pick};
  return pick;
}

}  // namespace cpu
}  // namespace scatter_add
