// Argument checks (see validate.h) and views_may_overlap. Compiled without ISA flags: the index
// pass of every call runs in the active level's kernels (KernelTable::index_check).
#include "validate.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <type_traits>

#include "dispatch.h"

namespace scatter_add {

namespace {

bool valid_dtype(DType t) { return static_cast<unsigned>(t) <= 3u; }

std::string shape_str(int64_t rows, int64_t cols) {
  return "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
}

// The bytes a view touches: `rows` runs of `width` bytes, `stride` bytes apart, from `base`.
// end is one past the last byte. Built only from views that passed check_view, whose byte extent
// fits in the address space.
struct ByteView {
  uintptr_t base = 0;
  int64_t rows = 0, width = 0, stride = 0;
  uintptr_t end() const { return base + static_cast<uintptr_t>((rows - 1) * stride + width); }
  bool empty() const { return base == 0 || rows <= 0 || width <= 0; }
};

ByteView bytes_of(const void* data, int64_t rows, int64_t cols, int64_t stride, size_t es) {
  const int64_t e = static_cast<int64_t>(es);
  return {reinterpret_cast<uintptr_t>(data), rows, cols * e, rows > 1 ? stride * e : 0};
}

// Does row i of `v` (for some i in [0, v.rows)) meet the byte range [lo, hi)?
bool rows_meet_range(const ByteView& v, uintptr_t lo, uintptr_t hi) {
  if (v.rows == 1 || v.stride == 0) return v.base < hi && lo < v.base + static_cast<uintptr_t>(v.width);
  // Row i covers [base + i*s, base + i*s + w): it meets [lo, hi) iff base + i*s < hi and
  // base + i*s + w > lo, i.e. i in (lo - w - base) / s .. (hi - 1 - base) / s.
  const __int128 s = v.stride, b = static_cast<__int128>(v.base), w = v.width;
  __int128 i_lo = static_cast<__int128>(lo) - w - b + 1;  // smallest i*s allowed
  i_lo = i_lo <= 0 ? 0 : (i_lo + s - 1) / s;
  __int128 top = static_cast<__int128>(hi) - 1 - b;  // largest i*s allowed
  if (top < 0) return false;
  const __int128 i_hi = std::min<__int128>(top / s, v.rows - 1);
  return i_lo <= i_hi;
}

bool may_overlap(const ByteView& a, const ByteView& b) {
  if (a.empty() || b.empty()) return false;
  if (!(a.base < b.end() && b.base < a.end())) return false;  // byte ranges apart
  if (a.rows == 1 || a.stride == 0) return rows_meet_range(b, a.base, a.base + static_cast<uintptr_t>(a.width));
  if (b.rows == 1 || b.stride == 0) return rows_meet_range(a, b.base, b.base + static_cast<uintptr_t>(b.width));
  if (a.stride != b.stride || a.width > a.stride || b.width > b.stride) return true;  // undecided
  // Same stride s: with b.base - a.base = q*s + r (0 <= r < s), row j of b starts r bytes into
  // row j + q of a; it meets that row when r < a.width and the next one when r + b.width > s.
  const __int128 s = a.stride;
  const __int128 diff = static_cast<__int128>(b.base) - static_cast<__int128>(a.base);
  __int128 q = diff / s, r = diff % s;
  if (r < 0) {
    r += s;
    q -= 1;
  }
  auto rows_pair = [&](__int128 shift) {  // some j in [0, b.rows) with j + shift in [0, a.rows)
    const __int128 lo = std::max<__int128>(0, -shift), hi = std::min<__int128>(b.rows, a.rows - shift);
    return lo < hi;
  };
  return (r < a.width && rows_pair(q)) || (r + b.width > s && rows_pair(q + 1));
}

// The kernels load whole elements: a pointer must be aligned to its element size.
void check_aligned(const char* op, const char* name, const void* data, int64_t es) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(data);
  if (p % static_cast<uintptr_t>(es) != 0)
    cpu::fail(op, Error::Kind::value,
              std::string(name) + " data pointer is not aligned to its element size of " + std::to_string(es) +
                  " bytes (address ends in 0x" + [&] {
                    char buf[8];
                    std::snprintf(buf, sizeof buf, "%x", static_cast<unsigned>(p & 0xF));
                    return std::string(buf);
                  }() + ")");
}

void check_view(const char* op, const char* name, const void* data, int64_t rows, int64_t cols,
                int64_t stride, DType dtype, bool writable) {
  if (!valid_dtype(dtype))
    cpu::fail(op, Error::Kind::value,
              std::string(name) + " has an unknown dtype code " + std::to_string(static_cast<int>(dtype)));
  if (rows < 0 || cols < 0)
    cpu::fail(op, Error::Kind::value, std::string(name) + " has a negative shape " + shape_str(rows, cols));
  if (stride < 0)
    cpu::fail(op, Error::Kind::value,
              std::string(name) + " has a negative row stride " + std::to_string(stride));
  if (writable && rows > 1 && stride < cols)
    cpu::fail(op, Error::Kind::value,
              std::string(name) + " row stride " + std::to_string(stride) +
                  " is smaller than its row length " + std::to_string(cols) + " (rows would alias)");
  if (data == nullptr && rows > 0 && cols > 0)
    cpu::fail(op, Error::Kind::value,
              std::string(name) + " is null but has shape " + shape_str(rows, cols));
  if (rows == 0 || cols == 0) return;
  // (rows - 1) * stride + cols elements of es bytes must fit in the address space from data.
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  check_aligned(op, name, data, es);
  int64_t span = 0, bytes = 0;
  const bool overflow = __builtin_mul_overflow(rows - 1, rows > 1 ? stride : 0, &span) ||
                        __builtin_add_overflow(span, cols, &span) ||
                        __builtin_mul_overflow(span, es, &bytes) ||
                        reinterpret_cast<uintptr_t>(data) > std::numeric_limits<uintptr_t>::max() -
                                                              static_cast<uintptr_t>(bytes);
  if (overflow)
    cpu::fail(op, Error::Kind::value,
              std::string(name) + " of shape " + shape_str(rows, cols) + " with row stride " +
                  std::to_string(stride) + " spans more memory than the address space");
}

void check_weight(const char* op, const WeightVector& w, int64_t k) {
  if (w.data == nullptr) return;
  if (!valid_dtype(w.dtype))
    cpu::fail(op, Error::Kind::value,
              "weight has an unknown dtype code " + std::to_string(static_cast<int>(w.dtype)));
  if (w.size != k)
    cpu::fail(op, Error::Kind::value,
              "weight has " + std::to_string(w.size) + " entries but index has " + std::to_string(k));
  if (k > 0) check_aligned(op, "weight", w.data, static_cast<int64_t>(dtype_size(w.dtype)));
}

// `other` (index or weight bytes, a one-row view) must not share a byte with the output view.
void check_vector_overlap(const char* op, const ByteView& out, const void* data, int64_t bytes,
                          const char* what, const char* out_name) {
  if (may_overlap(out, {reinterpret_cast<uintptr_t>(data), 1, bytes, 0}))
    cpu::fail(op, Error::Kind::value, std::string(what) + " memory overlaps " + out_name);
}

template <class I>
[[noreturn]] void throw_bad_index(const I* idx, int64_t k, int64_t n, std::optional<int64_t> ignore) {
  for (int64_t i = 0; i < k; ++i) {
    const int64_t v = static_cast<int64_t>(idx[i]);
    if ((ignore && v == *ignore) || (v >= 0 && v < n)) continue;
    std::string msg = "index[" + std::to_string(i) + "] = " + std::to_string(v) +
                      " is out of range for " + std::to_string(n) + " rows (valid: 0.." +
                      std::to_string(n - 1) + ")";
    if (ignore) msg += " and is not ignore_index = " + std::to_string(*ignore);
    throw Error(Error::Kind::index, msg);
  }
  throw Error(Error::Kind::index, "index has a value out of range");  // not reached
}

template <class I>
cpu::IndexScan scan(const I* idx, int64_t k, int64_t n, std::optional<int64_t> ignore,
                    uint64_t* seen, uint64_t* repeated, int64_t* block_counts, int shift, bool want_sorted) {
  cpu::IndexScan s;
  const bool has_ignore = ignore.has_value();
  const int64_t ign = has_ignore ? *ignore : 0;
  const uint64_t un = static_cast<uint64_t>(n);
  int64_t ignored = 0;
  if (seen == nullptr && block_counts == nullptr) {
    // The common case: the active level's vectorised pass (KernelTable::index_check).
    const cpu::IndexCheck c = cpu::active_kernels().index_check[sizeof(I) == 8](idx, k, n, has_ignore, ign, want_sorted);
    if (c.bad) throw_bad_index(idx, k, n, ignore);
    s.sorted = c.sorted;
    s.kept = k - c.ignored;
    return s;
  }
  if (want_sorted) {
    unsigned descents = 0;
    for (int64_t i = 1; i < k; ++i) descents |= idx[i - 1] > idx[i];
    s.sorted = descents == 0;
  }
  for (int64_t i = 0; i < k; ++i) {
    const int64_t v = static_cast<int64_t>(idx[i]);
    if (has_ignore && v == ign) {
      ++ignored;
      continue;
    }
    if (static_cast<uint64_t>(v) >= un) throw_bad_index(idx, k, n, ignore);
    if (seen != nullptr) {
      uint64_t& word = seen[v >> 6];
      const uint64_t m = uint64_t(1) << (v & 63);
      // No branch on "met before": a power-law index repeats rows at random, which a branch
      // mispredicts.
      if (repeated != nullptr) repeated[v >> 6] |= word & m;
      word |= m;
    }
    if (block_counts != nullptr) ++block_counts[v >> shift];
  }
  s.kept = k - ignored;
  if (repeated != nullptr)
    for (int64_t w = 0; w < (n + 63) / 64; ++w) s.repeated += cpu::popcount64(repeated[w]);
  return s;
}

// A strided view in bytes.
struct Strided {
  uintptr_t base;
  int64_t rows, cols, rs, cs, es;  // rs, cs, es in bytes
};

// Two views with the same strides and element size: element (i, j) of a meets element (i', j') of
// b when |di * rs + dj * cs - (b - a)| < es, with di = i - i' and dj = j - j' in their ranges.
// Walks the shorter of the two ranges: 1 (they meet) or 0, or -1 (undecided) beyond 2^16 steps.
int same_strides_meet(const Strided& a, const Strided& b) {
  const __int128 delta = static_cast<__int128>(b.base) - static_cast<__int128>(a.base);
  const int64_t di_lo = -(b.rows - 1), di_hi = a.rows - 1, dj_lo = -(b.cols - 1), dj_hi = a.cols - 1;
  // For a fixed value t of one difference (stride st), the other (stride so, range [lo, hi]) must
  // bring so * x within es of `rest` = delta - t * st.
  auto fits = [&](__int128 rest, int64_t so, int64_t lo, int64_t hi) {
    if (so == 0) return rest > -a.es && rest < a.es && lo <= hi;
    // x with rest - es < x * so < rest + es (so > 0).
    auto floor_div = [](__int128 p, __int128 q) { return p >= 0 ? p / q : -((-p + q - 1) / q); };
    __int128 first = floor_div(rest - a.es, so) + 1;       // smallest x with x*so > rest - es
    __int128 last = -floor_div(-(rest + a.es), so) - 1;    // largest x with x*so < rest + es
    if (first < lo) first = lo;
    if (last > hi) last = hi;
    return first <= last;
  };
  const int64_t ni = di_hi - di_lo + 1, nj = dj_hi - dj_lo + 1;
  if (std::min(ni, nj) > (int64_t(1) << 16)) return -1;
  if (nj <= ni) {
    for (int64_t dj = dj_lo; dj <= dj_hi; ++dj)
      if (fits(delta - static_cast<__int128>(dj) * a.cs, a.rs, di_lo, di_hi)) return 1;
  } else {
    for (int64_t di = di_lo; di <= di_hi; ++di)
      if (fits(delta - static_cast<__int128>(di) * a.rs, a.cs, dj_lo, dj_hi)) return 1;
  }
  return 0;
}

// A strided view as runs of contiguous bytes, when it is one: rows of contiguous elements, a
// single column, or a single row.
bool as_rows(const Strided& v, ByteView* out) {
  if (v.cs == v.es || v.cols == 1) {
    *out = {v.base, v.rows, v.cols * v.es, v.rows > 1 ? v.rs : 0};
    return true;
  }
  if (v.rows == 1) {
    *out = {v.base, v.cols, v.es, v.cols > 1 ? v.cs : 0};
    return true;
  }
  return false;
}

}  // namespace

namespace {
// Whether a view's bytes, [data, data + (rows-1)*rs*es + (cols-1)*cs*es + es), fit in the address
// space with every product in int64 range (strides >= 0, rows, cols >= 1). The public overlap
// questions take unchecked views: one that cannot exist is answered "may overlap".
bool extent_fits(const void* data, int64_t rows, int64_t cols, int64_t rs, int64_t cs, int64_t es) {
  const __int128 last = static_cast<__int128>(rows - 1) * rs * es + static_cast<__int128>(cols - 1) * cs * es + es;
  const __int128 limit = static_cast<__int128>(1) << 62;
  const __int128 rs_bytes = static_cast<__int128>(rs) * es, cs_bytes = static_cast<__int128>(cs) * es;
  return last < limit && rs_bytes < limit && cs_bytes < limit &&
         static_cast<__int128>(reinterpret_cast<uintptr_t>(data)) + last <= static_cast<__int128>(UINTPTR_MAX);
}
}  // namespace

bool views_may_overlap(const StridedView& a, const StridedView& b) {
  if (a.data == nullptr || b.data == nullptr || a.rows <= 0 || a.cols <= 0 || b.rows <= 0 || b.cols <= 0)
    return false;
  if (a.row_stride < 0 || a.col_stride < 0 || b.row_stride < 0 || b.col_stride < 0) return true;
  if (a.element_size == 0 || b.element_size == 0 || a.element_size > 64 || b.element_size > 64) return true;
  if (!extent_fits(a.data, a.rows, a.cols, a.row_stride, a.col_stride, static_cast<int64_t>(a.element_size)) ||
      !extent_fits(b.data, b.rows, b.cols, b.row_stride, b.col_stride, static_cast<int64_t>(b.element_size)))
    return true;
  const auto bytes = [](const StridedView& v) {
    const int64_t es = static_cast<int64_t>(v.element_size);
    return Strided{reinterpret_cast<uintptr_t>(v.data), v.rows, v.cols, v.row_stride * es, v.col_stride * es, es};
  };
  const Strided x = bytes(a), y = bytes(b);
  const auto end = [](const Strided& v) {
    return static_cast<__int128>(v.base) + static_cast<__int128>(v.rows - 1) * v.rs +
           static_cast<__int128>(v.cols - 1) * v.cs + v.es;
  };
  if (!(static_cast<__int128>(x.base) < end(y) && static_cast<__int128>(y.base) < end(x))) return false;
  if (x.rs == y.rs && x.cs == y.cs && x.es == y.es) {
    const int meet = same_strides_meet(x, y);
    if (meet >= 0) return meet == 1;
  }
  ByteView rx, ry;
  if (as_rows(x, &rx) && as_rows(y, &ry)) return may_overlap(rx, ry);
  return true;
}

bool views_may_overlap(const ConstMatrix& a, const ConstMatrix& b) {
  if (!valid_dtype(a.dtype) || !valid_dtype(b.dtype)) return true;
  for (const ConstMatrix* v : {&a, &b})
    if (v->data != nullptr && v->rows > 0 && v->cols > 0 &&
        (v->row_stride < 0 ||
         !extent_fits(v->data, v->rows, v->cols, v->rows > 1 ? v->row_stride : 0, 1,
                      static_cast<int64_t>(dtype_size(v->dtype)))))
      return true;
  return may_overlap(bytes_of(a.data, a.rows, a.cols, a.row_stride, dtype_size(a.dtype)),
                     bytes_of(b.data, b.rows, b.cols, b.row_stride, dtype_size(b.dtype)));
}

namespace cpu {

void fail(const char* op, Error::Kind kind, const std::string& msg) {
  throw Error(kind, std::string(op) + ": " + msg);
}

size_t index_bytes(const IndexVector& index) {
  return static_cast<size_t>(index.size) * (index.type == IndexType::i32 ? 4 : 8);
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
  if (index.size > 0) check_aligned(op, "index", index.data, index.type == IndexType::i32 ? 4 : 8);
}

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
  const ByteView o = bytes_of(out.data, out.rows, out.cols, out.row_stride, es);
  if (may_overlap(o, bytes_of(src.data, src.rows, src.cols, src.row_stride, es)))
    fail(op, Error::Kind::value, "src memory overlaps out (in-place aliasing is not supported)");
  check_vector_overlap(op, o, index_data, static_cast<int64_t>(index_bytes), "index", "out");
  if (weight.data != nullptr)
    check_vector_overlap(op, o, weight.data,
                         weight.size * static_cast<int64_t>(dtype_size(weight.dtype)), "weight", "out");
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
  const ByteView o = bytes_of(dst.data, dst.rows, dst.cols, dst.row_stride, es);
  if (may_overlap(o, bytes_of(x.data, x.rows, x.cols, x.row_stride, es)))
    fail(op, Error::Kind::value, "x memory overlaps dst");
  check_vector_overlap(op, o, index_data, static_cast<int64_t>(index_bytes), "index", "dst");
  if (weight.data != nullptr)
    check_vector_overlap(op, o, weight.data,
                         weight.size * static_cast<int64_t>(dtype_size(weight.dtype)), "weight", "dst");
}

void check_small_matmul_args(const char* op, const Matrix& y, const ConstMatrix& x, const ConstMatrix& w, bool nn) {
  check_view(op, "y", y.data, y.rows, y.cols, y.row_stride, y.dtype, true);
  check_view(op, "x", x.data, x.rows, x.cols, x.row_stride, x.dtype, false);
  check_view(op, "w", w.data, w.rows, w.cols, w.row_stride, w.dtype, false);
  const std::pair<const char*, DType> dtypes[] = {{"y", y.dtype}, {"x", x.dtype}, {"w", w.dtype}};
  for (const auto& [name, t] : dtypes)
    if (t != DType::bf16)
      fail(op, Error::Kind::value, std::string(name) + " dtype is " + dtype_name(t) + ", not bf16");
  if (nn) {
    if (x.cols != w.rows)
      fail(op, Error::Kind::value,
           "x has " + std::to_string(x.cols) + " columns but w has " + std::to_string(w.rows) + " rows");
    if (y.rows != x.rows || y.cols != w.cols)
      fail(op, Error::Kind::value,
           "y has shape " + shape_str(y.rows, y.cols) + " but x @ w has shape " + shape_str(x.rows, w.cols));
  } else {
    if (x.cols != w.cols)
      fail(op, Error::Kind::value,
           "x has " + std::to_string(x.cols) + " columns but w has " + std::to_string(w.cols));
    if (y.rows != x.rows || y.cols != w.rows)
      fail(op, Error::Kind::value,
           "y has shape " + shape_str(y.rows, y.cols) + " but x @ w.T has shape " + shape_str(x.rows, w.rows));
  }
  const ByteView o = bytes_of(y.data, y.rows, y.cols, y.row_stride, 2);
  if (may_overlap(o, bytes_of(x.data, x.rows, x.cols, x.row_stride, 2))) fail(op, Error::Kind::value, "x memory overlaps y");
  if (may_overlap(o, bytes_of(w.data, w.rows, w.cols, w.row_stride, 2))) fail(op, Error::Kind::value, "w memory overlaps y");
}

void check_small_matmul_grouped_args(const char* op, const Matrix& y, const ConstMatrix& x, const ConstMatrix& w,
                                     const int64_t* ends, int64_t groups) {
  if (groups < 1) fail(op, Error::Kind::value, "groups must be at least 1, got " + std::to_string(groups));
  if (ends == nullptr) fail(op, Error::Kind::value, "ends is null but groups = " + std::to_string(groups));
  check_view(op, "w", w.data, w.rows, w.cols, w.row_stride, w.dtype, false);
  if (w.rows % groups != 0)
    fail(op, Error::Kind::value,
         "w has " + std::to_string(w.rows) + " rows, not a multiple of groups = " + std::to_string(groups));
  const ConstMatrix first{w.data, w.rows / groups, w.cols, w.row_stride, w.dtype};
  check_small_matmul_args(op, y, x, first);
  if (may_overlap(bytes_of(y.data, y.rows, y.cols, y.row_stride, 2), bytes_of(w.data, w.rows, w.cols, w.row_stride, 2)))
    fail(op, Error::Kind::value, "w memory overlaps y");
  int64_t before = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const std::string at = "ends[" + std::to_string(g) + "] = " + std::to_string(ends[g]);
    if (ends[g] < before)
      fail(op, Error::Kind::value,
           at + (g ? " is smaller than ends[" + std::to_string(g - 1) + "] = " + std::to_string(before) : " is negative"));
    if (ends[g] > x.rows) fail(op, Error::Kind::value, at + " is past x's " + std::to_string(x.rows) + " rows");
    before = ends[g];
  }
}

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

IndexScan scan_index(const IndexVector& index, int64_t n, std::optional<int64_t> ignore,
                     uint64_t* seen, uint64_t* repeated, int64_t* block_counts, int block_shift,
                     bool want_sorted) {
  if (index.type == IndexType::i32)
    return scan(static_cast<const int32_t*>(index.data), index.size, n, ignore, seen, repeated,
                block_counts, block_shift, want_sorted);
  return scan(static_cast<const int64_t*>(index.data), index.size, n, ignore, seen, repeated,
              block_counts, block_shift, want_sorted);
}

}  // namespace cpu
}  // namespace scatter_add
