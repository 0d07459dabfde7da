// Strategy "direct": no sort. Sources are walked in increasing order and each is added into its
// destination row, so every row sees its contributions in source order.
//   float32/float64: the row itself is the accumulator (acc type == storage type).
//   bf16/fp16: rows are summed in a float32 scratch and rounded once on the way back. When
//     N <= K every row gets a slot; otherwise only the rows with several contributions do (the
//     rank of a bitmap of the N rows gives each its slot) and the others are added in place
//     (one contribution, one rounding).
//   A sorted (non-decreasing) index, any dtype: each row's contributions are one run of
//     consecutive sources, summed in registers like a planned row and rounded once, with no sort
//     and no scratch.
// Threads: each thread owns a range of columns of every row (when rows are wide enough for whole
// cache lines per thread) or, when the rows' work outweighs every thread walking the whole index,
// a range of rows, cut where the index's per-block counts balance the work; either way each output
// element has one owner and one summation order. Otherwise one thread walks alone.
#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <vector>

#include "dispatch.h"
#include "parallel.h"
#include "policy.h"
#include "strategy.h"
#include "validate.h"

namespace scatter_add {
namespace cpu {

namespace {

int block_shift_for(int64_t n) {
  int shift = 6;  // whole bitmap words per block
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
      data_.reset(new T[n]);
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
  std::unique_ptr<T[]> data_;
  size_t size_ = 0;
};

// The direct walk's buffers in this thread, released at the end of a call when they hold more
// than CpuPolicy::kKeptScratchBytes in all (or when the call throws, out of memory part way).
struct KeptScratch {
  Kept<uint64_t> seen, bits;
  Kept<int64_t> slot_base;
  Kept<float> acc, snapshot;
  Kept<uint8_t> marks;
  size_t bytes() const {
    return seen.bytes() + bits.bytes() + slot_base.bytes() + acc.bytes() + snapshot.bytes() + marks.bytes();
  }
  void release() {
    seen.release();
    bits.release();
    slot_base.release();
    acc.release();
    snapshot.release();
    marks.release();
  }
};

class KeptScratchUse {
 public:
  explicit KeptScratchUse(KeptScratch& k) : k_(k) {}
  ~KeptScratchUse() {
    if (std::uncaught_exceptions() > entered_ || k_.bytes() > static_cast<size_t>(CpuPolicy::kKeptScratchBytes)) k_.release();
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
  // Mean run length from a sample of neighbours: a run ends where a neighbour differs.
  int64_t same = 0, probes = 0;
  const int64_t step = std::max<int64_t>(1, (k - 1) / CpuPolicy::kRunSamples);
  for (int64_t i = 0; i + 1 < k; i += step, ++probes) same += value(i) == value(i + 1);
  job.long_runs = same * CpuPolicy::kLongRunSameDen >= probes * CpuPolicy::kLongRunSameNum;
  auto run_start = [&](int64_t i) {  // the first source of the run holding entry i (i <= k)
    while (i > 0 && i < k && value(i) == value(i - 1)) ++i;
    return i;
  };
  parallel_run(nt, [&](int t, int nth) {
    if (split_columns) {
      const int64_t align = CpuPolicy::kColumnAlign;
      const int64_t c0 = std::min(d, (d * t / nth + align - 1) / align * align);
      const int64_t c1 = t + 1 == nth ? d : std::min(d, (d * (t + 1) / nth + align - 1) / align * align);
      if (c0 < c1) runs(job, 0, k, c0, c1);
    } else {
      const int64_t i0 = run_start(k * t / nth), i1 = t + 1 == nth ? k : run_start(k * (t + 1) / nth);
      if (i0 < i1) runs(job, i0, i1, 0, d);
    }
  });
}

}  // namespace

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
  const bool split_columns = split.columns, split_rows = split.rows;
  const int shift = block_shift_for(n);

  if (d == 0 || first.kept == 0) return;
  if (first.sorted) {
    run_sorted(out, index, src, w, o, nt, split_columns);
    return;
  }

  // bf16/fp16: a float32 scratch. Dense (a slot per row, n <= k: every slot pays for itself)
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
  const bool dense = narrow && n <= k;
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
  IndexScan scan = first;
  if (narrow && !touched && (!dense || mark_in_pass)) scan = scan_index(index, n, o.ignore_index, seen, bits);
  // Row split: entries per block of rows, from a sample of the index (a split never changes the
  // bits, only who computes which rows, so an estimate of the balance is enough).
  std::vector<int64_t> blocks(split_rows ? static_cast<size_t>((n >> shift) + 1) : 0);
  if (split_rows) {
    const int64_t step = std::max<int64_t>(1, k / CpuPolicy::kBalanceSamples);
    auto sample = [&](const auto* idx) {
      for (int64_t i = 0; i < k; i += step) {
        const int64_t r = static_cast<int64_t>(idx[i]);
        if (r >= 0 && r < n) ++blocks[static_cast<size_t>(r >> shift)];
      }
    };
    if (i64)
      sample(static_cast<const int64_t*>(index.data));
    else
      sample(static_cast<const int32_t*>(index.data));
  }

  DirectJob job = job_for(out, index, src, w, o);
  job.row_lo = 0;
  job.row_hi = n;
  job.prefetch = prefetch;

  const bool scratch = dense || touched || (narrow && scan.repeated > 0);
  uint8_t* const marks = dense && !mark_in_pass && !exact ? kept.marks.zeroed(static_cast<size_t>(n)) : nullptr;
  int64_t* const slot_base = scratch && !dense && !touched ? kept.slot_base.get(static_cast<size_t>(words)) : nullptr;
  if (scratch) {
    int64_t slots = n;
    if (slot_base != nullptr) {
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

  // Row split: block boundaries at equal shares of the kept entries (plus one per block, so that
  // an index concentrated in few blocks still spreads the rows).
  std::vector<int64_t> cut;
  if (split_rows) {
    const int64_t nb = static_cast<int64_t>(blocks.size());
    int64_t total = 0;
    for (int64_t b = 0; b < nb; ++b) total += blocks[static_cast<size_t>(b)] + 1;
    cut.assign(static_cast<size_t>(nt) + 1, nb);
    cut[0] = 0;
    int64_t run = 0, t = 1;
    for (int64_t b = 0; b < nb && t < nt; ++b) {
      run += blocks[static_cast<size_t>(b)] + 1;
      while (t < nt && run * nt >= total * t) cut[static_cast<size_t>(t++)] = b + 1;
    }
  }

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
        if (mine.row_lo >= mine.row_hi) return;
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
    if (marks != nullptr) {  // this thread's rows (whole words: blocks are multiples of 64 rows)
      for (int64_t wd = w0; wd < w1; ++wd) {
        uint64_t word = 0;
        if (__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ && (wd + 1) * 64 <= n) {
          // Eight marks (bytes of 0 or 1) at a time: the multiply moves byte j's bit to bit 56 + j
          // with no carries, since every partial product lands on a bit of its own.
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
    }
    if (scratch) copy(mine, exact ? nullptr : dense || touched ? seen : bits, w0, w1, c0, c1, true);
  });
}

}  // namespace cpu
}  // namespace scatter_add
