// The public entry points: validate every argument (nothing is written before all checks pass),
// build or take a plan, then run the row kernels of the active ISA over a balanced split of the
// plan. Each output element is owned by exactly one thread and its contributions are summed in
// source order, so the result does not depend on the thread count.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "convert.h"
#include "dispatch.h"
#include "index_check.h"
#include "parallel.h"
#include "policy.h"
#include "scatter_add/scatter_add.h"

namespace scatter_add {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
  }
  return "unknown";
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16:
    case DType::f16: return 2;
  }
  return 0;
}

namespace {

using cpu::CpuPolicy;

std::atomic<int> g_num_threads{0};

int hardware_threads() {
  const unsigned h = std::thread::hardware_concurrency();
  return h == 0 ? 1 : static_cast<int>(h);
}

[[noreturn]] void fail(const char* op, Error::Kind kind, const std::string& msg) {
  throw Error(kind, std::string(op) + ": " + msg);
}

bool valid_dtype(DType t) { return static_cast<unsigned>(t) <= 3u; }

std::string shape_str(int64_t rows, int64_t cols) {
  return "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
}

// Byte range [begin, end) covered by a matrix view; empty views cover nothing.
struct Span {
  uintptr_t begin = 0, end = 0;
};
Span span_of(const void* data, int64_t rows, int64_t cols, int64_t stride, size_t es) {
  if (data == nullptr || rows <= 0 || cols <= 0) return {};
  const uintptr_t b = reinterpret_cast<uintptr_t>(data);
  return {b, b + static_cast<uintptr_t>((rows - 1) * stride + cols) * es};
}
bool overlaps(Span a, Span b) { return a.begin < a.end && b.begin < b.end && a.begin < b.end && b.begin < a.end; }

void check_view(const char* op, const char* name, const void* data, int64_t rows, int64_t cols,
                int64_t stride, DType dtype, bool writable) {
  if (!valid_dtype(dtype))
    fail(op, Error::Kind::value,
         std::string(name) + " has an unknown dtype code " + std::to_string(static_cast<int>(dtype)));
  if (rows < 0 || cols < 0)
    fail(op, Error::Kind::value, std::string(name) + " has a negative shape " + shape_str(rows, cols));
  if (stride < 0)
    fail(op, Error::Kind::value,
         std::string(name) + " has a negative row stride " + std::to_string(stride));
  if (writable && rows > 1 && stride < cols)
    fail(op, Error::Kind::value,
         std::string(name) + " row stride " + std::to_string(stride) +
             " is smaller than its row length " + std::to_string(cols) + " (rows would alias)");
  if (data == nullptr && rows > 0 && cols > 0)
    fail(op, Error::Kind::value,
         std::string(name) + " is null but has shape " + shape_str(rows, cols));
}

void check_index(const char* op, const IndexVector& index, int64_t k_expected, const char* rows_of) {
  if (index.type != IndexType::i32 && index.type != IndexType::i64)
    fail(op, Error::Kind::value,
         "index must be int32 or int64, got type code " + std::to_string(static_cast<int>(index.type)));
  if (index.size != k_expected)
    fail(op, Error::Kind::value,
         "index has " + std::to_string(index.size) + " entries but " + rows_of + " has " +
             std::to_string(k_expected) + " rows");
  if (index.data == nullptr && index.size > 0)
    fail(op, Error::Kind::value, "index is null but has " + std::to_string(index.size) + " entries");
}

void check_weight(const char* op, const WeightVector& w, int64_t k) {
  if (w.data == nullptr) return;
  if (!valid_dtype(w.dtype))
    fail(op, Error::Kind::value,
         "weight has an unknown dtype code " + std::to_string(static_cast<int>(w.dtype)));
  if (w.size != k)
    fail(op, Error::Kind::value,
         "weight has " + std::to_string(w.size) + " entries but index has " + std::to_string(k));
}

double weight_at(const WeightVector& w, int64_t i) {
  switch (w.dtype) {
    case DType::f32: return static_cast<const float*>(w.data)[i];
    case DType::f64: return static_cast<const double*>(w.data)[i];
    case DType::bf16: return cpu::bf16_to_f32(static_cast<const uint16_t*>(w.data)[i]);
    case DType::f16: return cpu::f16_to_f32(static_cast<const uint16_t*>(w.data)[i]);
  }
  return 1.0;
}

// Weights as the accumulator type of `data` (double for f64, float otherwise), indexed by source
// id. Returns the caller's buffer untouched when it already has that type.
const void* weights_as_acc(const WeightVector& w, DType data, std::vector<float>* f,
                           std::vector<double>* d) {
  if (w.data == nullptr) return nullptr;
  const DType acc = data == DType::f64 ? DType::f64 : DType::f32;
  if (w.dtype == acc) return w.data;
  if (acc == DType::f64) {
    d->resize(static_cast<size_t>(w.size));
    for (int64_t i = 0; i < w.size; ++i) (*d)[static_cast<size_t>(i)] = weight_at(w, i);
    return d->data();
  }
  f->resize(static_cast<size_t>(w.size));
  for (int64_t i = 0; i < w.size; ++i)
    (*f)[static_cast<size_t>(i)] = static_cast<float>(weight_at(w, i));
  return f->data();
}

int threads_for(const Options& o, double bytes) {
  int t = o.num_threads > 0 ? o.num_threads : get_num_threads();
  const double by_size = bytes / static_cast<double>(CpuPolicy::kMinBytesPerThread);
  if (by_size < t) t = std::max(1, static_cast<int>(by_size));
  return t;
}

// A position in the plan's work: row r of the plan (0..R) and a column inside it.
struct Pos {
  int64_t row, col;
};

// Splits a plan into equal shares of cost, where row r costs (count_r + row_cost) row-transfers
// and split points inside a row fall on kColumnAlign columns.
class Splitter {
 public:
  Splitter(const Plan& plan, int64_t cols, int64_t row_cost)
      : off_(plan.offsets()), r_(plan.num_distinct()), cols_(cols), row_cost_(row_cost) {}
  int64_t total() const { return off_[static_cast<size_t>(r_)] + row_cost_ * r_; }
  int64_t prefix(int64_t r) const { return off_[static_cast<size_t>(r)] + row_cost_ * r; }
  Pos locate(int64_t p) const {
    if (p >= total()) return {r_, 0};
    int64_t lo = 0, hi = r_;  // invariant: prefix(lo) <= p < prefix(hi)
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (prefix(mid) <= p ? lo : hi) = mid;
    }
    const unsigned __int128 num = static_cast<unsigned __int128>(p - prefix(lo)) * cols_;
    int64_t col = static_cast<int64_t>(num / static_cast<unsigned __int128>(prefix(lo + 1) - prefix(lo)));
    col -= col % CpuPolicy::kColumnAlign;
    return {lo, col};
  }
  // Calls f(plan_row, c0, c1) for every piece of thread t's share out of n.
  template <class F>
  void for_share(int t, int n, F&& f) const {
    const int64_t tot = total();
    const Pos b = locate(static_cast<int64_t>(static_cast<unsigned __int128>(tot) * t / n));
    const Pos e = locate(static_cast<int64_t>(static_cast<unsigned __int128>(tot) * (t + 1) / n));
    for (int64_t r = b.row; r <= e.row && r < r_; ++r) {
      const int64_t c0 = r == b.row ? b.col : 0;
      const int64_t c1 = r == e.row ? e.col : cols_;
      if (c0 < c1) f(r, c0, c1);
    }
  }

 private:
  const std::vector<int64_t>& off_;
  int64_t r_, cols_, row_cost_;
};

void check_add_args(const char* op, const Matrix& out, const ConstMatrix& src,
                    const WeightVector& weight, int64_t k, const void* index_data,
                    size_t index_bytes) {
  check_view(op, "out", out.data, out.rows, out.cols, out.row_stride, out.dtype, true);
  check_view(op, "src", src.data, src.rows, src.cols, src.row_stride, src.dtype, false);
  if (src.dtype != out.dtype)
    fail(op, Error::Kind::value,
         std::string("src dtype ") + dtype_name(src.dtype) + " does not match out dtype " +
             dtype_name(out.dtype));
  if (src.rows != k)
    fail(op, Error::Kind::value,
         "src has " + std::to_string(src.rows) + " rows but index has " + std::to_string(k) + " entries");
  if (src.cols != out.cols)
    fail(op, Error::Kind::value,
         "src has " + std::to_string(src.cols) + " columns but out has " + std::to_string(out.cols));
  check_weight(op, weight, k);
  const size_t es = dtype_size(out.dtype);
  const Span o = span_of(out.data, out.rows, out.cols, out.row_stride, es);
  if (overlaps(o, span_of(src.data, src.rows, src.cols, src.row_stride, es)))
    fail(op, Error::Kind::value, "src memory overlaps out (in-place aliasing is not supported)");
  if (overlaps(o, span_of(index_data, 1, static_cast<int64_t>(index_bytes), 0, 1)))
    fail(op, Error::Kind::value, "index memory overlaps out");
  if (weight.data != nullptr &&
      overlaps(o, span_of(weight.data, 1, weight.size, 0, dtype_size(weight.dtype))))
    fail(op, Error::Kind::value, "weight memory overlaps out");
}

void run_add(const Matrix& out, const Plan& plan, const ConstMatrix& src, const WeightVector& weight,
             const Options& options) {
  const int64_t d = out.cols;
  if (plan.num_distinct() == 0 || d == 0) return;
  std::vector<float> wf;
  std::vector<double> wd;
  const void* w = weights_as_acc(weight, out.dtype, &wf, &wd);
  const cpu::AddRowFn fn = cpu::active_kernels().add[static_cast<int>(out.dtype)][w != nullptr];
  const Splitter split(plan, d, CpuPolicy::kRowCost);
  const size_t es = dtype_size(out.dtype);
  const int nt = threads_for(options, static_cast<double>(split.total()) * d * es);
  char* out_base = static_cast<char*>(out.data);
  const int64_t* rows = plan.rows().data();
  const int64_t* off = plan.offsets().data();
  const int64_t* srcs = plan.sources().data();
  cpu::parallel_run(nt, [&](int t, int n) {
    split.for_share(t, n, [&](int64_t r, int64_t c0, int64_t c1) {
      void* row = out_base + static_cast<size_t>(rows[r] * out.row_stride) * es;
      fn(row, src.data, src.row_stride, srcs + off[r], off[r + 1] - off[r], w, c0, c1);
    });
  });
}

void check_gather_args(const char* op, const Matrix& dst, const ConstMatrix& x,
                       const WeightVector& weight, const void* index_data, size_t index_bytes) {
  check_view(op, "dst", dst.data, dst.rows, dst.cols, dst.row_stride, dst.dtype, true);
  check_view(op, "x", x.data, x.rows, x.cols, x.row_stride, x.dtype, false);
  if (x.dtype != dst.dtype)
    fail(op, Error::Kind::value,
         std::string("x dtype ") + dtype_name(x.dtype) + " does not match dst dtype " +
             dtype_name(dst.dtype));
  if (x.cols != dst.cols)
    fail(op, Error::Kind::value,
         "x has " + std::to_string(x.cols) + " columns but dst has " + std::to_string(dst.cols));
  check_weight(op, weight, dst.rows);
  const size_t es = dtype_size(dst.dtype);
  const Span o = span_of(dst.data, dst.rows, dst.cols, dst.row_stride, es);
  if (overlaps(o, span_of(x.data, x.rows, x.cols, x.row_stride, es)))
    fail(op, Error::Kind::value, "x memory overlaps dst");
  if (overlaps(o, span_of(index_data, 1, static_cast<int64_t>(index_bytes), 0, 1)))
    fail(op, Error::Kind::value, "index memory overlaps dst");
  if (weight.data != nullptr &&
      overlaps(o, span_of(weight.data, 1, weight.size, 0, dtype_size(weight.dtype))))
    fail(op, Error::Kind::value, "weight memory overlaps dst");
}

// Copies (or scales) columns [c0, c1) of x row `from` into dst row `to`; from < 0 writes zeros.
struct RowCopier {
  const Matrix& dst;
  const ConstMatrix& x;
  const WeightVector& weight;
  cpu::ScaleRowFn scale;
  size_t es;
  void operator()(int64_t to, int64_t from, int64_t c0, int64_t c1) const {
    char* d = static_cast<char*>(dst.data) + static_cast<size_t>(to * dst.row_stride + c0) * es;
    const size_t n = static_cast<size_t>(c1 - c0) * es;
    if (from < 0) {
      std::memset(d, 0, n);
      return;
    }
    const char* s = static_cast<const char*>(x.data) + static_cast<size_t>(from * x.row_stride + c0) * es;
    if (weight.data == nullptr) {
      std::memcpy(d, s, n);
    } else {
      scale(d, s, weight_at(weight, to), 0, c1 - c0);
    }
  }
};

template <class I>
void run_gather(const RowCopier& copy, const I* idx, int64_t k, int64_t d,
                std::optional<int64_t> ignore, const Options& options) {
  const int nt = threads_for(options, 2.0 * static_cast<double>(k) * d * copy.es);
  cpu::parallel_run(nt, [&](int t, int n) {
    const int64_t b = k * t / n, e = k * (t + 1) / n;
    for (int64_t i = b; i < e; ++i) {
      const int64_t v = static_cast<int64_t>(idx[i]);
      copy(i, (ignore && v == *ignore) ? -1 : v, 0, d);
    }
  });
}

// A plan must match the [N, D] operand's rows, the [K, D] operand's rows and ignore_index.
void check_plan(const char* op, const Plan& plan, int64_t n, const char* n_name, int64_t k,
                const char* k_name, const Options& options) {
  if (plan.num_rows() != n)
    fail(op, Error::Kind::value,
         "plan was built for " + std::to_string(plan.num_rows()) + " rows but " + n_name + " has " +
             std::to_string(n));
  if (plan.num_entries() != k)
    fail(op, Error::Kind::value,
         "plan was built for " + std::to_string(plan.num_entries()) + " entries but " + k_name +
             " has " + std::to_string(k) + " rows");
  if (options.ignore_index && options.ignore_index != plan.ignore_index())
    fail(op, Error::Kind::value,
         "ignore_index = " + std::to_string(*options.ignore_index) +
             " differs from the plan's ignore_index");
}

}  // namespace

void set_num_threads(int n) { g_num_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

int get_num_threads() {
  const int n = g_num_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : hardware_threads();
}

void index_add_rows(const Matrix& out, const IndexVector& index, const ConstMatrix& src,
                    const WeightVector& weight, const Options& options) {
  const char* op = "index_add_rows";
  check_index(op, index, src.rows, "src");
  const size_t ib = static_cast<size_t>(index.size) * (index.type == IndexType::i32 ? 4 : 8);
  check_add_args(op, out, src, weight, index.size, index.data, ib);
  if (index.size == 0) return;
  Plan plan;
  try {
    plan.rebuild(index, out.rows, options.ignore_index);
  } catch (const Error& e) {
    fail(op, e.kind(), e.what());
  }
  run_add(out, plan, src, weight, options);
}

void index_add_rows(const Matrix& out, const Plan& plan, const ConstMatrix& src,
                    const WeightVector& weight, const Options& options) {
  const char* op = "index_add_rows";
  check_plan(op, plan, out.rows, "out", src.rows, "src", options);
  check_add_args(op, out, src, weight, plan.num_entries(), nullptr, 0);
  run_add(out, plan, src, weight, options);
}

void gather_rows(const Matrix& dst, const ConstMatrix& x, const IndexVector& index,
                 const WeightVector& weight, const Options& options) {
  const char* op = "gather_rows";
  check_index(op, index, dst.rows, "dst");
  const size_t ib = static_cast<size_t>(index.size) * (index.type == IndexType::i32 ? 4 : 8);
  check_gather_args(op, dst, x, weight, index.data, ib);
  if (index.size == 0) return;
  const RowCopier copy{dst, x, weight, cpu::active_kernels().scale[static_cast<int>(dst.dtype)],
                       dtype_size(dst.dtype)};
  if (index.type == IndexType::i32) {
    const auto* idx = static_cast<const int32_t*>(index.data);
    try {
      cpu::check_index_values(idx, index.size, x.rows, options.ignore_index, nullptr, nullptr);
    } catch (const Error& e) {
      fail(op, e.kind(), e.what());
    }
    if (dst.cols > 0) run_gather(copy, idx, index.size, dst.cols, options.ignore_index, options);
  } else {
    const auto* idx = static_cast<const int64_t*>(index.data);
    try {
      cpu::check_index_values(idx, index.size, x.rows, options.ignore_index, nullptr, nullptr);
    } catch (const Error& e) {
      fail(op, e.kind(), e.what());
    }
    if (dst.cols > 0) run_gather(copy, idx, index.size, dst.cols, options.ignore_index, options);
  }
}

void gather_rows(const Matrix& dst, const ConstMatrix& x, const Plan& plan,
                 const WeightVector& weight, const Options& options) {
  const char* op = "gather_rows";
  check_plan(op, plan, x.rows, "x", dst.rows, "dst", options);
  check_gather_args(op, dst, x, weight, nullptr, 0);
  const int64_t d = dst.cols;
  if (plan.num_entries() == 0 || d == 0) return;
  const RowCopier copy{dst, x, weight, cpu::active_kernels().scale[static_cast<int>(dst.dtype)],
                       dtype_size(dst.dtype)};
  // Each x row is read once and written to all its destinations: cost = count + 1 per row.
  const Splitter split(plan, d, 1);
  const int nt = threads_for(options, static_cast<double>(split.total()) * d * copy.es);
  const int64_t* rows = plan.rows().data();
  const int64_t* off = plan.offsets().data();
  const int64_t* srcs = plan.sources().data();
  const std::vector<int64_t>& ign = plan.ignored();
  const int64_t ni = static_cast<int64_t>(ign.size());
  cpu::parallel_run(nt, [&](int t, int n) {
    split.for_share(t, n, [&](int64_t r, int64_t c0, int64_t c1) {
      for (int64_t j = off[r]; j < off[r + 1]; ++j) copy(srcs[j], rows[r], c0, c1);
    });
    for (int64_t j = ni * t / n; j < ni * (t + 1) / n; ++j) copy(ign[static_cast<size_t>(j)], -1, 0, d);
  });
}

}  // namespace scatter_add
