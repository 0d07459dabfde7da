// small_matmul: y = x @ w.T in bfloat16, the products of an MoE expert: at decode sizes (a token
// or a few per expert) bound by reading w once, at prefill sizes by the float32 FMAs. The kernels
// (kernels_avx2.cpp, kernels_avx512.cpp) read each row of w once for a few rows of x, in 32- or
// 64-byte steps, and pass a tile of w rows with every row of x while it is in the cache; threads
// split the rows of w. At the scalar level nothing here runs (false): the caller multiplies as
// before.
#include <algorithm>

#include "dispatch.h"
#include "strategy.h"
#include "parallel.h"
#include "validate.h"

namespace scatter_add {

bool small_matmul(const Matrix& y, const ConstMatrix& x, const ConstMatrix& w, const Options& options) {
  cpu::check_small_matmul_args("small_matmul", y, x, w);
  const cpu::SmallMatmulFn fn = cpu::active_kernels().small_matmul;
  if (fn == nullptr) return false;
  if (y.rows == 0 || y.cols == 0) return true;
  const cpu::SmallMatmulJob job{static_cast<uint16_t*>(y.data), y.row_stride,
                                static_cast<const uint16_t*>(x.data), x.row_stride,
                                static_cast<const uint16_t*>(w.data), w.row_stride, x.rows, x.cols};
  const int64_t o = w.rows;
  const int nt = cpu::threads_for(options, static_cast<double>(o) * static_cast<double>(w.cols) * 2.0);
  cpu::parallel_run(nt, [&](int t, int n) {
    // Shares of 32 columns (a 64-byte line of y where its rows start on one), so that threads
    // write the same line only where they do not.
    const int64_t lines = (o + 31) / 32;
    const int64_t o0 = std::min(o, lines * t / n * 32), o1 = std::min(o, lines * (t + 1) / n * 32);
    if (o0 < o1) fn(job, o0, o1);
  });
  return true;
}

}  // namespace scatter_add
