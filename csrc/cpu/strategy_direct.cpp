// Strategy "direct": no sort. Sources are walked in increasing order and each is added into its
// destination row, so every row sees its contributions in source order.
//   float32/float64: the row itself is the accumulator (acc type == storage type).
//   bf16/fp16: rows are summed in a float32 scratch and rounded once on the way back. When
//     N <= K (rows of up to 16 columns: N <= 3 K) every row gets a slot; otherwise every row
//     touched does (touched slots, where rows repeat), or only the rows with several
//     contributions (the rank of a bitmap of the N rows gives each its slot) and the others are
//     added in place (one contribution, one rounding).
//   A sorted (non-decreasing) index, any dtype: each row's contributions are one run of
//     consecutive sources, summed in registers like a planned row and rounded once, with no sort
//     and no scratch.
// Threads: each thread owns a range of rows, cut where the index's per-block counts balance the
// work, when rows are wide enough for whole cache lines per thread and a sample of the index shows
// the ranges balanced, or when narrower rows' work outweighs every thread walking the whole index;
// wide rows that do not balance (a hot row) split by columns of every row. Either way each output
// element has one owner and one summation order. bf16/fp16 rows of at most 64 bytes split over two
// threads deal the entries out to the rows' owners first, so each walks only its own (any other
// row split has every thread walk the whole index and skip the others' entries). Otherwise one
// thread walks alone, and a float32 scratch's copies in and back still divide over the threads.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "big_alloc.h"
#include "dispatch.h"
#include "parallel.h"
#include "policy.h"
#include "strategy.h"
#include "validate.h"

namespace scatter_add {
namespace cpu {

namespace {

// Rows per block of a row split: 2^shift, whole bitmap words for bf16/fp16 (their threads own
// whole words of the bitmaps), single rows allowed otherwise.
int block_shift_for(int64_t n, bool narrow) {
  int shift = narrow ? 6 : 0;
  while ((n >> shift) >= CpuPolicy::kMaxBlocks) ++shift;
  return shift;
}

// Whether a bf16/fp16 matrix holds a NaN (any payload).
bool has_nan16(const Matrix& m) {
  const uint16_t inf = m.dtype == DType::bf16 ? 0x7F80 : 0x7C00;
  const bool flat = m.row_stride == m.cols;
  const int64_t rows = flat ? 1 : m.rows, cols = flat ? m.rows * m.cols : m.cols;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* p = static_cast<const uint16_t*>(m.data) + r * m.row_stride;
    uint16_t worst = 0;
    for (int64_t c = 0; c < cols; ++c) worst = std::max<uint16_t>(worst, p[c] & 0x7FFF);
    if (worst > inf) return true;
  }
  return false;
}

// A buffer that the calling thread keeps for its next direct walk. Its contents are not kept: a
// call writes or clears what it reads. A new float32 scratch is pages the kernel maps and zeroes on
// every call: bf16 D = 1, N = K = 1M, one thread, allocation and copy in 3.4 ms of a 9.5 ms call
// with new buffers, 0.6 ms with kept ones.
template <class T>
class Kept {
 public:
  T* get(size_t n) {
    if (n > size_) {
      release();
      if (n > SIZE_MAX / sizeof(T)) throw std::bad_alloc();
      data_.reset(static_cast<T*>(big_alloc(n * sizeof(T))));
      size_ = n;
    }
    return data_.get();
  }
  T* zeroed(size_t n) {
    T* p = get(n);
    if (n != 0) std::memset(p, 0, n * sizeof(T));  // p is null until a first non-empty get
    return p;
  }
  size_t bytes() const { return size_ * sizeof(T); }
  void release() {
    data_.reset();
    size_ = 0;
  }

 private:
  struct Free {
    void operator()(T* p) const { big_free(p); }
  };
  std::unique_ptr<T[], Free> data_;
  size_t size_ = 0;
};

// The direct walk's buffers in this thread, released at the end of a call when they hold more
// than CpuPolicy::kKeptScratchBytes in all (or when the call throws, out of memory part way).
struct KeptScratch {
  Kept<uint64_t> seen, bits;
  Kept<int64_t> slot_base;
  Kept<float> acc, snapshot;
  Kept<uint8_t> marks;
  Kept<uint64_t> parts;  // a two-thread row split's dealt entries
  size_t bytes() const {
    return seen.bytes() + bits.bytes() + slot_base.bytes() + acc.bytes() + snapshot.bytes() + marks.bytes() + parts.bytes();
  }
  void release() {
    seen.release();
    bits.release();
    slot_base.release();
    acc.release();
    snapshot.release();
    marks.release();
    parts.release();
  }
};

class KeptScratchUse {
 public:
  explicit KeptScratchUse(KeptScratch& k) : k_(k) {}
  ~KeptScratchUse() {
    if (std::uncaught_exceptions() > entered_ ||
        k_.bytes() - k_.parts.bytes() > static_cast<size_t>(CpuPolicy::kKeptScratchBytes) ||
        k_.parts.bytes() > 2 * static_cast<size_t>(CpuPolicy::kDealMaxBytes))  // two positions an entry
      k_.release();
  }

 private:
  KeptScratch& k_;
  int entered_ = std::uncaught_exceptions();
};

// The fields every direct walk sets: the views, the weights, ignore_index.
DirectJob job_for(const Matrix& out, const IndexVector& index, const ConstMatrix& src, const void* w,
                  const Options& o) {
  DirectJob job{};
  job.out = out.data;
  job.out_stride = out.row_stride;
  job.src = src.data;
  job.src_stride = src.row_stride;
  job.index = index.data;
  job.w = w;
  job.has_ignore = o.ignore_index.has_value();
  job.ignore = job.has_ignore ? *o.ignore_index : 0;
  return job;
}

// A sorted index: each row's contributions are one run of consecutive sources, summed in
// registers and rounded once (any dtype, no scratch). Threads take runs by equal shares of the
// entries (cut on run boundaries), or columns of every run when rows are wide.
void run_sorted(const Matrix& out, const IndexVector& index, const ConstMatrix& src, const void* w,
                const Options& o, int nt, bool split_columns) {
  const int64_t k = index.size, d = out.cols;
  const bool i64 = index.type == IndexType::i64;
  DirectJob job = job_for(out, index, src, w, o);
  const AddDirectFn runs = active_kernels().runs[static_cast<int>(out.dtype)][w != nullptr][i64];
  auto value = [&](int64_t i) {
    return i64 ? static_cast<const int64_t*>(index.data)[i] : static_cast<const int32_t*>(index.data)[i];
  };
  job.long_runs =
      runs_are_long(index, dtype_size(out.dtype) == 2 ? CpuPolicy::kLongRunRounded : CpuPolicy::kLongRunExact);
  // The first run boundary at or after entry i (i <= k): i itself where a run starts there, else
  // the end of the run holding entry i - 1, found by bisection (the values do not decrease). A
  // walk to that end cost a pass over the run on one thread before the others began: all K = 1M
  // entries in one row, float32, C++, 2 threads took 2.25 ms against one thread's 1.54.
  auto run_start = [&](int64_t i) {
    if (i <= 0 || i >= k) return i;
    const int64_t v = value(i - 1);
    int64_t lo = i - 1, hi = k;  // value(lo) == v; the boundary is in (lo, hi]
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (value(mid) == v)
        lo = mid;
      else
        hi = mid;
    }
    return hi;
  };
  // Wide rows too take shares of the entries when the runs cut them into shares of at most
  // kRowsBalanceNum / kRowsBalanceDen of an equal one (so threads write rows far apart, see
  // CpuPolicy::kRowsBalanceNum); else columns of every run.
  std::vector<int64_t> from;  // thread t's entries [from[t], from[t + 1]) (nt > 1)
  if (nt > 1) {
    from.assign(static_cast<size_t>(nt) + 1, k);
    from[0] = 0;
    for (int t = 1; t < nt; ++t) from[static_cast<size_t>(t)] = run_start(k * t / nt);
  }
  if (split_columns) {
    int64_t most = 0;
    for (int t = 0; t < nt; ++t) most = std::max(most, from[static_cast<size_t>(t) + 1] - from[static_cast<size_t>(t)]);
    if (most * nt * CpuPolicy::kRowsBalanceDen <= k * CpuPolicy::kRowsBalanceNum) split_columns = false;
  }
  parallel_run(nt, [&](int t, int nth) {
    if (split_columns) {
      const int64_t align = CpuPolicy::kColumnAlign;
      const int64_t c0 = std::min(d, (d * t / nth + align - 1) / align * align);
      const int64_t c1 = t + 1 == nth ? d : std::min(d, (d * (t + 1) / nth + align - 1) / align * align);
      if (c0 < c1) runs(job, 0, k, c0, c1);
    } else {
      const bool cut = nth == nt && !from.empty();
      const int64_t i0 = cut ? from[static_cast<size_t>(t)] : run_start(k * t / nth);
      const int64_t i1 = cut ? from[static_cast<size_t>(t) + 1] : t + 1 == nth ? k : run_start(k * (t + 1) / nth);
      if (i0 < i1) runs(job, i0, i1, 0, d);
    }
  });
}

// The threads of one parallel_run meeting between two phases: nth arrive, the last releases the
// others (each thread of a parallel_run runs at once, under OpenMP or std::thread).
class SpinBarrier {
 public:
  void arrive_and_wait(int nth) {
    if (nth <= 1) return;
    const int gen = gen_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == nth) {
      arrived_.store(0, std::memory_order_relaxed);
      gen_.store(gen + 1, std::memory_order_release);
      return;
    }
    // Past a few thousand spins the other thread is likely descheduled (more threads than
    // cores): give it the core.
    for (int spins = 0; gen_.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins < 4096)
        spin_pause();
      else
        std::this_thread::yield();
    }
  }

 private:
  static void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
  }
  std::atomic<int> arrived_{0};
  std::atomic<int> gen_{0};
};

}  // namespace

RowCut cut_rows(const IndexVector& index, int64_t n, int nt, int shift, int64_t block_base,
                std::optional<int64_t> ignore) {
  const int64_t k = index.size;
  std::vector<int64_t> blocks(static_cast<size_t>((n >> shift) + 1));
  const int64_t step = std::max<int64_t>(1, k / CpuPolicy::kBalanceSamples);
  const int64_t skip = ignore.value_or(-1);  // out of range when unset: never a row
  auto sample = [&](const auto* idx) {
    for (int64_t i = 0; i < k; i += step) {
      const int64_t r = static_cast<int64_t>(idx[i]);
      if (r >= 0 && r < n && r != skip) ++blocks[static_cast<size_t>(r >> shift)];
    }
  };
  if (index.type == IndexType::i64)
    sample(static_cast<const int64_t*>(index.data));
  else
    sample(static_cast<const int32_t*>(index.data));
  const int64_t nb = static_cast<int64_t>(blocks.size());
  int64_t total = 0;
  for (int64_t b = 0; b < nb; ++b) total += blocks[static_cast<size_t>(b)] + block_base;
  RowCut rc{std::vector<int64_t>(static_cast<size_t>(nt) + 1, nb), false};
  rc.cut[0] = 0;
  int64_t run = 0, t = 1;
  for (int64_t b = 0; b < nb && t < nt; ++b) {
    const int64_t before = run;
    run += blocks[static_cast<size_t>(b)] + block_base;
    for (; t < nt && run * nt >= total * t; ++t) {  // the block's end or start, whichever is nearer
      const bool start = total * t - before * nt < run * nt - total * t;
      rc.cut[static_cast<size_t>(t)] = std::max(rc.cut[static_cast<size_t>(t) - 1], start ? b : b + 1);
    }
  }
  int64_t all = 0, most = 0;
  for (int th = 0; th < nt; ++th) {
    int64_t share = 0;
    for (int64_t b = rc.cut[static_cast<size_t>(th)]; b < rc.cut[static_cast<size_t>(th) + 1]; ++b)
      share += blocks[static_cast<size_t>(b)];
    all += share;
    most = std::max(most, share);
  }
  rc.balanced = all > 0 && most * nt * CpuPolicy::kRowsBalanceDen <= all * CpuPolicy::kRowsBalanceNum;
  return rc;
}

void run_direct(const Matrix& out, const IndexVector& index, const ConstMatrix& src, const void* w,
                const Options& o, const IndexScan& first) {
  const int64_t n = out.rows, k = index.size, d = out.cols;
  const size_t es = dtype_size(out.dtype);
  const bool narrow = es == 2;
  const int di = static_cast<int>(out.dtype);
  const bool i64 = index.type == IndexType::i64;
  const bool weighted = w != nullptr;

  // Threads and the split, decided before the index pass so that it counts what the split needs.
  const DirectSplit split = direct_split({n, k, d, out.dtype}, o, first.sorted);
  const int nt = split.threads;
  bool split_columns = split.columns, split_rows = split.rows;
  const int shift = block_shift_for(n, narrow);

  if (d == 0 || first.kept == 0) return;
  if (first.sorted) {
    run_sorted(out, index, src, w, o, nt, split_columns);
    return;
  }

  // Row split: the threads' ranges of rows, from a sample of the index (cut_rows).
  std::vector<int64_t> cut;
  if (split_rows || split.rows_when_balanced) {
    // Ranges of wide float32/float64 rows add in place: a thread's work is its entries, and its
    // rows that no entry names cost it nothing (so a sparse index over part of out still splits).
    const bool in_place = !split_rows && !narrow;
    RowCut rc = cut_rows(index, n, nt, shift, in_place ? 0 : 1, o.ignore_index);
    cut = std::move(rc.cut);
    if (split.rows_when_balanced && rc.balanced) {  // wide rows: ranges of rows, not columns of every row
      split_rows = true;
      split_columns = false;
    }
  }

  // bf16/fp16: a float32 scratch. Dense (a slot per row, n <= k: every slot pays for itself; rows
  // of up to CpuPolicy::kDenseMaxCols columns up to CpuPolicy::kDenseRowsPerEntry k: dense_scratch)
  // copies every row in, and back only the rows the adds touched, which they mark as they go
  // (or, when threads split the columns and so share the marks, a marking pass does first).
  // Rows of at most kSnapshotMaxCols columns, back to back, with no NaN in out need no marks:
  // every other value survives the float32 round trip bit for bit, so the elements to write back
  // are those whose sum differs from a snapshot of the scratch taken as it was filled (an element
  // whose sum equals it rounds back to its own bits; a row no entry names is never written).
  // There a mark, a store to a second random line per entry, costs more than the snapshot's copy
  // and vector compare (see CpuPolicy::kSnapshotMaxCols). Sparse needs the rows that repeat
  // (bits), and has nothing to do when none does. Touched (n > k, slots for every row in at most
  // CpuPolicy::kTouchedMaxBytes, and rows that repeat: touched_slots_pay) needs no pass first: a
  // row's first contribution sets its bit in `seen` and starts its slot from out, and the rows of
  // `seen` go back.
  const bool dense = narrow && dense_scratch(n, k, d);
  const bool prefetch = static_cast<double>(n) * static_cast<double>(out.row_stride) * static_cast<double>(es) >
                        static_cast<double>(CpuPolicy::kPrefetchAboveBytes);
  const bool exact = dense && d <= CpuPolicy::kSnapshotMaxCols && (d == 1 || out.row_stride == d) && !split_columns &&
                     !has_nan16(out);
  const bool mark_in_pass = dense && split_columns && !exact;
  // (the index is sampled only when the slots fit)
  const bool touched = narrow && !dense && touched_slots_fit(n, k, d, split_columns) &&
                       touched_slots_pay(n, k, d, split_columns, sampled_load(index, n, o.ignore_index));
  thread_local KeptScratch kept;
  const KeptScratchUse use(kept);
  const int64_t words = narrow ? (n + 63) / 64 : 0;
  uint64_t* const seen = kept.seen.zeroed(static_cast<size_t>(words));
  uint64_t* const bits = narrow && !dense && !touched ? kept.bits.zeroed(static_cast<size_t>(words)) : nullptr;
  // A row split of narrow rows deals the entries out to the threads that own their rows (below);
  // a sparse scratch's rows that repeat are then found by each owner in its own parts.
  const bool dealt = split_rows && direct_deals({n, k, d, out.dtype}, nt);
  const bool sparse = narrow && !dense && !touched;
  IndexScan scan = first;
  if (narrow && !touched && (!dense || mark_in_pass) && !(dealt && sparse))
    scan = scan_index(index, n, o.ignore_index, seen, bits);
  DirectJob job = job_for(out, index, src, w, o);
  job.row_lo = 0;
  job.row_hi = n;
  job.prefetch = prefetch;
  job.every_entry = scan.kept == k;  // none ignored; every value was checked to lie in [0, n)

  const bool scratch = dense || touched || (sparse && (dealt || scan.repeated > 0));
  uint8_t* const marks = dense && !mark_in_pass && !exact ? kept.marks.zeroed(static_cast<size_t>(n)) : nullptr;
  int64_t* const slot_base = scratch && !dense && !touched ? kept.slot_base.get(static_cast<size_t>(words)) : nullptr;
  if (scratch) {
    int64_t slots = n;
    if (slot_base != nullptr && dealt) {
      slots = k / 2 + 1;  // the second thread's slots from half the first's entries: a slot takes two
    } else if (slot_base != nullptr) {
      slots = 0;
      for (int64_t i = 0; i < words; ++i) {
        slot_base[i] = slots;
        slots += popcount64(bits[i]);
      }
    }
    // Threads that split the columns share each scratch row: its rows and the split points (at
    // kColumnAlign columns) start on cache lines, or the lines at the split ping-pong between the
    // cores (N = 33, K = 32768, D = 128 bf16 took 2-3.5x longer on two threads than on one).
    constexpr int64_t kLine = 64 / sizeof(float);
    job.scratch_stride = split_columns ? (d + kLine - 1) / kLine * kLine : d;
    const size_t floats = static_cast<size_t>(slots * job.scratch_stride + kLine);  // room to align
    auto on_line = [](float* p) { return p + (kLine - (reinterpret_cast<uintptr_t>(p) / sizeof(float)) % kLine) % kLine; };
    job.scratch = on_line(kept.acc.get(floats));  // the copy in fills every slot that is read
    if (exact) job.scratch_orig = on_line(kept.snapshot.get(floats));
    job.slot_bits = bits;
    job.slot_base = slot_base;
    job.mark_rows = marks;
    if (touched) job.touched = seen;
  }
  const KernelTable& kt = active_kernels();
  const AddDirectFn add = scratch ? kt.scratch_add[di][weighted][i64] : kt.direct[di][weighted][i64];
  const ScratchFn copy = scratch ? kt.scratch_copy[di] : nullptr;

  // Marks (bytes of 0 or 1) to the bitmap `seen`, words [w0, w1) (rows of whole words: a row
  // split of bf16/fp16, the only rows with marks, cuts blocks of 64 rows, block_shift_for).
  auto marks_to_seen = [&](int64_t w0, int64_t w1) {
    for (int64_t wd = w0; wd < w1; ++wd) {
      uint64_t word = 0;
      if (__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ && (wd + 1) * 64 <= n) {
        // Eight marks at a time: the multiply moves byte j's bit to bit 56 + j with no carries,
        // since every partial product lands on a bit of its own.
        for (int g = 0; g < 8; ++g) {
          uint64_t eight;
          std::memcpy(&eight, marks + wd * 64 + g * 8, 8);
          word |= ((eight * 0x0102040810204080ull) >> 56) << (8 * g);
        }
      } else {
        for (int64_t b = 0, r = wd * 64; r < n; ++b, ++r) word |= uint64_t(marks[r]) << b;
      }
      seen[wd] = word;
    }
  };
  const uint64_t* const back_rows = exact ? nullptr : dense || touched ? seen : bits;

  // A walk on one thread: the scratch's copies, in and back, still divide by rows over the
  // threads their bytes pay for. bf16 D = 1, N = K = 100k (dense), 2 threads, medians of 15 calls:
  // 0.35-0.37 -> 0.27-0.29 ms (index_add_ 0.49-0.53 ms).
  if (nt == 1 && scratch) {
    const double copy_bytes = static_cast<double>(touched ? k : dense ? n : scan.repeated) * static_cast<double>(d) *
                              static_cast<double>(es + sizeof(float)) * 2.0;
    const int ct = std::min<int64_t>(threads_for(o, copy_bytes), std::max<int64_t>(1, words));
    if (ct > 1) {
      if (!touched) {
        parallel_run(ct, [&](int t, int nth) {
          copy(job, bits, words * t / nth, words * (t + 1) / nth, 0, d, false);
        });
      }
      add(job, 0, k, 0, d);
      parallel_run(ct, [&](int t, int nth) {
        const int64_t w0 = words * t / nth, w1 = words * (t + 1) / nth;
        if (marks != nullptr) marks_to_seen(w0, w1);
        copy(job, back_rows, w0, w1, 0, d, true);
      });
      return;
    }
  }

  // Two threads, narrow rows (direct_deals): rather than have each thread walk the whole index
  // and skip the other's entries (a mispredicted branch for about every other entry), the
  // threads first deal the entries out by owner (each half of the index), and then each walks
  // its own, in increasing source order, as the whole walk would add them.
  if (dealt) {
    const size_t rb = static_cast<size_t>(d) * es, isz = i64 ? 8 : 4;
    const size_t asz = weighted ? (out.dtype == DType::f64 ? 8 : 4) : 0;
    const int64_t cut_row = std::min(n, cut[1] << shift), half = k / 2;
    auto by_index = [&](auto f) {
      if (i64)
        f(static_cast<const int64_t*>(index.data));
      else
        f(static_cast<const int32_t*>(index.data));
    };
    // Positions: the first thread's entries in [0, k), the second's in [k, 2k), each dealt around
    // its middle (the first half of the index downward from it, the second half upward), so that
    // no pass counts them first; a trash slot per half at 2k and 2k + 1.
    const size_t entries = static_cast<size_t>(2 * k + 2);
    auto lined = [](size_t bytes) { return (bytes + 63) / 64 * 64; };
    const size_t ids_bytes = lined(entries * isz), rows_bytes = lined(entries * rb);
    unsigned char* const base = reinterpret_cast<unsigned char*>(
        kept.parts.get((ids_bytes + rows_bytes + lined(entries * asz)) / sizeof(uint64_t)));
    const DealJob dj{index.data, static_cast<const unsigned char*>(src.data), static_cast<size_t>(src.row_stride) * es,
                     rb, static_cast<const unsigned char*>(w), asz, cut_row, o.ignore_index.has_value(),
                     o.ignore_index.value_or(0), base, base + ids_bytes, base + ids_bytes + rows_bytes};
    // ends[h]: after half h, each thread's next position (below its first, for the first half).
    DealEnds ends[2];
    auto deal = [&](int h) {
      if (h == 0)
        ends[0] = kt.deal[i64][1](dj, 0, half, half - 1, k + half - 1, 2 * k);
      else
        ends[1] = kt.deal[i64][0](dj, half, k, half, k + half, 2 * k + 1);
    };
    job.index = dj.ids;
    job.src = dj.rows;
    job.src_stride = d;
    if (weighted) job.w = dj.ws;
    job.has_ignore = false;  // dealt out already
    SpinBarrier dealt_out;
    parallel_run(2, [&](int t, int nth) {
      for (int h = t; h < 2; h += nth) deal(h);
      dealt_out.arrive_and_wait(nth);
      const int64_t from[2][2] = {{ends[0].p0 + 1, ends[1].p0}, {ends[0].p1 + 1, ends[1].p1}};
      for (int b = t; b < 2; b += nth) {
        DirectJob mine = job;
        mine.row_lo = b == 0 ? 0 : cut_row;
        mine.row_hi = b == 0 ? cut_row : n;
        mine.every_entry = false;
        if (mine.row_lo >= mine.row_hi) continue;
        const int64_t w0 = mine.row_lo >> 6, w1 = (mine.row_hi + 63) >> 6;
        const int64_t i0 = from[b][0], i1 = from[b][1];
        AddDirectFn walk = add;
        if (sparse) {  // the rows of this thread met twice or more; its slots after half the first's entries
          by_index([&](const auto* idx) {
            const auto* ids = reinterpret_cast<decltype(idx)>(dj.ids);
            for (int64_t i = i0; i < i1; ++i) {
              const uint64_t r = static_cast<uint64_t>(ids[i]), bit = uint64_t(1) << (r & 63);
              bits[r >> 6] |= seen[r >> 6] & bit;
              seen[r >> 6] |= bit;
            }
          });
          const int64_t first_slot = b == 0 ? 0 : (from[0][1] - from[0][0]) / 2;
          int64_t slot = first_slot;
          for (int64_t wd = w0; wd < w1; ++wd) {
            slot_base[wd] = slot;
            slot += popcount64(bits[wd]);
          }
          if (slot == first_slot) walk = kt.direct[di][weighted][i64];  // no row repeats: added in place
        }
        const bool slots = scratch && walk == add;
        if (slots && !touched) copy(mine, bits, w0, w1, 0, d, false);
        if (i1 > i0) walk(mine, i0, i1, 0, d);
        if (marks != nullptr) marks_to_seen(w0, w1);
        if (slots) copy(mine, back_rows, w0, w1, 0, d, true);
      }
    });
    return;
  }

  // A row split's in-place walk over rows of the width, and into an out of the size, where
  // compacting pays.
  const bool compact = split_rows && !scratch && direct_compacts({n, k, d, out.dtype});
  parallel_run(nt, [&](int t, int nth) {
    DirectJob mine = job;
    int64_t c0 = 0, c1 = d, w0 = 0, w1 = words;
    if (split_columns) {
      const int64_t align = CpuPolicy::kColumnAlign;
      c0 = std::min(d, (d * t / nth + align - 1) / align * align);
      c1 = t + 1 == nth ? d : std::min(d, (d * (t + 1) / nth + align - 1) / align * align);
      if (c0 >= c1) return;
    } else if (split_rows) {
      // Runs only as the thread count it was cut for; otherwise one thread does every row.
      if (nth != nt) {
        if (t != 0) return;
      } else {
        mine.row_lo = std::min(n, cut[static_cast<size_t>(t)] << shift);
        mine.row_hi = std::min(n, cut[static_cast<size_t>(t) + 1] << shift);
        mine.every_entry = false;  // the other threads' entries are skipped
        if (mine.row_lo >= mine.row_hi) return;
        mine.compact = compact;
        w0 = mine.row_lo >> 6;
        w1 = (mine.row_hi + 63) >> 6;
      }
    }
    if (scratch) {
      mine.scratch = static_cast<float*>(job.scratch) + c0;
      if (job.scratch_orig != nullptr) mine.scratch_orig = static_cast<float*>(job.scratch_orig) + c0;
      if (!touched) copy(mine, bits, w0, w1, c0, c1, false);
    }
    add(mine, 0, k, c0, c1);
    if (marks != nullptr) marks_to_seen(w0, w1);  // this thread's rows
    if (scratch) copy(mine, back_rows, w0, w1, c0, c1, true);
  });
}

}  // namespace cpu
}  // namespace scatter_add
