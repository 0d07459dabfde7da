// The public entry points: validate (nothing is written before every check passes), choose a
// strategy, run it. See strategy.h for the strategies and choose.cpp for the choice.
#include <atomic>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "policy.h"
#include "scatter_add/scatter_add.h"
#include "strategy.h"
#include "validate.h"

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

std::atomic<int> g_num_threads{0};

// Runs f, reporting a core error (an index value, an environment setting) as coming from `op`.
template <class F>
void as_op(const char* op, F&& f) {
  try {
    f();
  } catch (const Error& e) {
    cpu::fail(op, e.kind(), e.what());
  }
}

// This thread's plan, one for both ops (a static local of the template below would be one per
// instantiation).
Plan& thread_plan() {
  thread_local Plan kept;
  return kept;
}

// Runs f(plan) on this thread's plan rebuilt for index by strategy s (count or radix). Its
// buffers stay for the thread's next planned call (up to kKeptPlanBytes): a new plan's buffers
// are pages the kernel maps and zeroes on every call.
template <class F>
void with_kept_plan(const IndexVector& index, int64_t rows, std::optional<int64_t> ignore, Strategy s, F&& f) {
  Plan& kept = thread_plan();
  try {
    kept.rebuild(index, rows, ignore, s);
    f(static_cast<const Plan&>(kept));
  } catch (...) {  // a build that failed part way (out of memory) keeps nothing
    kept = Plan();
    throw;
  }
  if (kept.capacity_bytes() > static_cast<size_t>(cpu::CpuPolicy::kKeptPlanBytes)) kept = Plan();
}

}  // namespace

void set_num_threads(int n) { g_num_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

int get_num_threads() {
  const int n = g_num_threads.load(std::memory_order_relaxed);
  if (n > 0) return n;
  const unsigned h = std::thread::hardware_concurrency();
  return h == 0 ? 1 : static_cast<int>(h);
}

void index_add_rows(const Matrix& out, const IndexVector& index, const ConstMatrix& src,
                    const WeightVector& weight, const Options& options) {
  const char* op = "index_add_rows";
  cpu::check_index(op, index, src.rows, "src");
  cpu::check_add_args(op, out, src, weight, index.size, index.data, cpu::index_bytes(index));
  if (index.size == 0) {  // nothing to add, but an unknown strategy is refused as in any call
    as_op(op, [&] { cpu::forced_strategy(options); });
    return;
  }
  std::vector<float> wf;
  std::vector<double> wd;
  as_op(op, [&] {
    // Every index value is checked before the first write; the pass also tells a sorted index.
    // choose_add refuses an unknown options.strategy, also before anything is written.
    const cpu::IndexScan scan = cpu::scan_index(index, out.rows, options.ignore_index, nullptr, nullptr, nullptr, 0, true);
    const Strategy s = cpu::choose_add({out.rows, index.size, out.cols, out.dtype}, options, scan.sorted);
    if (out.cols == 0 || scan.kept == 0) return;
    const void* w = cpu::weights_as_acc(weight, out.dtype, &wf, &wd);
    if (s == Strategy::direct)
      cpu::run_direct(out, index, src, w, options, scan);
    else
      with_kept_plan(index, out.rows, options.ignore_index, s,
                     [&](const Plan& plan) { cpu::run_planned(out, plan, src, w, options); });
  });
}

void index_add_rows(const Matrix& out, const Plan& plan, const ConstMatrix& src,
                    const WeightVector& weight, const Options& options) {
  const char* op = "index_add_rows";
  cpu::check_plan(op, plan, out.rows, "out", src.rows, "src", options);
  cpu::check_add_args(op, out, src, weight, plan.num_entries(), nullptr, 0);
  std::vector<float> wf;
  std::vector<double> wd;
  cpu::run_planned(out, plan, src, cpu::weights_as_acc(weight, out.dtype, &wf, &wd), options);
}

void gather_rows(const Matrix& dst, const ConstMatrix& x, const IndexVector& index,
                 const WeightVector& weight, const Options& options) {
  const char* op = "gather_rows";
  cpu::check_index(op, index, dst.rows, "dst");
  cpu::check_gather_args(op, dst, x, weight, index.data, cpu::index_bytes(index));
  std::vector<float> wf;
  std::vector<double> wd;
  as_op(op, [&] {
    // choose_gather refuses an unknown options.strategy before anything is written; run_gather
    // checks every index value before its first write, and so does the scan before a plan.
    const Strategy s = cpu::choose_gather(options);
    const void* w = cpu::weights_as_acc(weight, dst.dtype, &wf, &wd);
    if (s == Strategy::direct) {
      cpu::run_gather(dst, x, index, w, options);
      return;
    }
    cpu::scan_index(index, x.rows, options.ignore_index);
    if (index.size == 0 || dst.cols == 0) return;
    with_kept_plan(index, x.rows, options.ignore_index, s,
                   [&](const Plan& plan) { cpu::run_gather_planned(dst, x, plan, w, options); });
  });
}

void gather_rows(const Matrix& dst, const ConstMatrix& x, const Plan& plan,
                 const WeightVector& weight, const Options& options) {
  const char* op = "gather_rows";
  cpu::check_plan(op, plan, x.rows, "x", dst.rows, "dst", options);
  cpu::check_gather_args(op, dst, x, weight, nullptr, 0);
  std::vector<float> wf;
  std::vector<double> wd;
  cpu::run_gather_planned(dst, x, plan, cpu::weights_as_acc(weight, dst.dtype, &wf, &wd), options);
}

}  // namespace scatter_add
