// The CPU strategies behind the public entry points, and the choice between them. The entry
// points (scatter_add.cpp) validate the arguments' shapes, then call choose_add and run the
// strategy; each strategy validates the index values before its first write.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "policy.h"
#include "scatter_add/scatter_add.h"

namespace scatter_add {
namespace cpu {

// Weights in the accumulator type of `data` (double for f64, float otherwise), indexed by source
// id; the caller's buffer when it already has that type, else *f or *d filled.
const void* weights_as_acc(const WeightVector& w, DType data, std::vector<float>* f,
                           std::vector<double>* d);

// Threads for `bytes` of memory traffic: at most the requested count (Options::num_threads or
// the default), fewer when each would get less than min_per_thread bytes.
int threads_for(const Options& o, double bytes, int64_t min_per_thread = CpuPolicy::kMinBytesPerThread);
// The same for a walk that adds whole rows of dtype t at cache speed (the planned walk, the
// direct walk of wide rows): CpuPolicy::kRowsMinBytesPerThread or kRows16MinBytesPerThread.
int row_threads_for(const Options& o, double bytes, DType t);

struct AddShape {
  int64_t n, k, d;  // out rows, index entries, columns
  DType dtype;
};
// The strategy index_add_rows runs: Options::strategy, else get_strategy(), else direct for a
// sorted index (its runs walk needs no sort), else the cheapest by the cost model (policy.h).
// Never automatic.
Strategy choose_add(const AddShape& s, const Options& o, bool sorted = false);
// Options::strategy, else get_strategy(); automatic when neither forces one. Throws on an unknown
// code (or SCATTER_ADD_CPU_STRATEGY value), before anything is written.
Strategy forced_strategy(const Options& o);
// The strategy gather_rows runs: Options::strategy, else get_strategy(), else direct (by the
// index; count or radix: by a plan that sort builds for the call). Never automatic.
Strategy choose_gather(const Options& o);
// The cost model's constants: policy.h's (policy_cost_model), or others to try
// (`bench_scatter_add --fit` searches them against saved calibrations).
struct CostModel {
  double direct_ns_per_entry, direct16_ns_per_entry, direct16_sparse_ns_per_entry, planned_ns_per_entry,
      planned_ns_per_row, ns_per_byte_stream, ns_per_byte_cached, ns_per_byte_memory, ns_per_random_row,
      ns_per_random_source_row, ns_per_cached_source_row, cache_bytes, bitmap_ns_per_row, count_ns_per_row,
      count_ns_per_entry, radix_ns_per_entry_pass, radix_ns_per_bucket;
};
const CostModel& policy_cost_model();
// Each constant of CostModel by its name in policy.h.
struct CostTerm {
  const char* name;
  double CostModel::*value;
};
const std::vector<CostTerm>& cost_terms();
// Estimated nanoseconds of each strategy for the shape, single thread (for the benchmark's
// report and the tests of the chooser).
double estimate_ns(const AddShape& s, Strategy strategy, const CostModel& m = policy_cost_model());
// The cheapest strategy on one thread by model m: what choose_add picks at one thread with no
// strategy forced, for an unsorted index.
Strategy cheapest_add(const AddShape& s, const CostModel& m);
// How run_direct divides its walk: the threads it takes (threads_for, and one when no split
// pays), whether they split the columns (each at least CpuPolicy::kMinColumnShareBytes of every
// row) or the rows (direct_row_split_pays; never for a sorted index, whose runs split by
// themselves).
struct DirectSplit {
  int threads;
  bool columns, rows;
  // Wide rows of an unsorted index (columns): run_direct gives the threads ranges of rows
  // instead where a sample of the index shows those ranges balanced.
  bool rows_when_balanced;
};
DirectSplit direct_split(const AddShape& s, const Options& o, bool sorted);
// A row split of the direct walk into nt ranges of blocks of 2^shift rows, cut at equal shares of
// a sample of CpuPolicy::kBalanceSamples index entries, entries naming `ignore` left out (plus
// block_base per block: 1 where a thread's rows cost it work of their own, so that an index
// concentrated in few blocks still spreads the rows; 0 for ranges of rows added in place, whose
// work is their entries alone): thread t takes blocks [cut[t], cut[t + 1]).
// balanced: no range holds more than kRowsBalanceNum / kRowsBalanceDen of an equal share of the
// sampled entries (a split never changes the bits, so an estimate of the balance is enough).
struct RowCut {
  std::vector<int64_t> cut;
  bool balanced;
};
RowCut cut_rows(const IndexVector& index, int64_t n, int nt, int shift, int64_t block_base = 1,
                std::optional<int64_t> ignore = std::nullopt);
// The same on up to `threads` threads, as each strategy divides its work: a plan's rows over the
// threads threads_for gives them (its sort on one), the direct walk only where run_direct splits
// its rows, takes ranges of float32/float64 rows of a small out or a sparse index (an index that
// balances them assumed where an even one would; CpuPolicy::kRangesDivideMaxOutBytes,
// kRangesDivideSparseLoadDen), or splits its columns in shares of
// CpuPolicy::kColumnShareScalesBytes or more (narrower shares gain nothing; below
// kMinColumnShareBytes it runs on one thread). choose_add compares these.
double threaded_ns(const AddShape& s, Strategy strategy, int threads);
// Whether the direct walk of an unsorted index, with rows too narrow to split by columns, gives
// each of nt threads a range of rows (else one thread walks alone). A row split has every thread
// walk the whole index and skip the other threads' entries, a branch that a spread index
// mispredicts about 1 / nt of the time: it pays only when the work per entry that it divides
// (estimate_ns less the walk itself and the source stream), W, outweighs that:
// W (nt - 1) > kRowSplitSkipNs. Where the split deals (direct_deals), each thread walks only its
// own entries after a copy costing about kDealNsPerEntry each (kDealVectorNsPerEntry where the
// active level deals by vectors): it pays when the walk's estimate per entry E gives
// E (nt - 1) / nt > that cost. Where the split compacts (direct_compacts) a float32/float64 walk,
// each thread reads the index once more and skips nothing: E (nt - 1) / nt > kCompactNsPerEntry.
// Every split but a dealt one also needs K / N of at most CpuPolicy::kRowSplitMaxLoad, and every
// split but a dealt one or a float32/float64 compacted one at least kRowSplitMinLoad.
bool direct_row_split_pays(const AddShape& s, int nt);
// Whether a row split of the direct walk compacts each block of entries to its thread's own before
// adding them (DirectJob::compact): rows of CpuPolicy::kCompactMinRowBytes to kCompactMaxRowBytes
// into an out of kCompactMinOutBytes or more (rows of kCompactWideRowBytes or more: of
// kCompactWideMinOutBytes or more). bf16/fp16 rows compact only where they are added in place (no
// float32 scratch), which the index decides.
bool direct_compacts(const AddShape& s);
// Whether a row split of the direct walk on nt threads deals the entries out to their rows'
// threads first (strategy_direct.cpp): bf16/fp16 on two threads, rows of at most
// CpuPolicy::kDealMaxRowBytes, and the copies (at most 8 bytes of index value and of weight per
// entry) in CpuPolicy::kDealMaxBytes. Such a split costs about CpuPolicy::kDealNsPerEntry per
// entry and divides the whole walk (direct_row_split_pays then weighs that instead of the skips).
bool direct_deals(const AddShape& s, int nt);
// Whether a bf16/fp16 direct walk of k entries into n > k rows of d columns sums in touched slots
// (a float32 slot per row, filled from out by the row's first contribution) rather than sparse
// ones (a pass over the index first finds the rows named more than once; only those get a slot):
// the slots fit, and `load`, the entries per row as far as repeats go (k / n for a uniform index,
// sampled_load for a given one), is at least CpuPolicy::kTouchedMinLoad.
bool touched_slots_pay(int64_t n, int64_t k, int64_t d, bool split_columns, double load);
// The first half of that: whether the slots fit (n > k, d, their bytes, no column split).
bool touched_slots_fit(int64_t n, int64_t k, int64_t d, bool split_columns);
// bf16/fp16: whether the direct walk gives every row a float32 slot, all copied in first (the
// dense scratch; touched and sparse slots are the alternatives): n <= k, or rows of at most
// CpuPolicy::kDenseMaxCols columns, n <= CpuPolicy::kDenseRowsPerEntry k, and (beyond one
// column) slots of at most CpuPolicy::kDenseMaxBytes.
bool dense_scratch(int64_t n, int64_t k, int64_t d);
// The load of an index of k entries into n rows for touched_slots_pay: k / n, or where that is
// under CpuPolicy::kTouchedMinLoad and k is at least kLoadSampleMinEntries, k times the
// chance that two entries name the same row, estimated from a strided sample of
// kLoadSamples entries (a hot row repeats far more than k / n says).
double sampled_load(const IndexVector& index, int64_t n, std::optional<int64_t> ignore);
// Which sort a plan of k entries into n rows uses by cost.
bool plan_prefers_radix(int64_t n, int64_t k);
// For a sorted index: whether the mean length of its runs is min_mean or more (policy.h's
// kLongRunExact or kLongRunRounded), from kRunSamples neighbour pairs, one at a scattered offset
// in each of kRunSamples equal stretches (a fixed stride would meet runs of a length that divides
// it at the same place in every run).
bool runs_are_long(const IndexVector& index, int64_t min_mean);

// out[index[i]] += w[i] * src[i] without a plan (strategy_direct.cpp), after `scan` validated
// the index (and found whether it is sorted). w is in the accumulator type (weights_as_acc) or
// null.
struct IndexScan;
void run_direct(const Matrix& out, const IndexVector& index, const ConstMatrix& src, const void* w,
                const Options& o, const IndexScan& scan);
// The same over a plan's rows (strategy_planned.cpp).
void run_planned(const Matrix& out, const Plan& plan, const ConstMatrix& src, const void* w,
                 const Options& o);

// dst[i] = w[i] * x[index[i]] (gather.cpp): by the index (validated first), or by a plan.
void run_gather(const Matrix& dst, const ConstMatrix& x, const IndexVector& index, const void* w,
                const Options& o);
void run_gather_planned(const Matrix& dst, const ConstMatrix& x, const Plan& plan, const void* w,
                        const Options& o);

}  // namespace cpu
}  // namespace scatter_add
