// small_matmul: y = x @ w.T in bfloat16, the products of an MoE expert: at decode sizes (a token
// or a few per expert) bound by reading w once, at prefill sizes by the float32 FMAs. The kernels
// (kernels_avx2.cpp, kernels_avx512.cpp) read each row of w once for a few rows of x, in 32- or
// 64-byte steps, and pass a tile of w rows with every row of x while it is in the cache; threads
// split the rows of w. At the scalar level nothing here runs (false): the caller multiplies as
// before.
#include <algorithm>
#include <vector>

#include "convert.h"
#include "dispatch.h"
#include "strategy.h"
#include "parallel.h"
#include "validate.h"

namespace scatter_add {

namespace {

// Threads take shares of 32 columns of y (a 64-byte line where its rows start on one), so that
// they write the same line only where they do not.
template <class Run>
void by_column_lines(const Options& options, int64_t o, double bytes, Run run) {
  const int nt = cpu::threads_for(options, bytes);
  cpu::parallel_run(nt, [&](int t, int n) {
    const int64_t lines = (o + 31) / 32;
    const int64_t o0 = std::min(o, lines * t / n * 32), o1 = std::min(o, lines * (t + 1) / n * 32);
    if (o0 < o1) run(o0, o1);
  });
}

}  // namespace

bool small_matmul(const Matrix& y, const ConstMatrix& x, const ConstMatrix& w, const Options& options) {
  cpu::check_small_matmul_args("small_matmul", y, x, w);
  const cpu::SmallMatmulFn fn = cpu::active_kernels().small_matmul;
  if (fn == nullptr) return false;
  if (y.rows == 0 || y.cols == 0) return true;
  const cpu::SmallMatmulJob job{static_cast<uint16_t*>(y.data), y.row_stride,
                                static_cast<const uint16_t*>(x.data), x.row_stride,
                                static_cast<const uint16_t*>(w.data), w.row_stride, x.rows, x.cols, nullptr};
  by_column_lines(options, w.rows, static_cast<double>(w.rows) * static_cast<double>(w.cols) * 2.0,
                  [&](int64_t o0, int64_t o1) { fn(job, o0, o1); });
  return true;
}

bool small_matmul_grouped(const Matrix& y, const ConstMatrix& x, const ConstMatrix& w, const int64_t* ends,
                          int64_t groups, const Options& options) {
  cpu::check_small_matmul_grouped_args("small_matmul_grouped", y, x, w, ends, groups);
  const cpu::SmallMatmulFn fn = cpu::active_kernels().small_matmul;
  if (fn == nullptr) return false;
  const int64_t o = w.rows / groups;
  if (y.rows == 0 || o == 0) return true;
  // The checked ends, copied: the caller's array may lie in y, which the blocks write.
  const std::vector<int64_t> end(ends, ends + groups);
  double bytes = 0;  // the weights of the blocks with rows, each read once
  for (int64_t g = 0, start = 0; g < groups; start = end[static_cast<size_t>(g++)])
    if (end[static_cast<size_t>(g)] > start) bytes += static_cast<double>(o) * static_cast<double>(w.cols) * 2.0;
  by_column_lines(options, o, bytes, [&](int64_t o0, int64_t o1) {
    for (int64_t g = 0, start = 0; g < groups; start = end[static_cast<size_t>(g++)]) {
      const int64_t stop = end[static_cast<size_t>(g)];
      if (stop == start) continue;
      const cpu::SmallMatmulJob job{static_cast<uint16_t*>(y.data) + start * y.row_stride, y.row_stride,
                                    static_cast<const uint16_t*>(x.data) + start * x.row_stride, x.row_stride,
                                    static_cast<const uint16_t*>(w.data) + g * o * w.row_stride, w.row_stride,
                                    stop - start, x.cols, nullptr};
      fn(job, o0, o1);
    }
  });
  return true;
}

bool small_matmul_nn(const Matrix& y, const ConstMatrix& x, const ConstMatrix& w, const Options& options) {
  cpu::check_small_matmul_args("small_matmul_nn", y, x, w, true);
  const cpu::SmallMatmulFn fn = cpu::active_kernels().small_matmul_nn;
  if (fn == nullptr) return false;
  if (y.rows == 0 || y.cols == 0) return true;
  // x widened once to float32 (m * h, a small share of the m * h * o products), for the
  // kernel's broadcasts
  const int64_t m = x.rows, h = x.cols;
  std::vector<float> xf(static_cast<size_t>(m * h));
  const uint16_t* xb = static_cast<const uint16_t*>(x.data);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t c = 0; c < h; ++c) xf[static_cast<size_t>(i * h + c)] = cpu::bf16_to_f32(xb[i * x.row_stride + c]);
  const cpu::SmallMatmulJob job{static_cast<uint16_t*>(y.data), y.row_stride, nullptr, x.row_stride,
                                static_cast<const uint16_t*>(w.data), w.row_stride, m, h, xf.data()};
  by_column_lines(options, w.cols,
                  static_cast<double>(w.rows) * static_cast<double>(w.cols) * 2.0 +
                      static_cast<double>(m) * static_cast<double>(w.cols) * 2.0,
                  [&](int64_t o0, int64_t o1) { fn(job, o0, o1); });
  return true;
}

}  // namespace scatter_add
