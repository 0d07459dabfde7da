// Strategies "count" and "radix" after their sort: the plan's destination rows, each summed by one
// thread over its contributions in source order. Threads get equal shares of cost, where row r
// costs (count_r + kRowCost) row-transfers; split points inside a row fall on kColumnAlign
// columns, so a hot row spreads over threads by columns. The plan walk calls the row kernel once
// per run of rows with the same column range, so short rows cost no call each.
#include <vector>

#include "dispatch.h"
#include "parallel.h"
#include "policy.h"
#include "splitter.h"
#include "strategy.h"

namespace scatter_add {
namespace cpu {

void run_planned(const Matrix& out, const Plan& plan, const ConstMatrix& src, const void* w,
                 const Options& o) {
  const int64_t d = out.cols;
  if (plan.num_distinct() == 0 || d == 0) return;
  const AddRowsFn fn = active_kernels().rows[static_cast<int>(out.dtype)][w != nullptr];
  const Splitter split(plan.offsets(), plan.num_distinct(), d, CpuPolicy::kRowCost);
  const size_t es = dtype_size(out.dtype);
  const double bytes = static_cast<double>(split.total()) * static_cast<double>(d) * static_cast<double>(es);
  const int nt = row_threads_for(o, bytes, out.dtype);
  // The bytes the walk reads and writes: its sources and its destination rows.
  const double touched = static_cast<double>(plan.offsets().back() + plan.num_distinct()) * static_cast<double>(d) *
                         static_cast<double>(es);
  const RowsJob job{out.data,          out.row_stride,         src.data,
                    src.row_stride,    plan.rows().data(),     plan.offsets().data(),
                    plan.sources().data(), plan.offsets().back(), w,
                    touched >= static_cast<double>(CpuPolicy::kFarWalkBytes)};
  parallel_run(nt, [&](int t, int n) {
    split.for_share(t, n, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) { fn(job, r0, r1, c0, c1); });
  });
}

}  // namespace cpu
}  // namespace scatter_add
