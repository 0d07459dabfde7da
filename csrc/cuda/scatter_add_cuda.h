// scatter_add on NVIDIA GPUs: the semantics and the bits of the CPU core (include/scatter_add),
// for device pointers, on a caller's stream, in memory the caller provides (CUB's two-phase model).
//
//   size_t bytes = workspace_bytes(K, N);                  // with the device that will run it current
//   index_add_rows(out, index, src, weight, ignore, ws, bytes, stream);
//   gather_rows(dst, x, index, weight, ignore, ws, gather_workspace_bytes(), stream);
//
//   // or a plan, built once and used by every call that shares the index (forward and backward):
//   Plan plan = Plan::build(index, N, ignore, mem, Plan::bytes(K, N), stream);
//   index_add_rows(out, plan, src, weight, stream);
//   gather_rows(dst, x, plan, weight, stream);
//
// Results. Every output element is summed by one thread: out's value, then the contributions in
// increasing source order, each fma(w, s, acc) (acc + s unweighted) in float32 (float64 for f64),
// rounded once to the storage type, subnormals kept. That is the CPU core's arithmetic, so the
// output is bitwise the CPU op's for finite inputs (a NaN's payload and sign may differ), on every
// run, and a row's bits depend only on its own contributions. A row with many contributions (a
// hot row) is still one sequential sum per element: its columns are shared among more warps, but
// each column takes one dependent FMA per contribution, so very hot rows at small D are
// latency-bound.
// Weights are float32 (float64 for f64 data). Limits: N < 2^31 rows, K < 2^31 indices.
//
// Bad index values. Every value is checked on the device; the writing kernels do nothing when one
// is out of range, so a bad index writes nothing. How it is reported (IndexCheck):
//   deferred  (default) the call never waits for the GPU: the device writes the outcome into
//             pinned host memory, and the first library call made after the GPU ran the bad call
//             throws scatter_add::Error (Kind::index) naming the position and value, without doing
//             its own work; check_errors() throws it too (check_errors(true) waits for it);
//   sync      the call waits for its stream and throws at once (for debugging);
//   trap      a bad value traps on the device, as torch's device-side asserts do: the error
//             surfaces as a CUDA error at the next synchronisation and the CUDA context is unusable.
// A stream that is being captured into a CUDA graph always gets trap (nothing can be reported to
// the host from a replayed graph).
//
// Every function runs on the device of `stream` (a device guard sets it for the call and restores
// the caller's), and checks its arguments before touching any memory: bad arguments throw
// scatter_add::Error (Kind::value) naming the argument, and the output is left untouched.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <optional>

#include "scatter_add/scatter_add.h"

namespace scatter_add {
namespace cuda {

enum class IndexCheck { deferred, sync, trap, host_error = sync, device_trap = trap };

// The validated, sorted index in caller-owned device memory: a small value that points into that
// memory, which must stay allocated (and unmodified) while the plan is used. The plan does not
// keep the index: changing the index after build() does not change the plan.
class Plan {
 public:
  Plan() = default;
  // Memory a plan for `num_entries` indices into `num_rows` rows needs (at least 16-byte aligned).
  // Uses the current device (the size of CUB's sort scratch depends on it).
  static size_t bytes(int64_t num_entries, int64_t num_rows);
  // Checks every index value against [0, num_rows) (ignore_index excepted) and sorts the index, on
  // `stream`, without waiting for it (unless check is sync).
  static Plan build(const IndexVector& index, int64_t num_rows, std::optional<int64_t> ignore_index,
                    void* memory, size_t memory_bytes, cudaStream_t stream,
                    IndexCheck check = IndexCheck::deferred);

  bool empty() const { return memory_ == nullptr; }
  int64_t num_rows() const { return num_rows_; }
  int64_t num_entries() const { return num_entries_; }
  std::optional<int64_t> ignore_index() const { return ignore_index_; }
  int device() const { return device_; }
  const void* memory() const { return memory_; }

 private:
  friend struct PlanAccess;
  void* memory_ = nullptr;
  size_t bytes_ = 0;
  int64_t num_rows_ = 0, num_entries_ = 0;
  std::optional<int64_t> ignore_index_;
  int device_ = -1;
};

// out[index[i], :] += weight[i] * src[i, :]; out is [N, D], src is [K, D]. The plan's stream
// order applies: build it on `stream` (or make `stream` wait for the building one).
void index_add_rows(const Matrix& out, const Plan& plan, const ConstMatrix& src, const WeightVector& weight,
                    cudaStream_t stream);
// dst[i, :] = weight[i] * x[index[i], :] (zero rows for ignore_index); x is [N, D], dst is [K, D].
void gather_rows(const Matrix& dst, const ConstMatrix& x, const Plan& plan, const WeightVector& weight,
                 cudaStream_t stream);

// One call without a plan: builds one in `workspace` (workspace_bytes(K, N), 16-byte aligned).
size_t workspace_bytes(int64_t num_entries, int64_t num_rows);
inline size_t workspace_bytes(int64_t num_entries, int64_t num_rows, int64_t /*cols*/, DType /*dtype*/) {
  return workspace_bytes(num_entries, num_rows);
}
void index_add_rows(const Matrix& out, const IndexVector& index, const ConstMatrix& src, const WeightVector& weight,
                    std::optional<int64_t> ignore_index, void* workspace, size_t workspace_bytes,
                    cudaStream_t stream, IndexCheck check = IndexCheck::deferred);

// gather without a plan: its workspace (the check's scratch) is a fixed size, 16-byte aligned.
size_t gather_workspace_bytes();
void gather_rows(const Matrix& dst, const ConstMatrix& x, const IndexVector& index, const WeightVector& weight,
                 std::optional<int64_t> ignore_index, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream, IndexCheck check = IndexCheck::deferred);

// Throws the error of the earliest call whose bad index the GPU has found and that was not
// reported yet (deferred mode). wait = true first waits for the GPU work of every call not yet
// known to be good (cudaDeviceSynchronize on each device with such calls).
void check_errors(bool wait = false);

}  // namespace cuda
}  // namespace scatter_add
