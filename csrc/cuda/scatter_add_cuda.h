// scatter_add on NVIDIA GPUs: the same semantics as the CPU core (include/scatter_add), for device
// pointers, on a caller's stream, with a caller-provided workspace (CUB's two-phase model).
//
//   size_t bytes = workspace_bytes(K, N, D, dtype);       // index_add_rows' scratch
//   index_add_rows(out, index, src, weight, ignore, ws, bytes, stream);
//   gather_rows(dst, x, index, weight, ignore, ws, gather_workspace_bytes(), stream);
//
// Every index value is checked on the device; the kernels that write skip all work when one is
// out of range, so a bad index writes nothing. How it is reported (IndexCheck):
//   host_error   (default) the call waits for its stream once, after all its work was queued,
//                and throws scatter_add::Error naming the first bad position and value;
//   device_trap  the call never waits (as torch's own CUDA ops): a one-thread kernel traps,
//                which surfaces as a CUDA error at the next synchronisation and, as a
//                device-side assert does, leaves the CUDA context unusable.
// A stream that is being captured into a CUDA graph always gets device_trap.
// The plan is a stable radix sort of (destination, source id) pairs, so every output element is
// summed by one thread in source order: the result is bitwise deterministic, and equal to the CPU
// core's FMA paths. A row with more than 256 contributions is summed in pieces of at most 256
// (cut at fixed sorted positions) that a second kernel adds in order: still deterministic, but
// rounded differently from the CPU's one sequential sum. Weights are float32 (float64 for f64).
// Limits: N < 2^31 rows and K < 2^31 indices (64-bit offsets everywhere else).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <optional>

#include "scatter_add/scatter_add.h"

namespace scatter_add {
namespace cuda {

enum class IndexCheck { host_error, device_trap };

// index_add_rows' workspace for K indices into [N, D] rows of `dtype`: the sort, and for K > 256
// the pieces of rows with more than 256 contributions (2 * ceil(K / 256) * D accumulators).
size_t workspace_bytes(int64_t k, int64_t n, int64_t d, DType dtype);
size_t gather_workspace_bytes();

void index_add_rows(const Matrix& out, const IndexVector& index, const ConstMatrix& src,
                    const WeightVector& weight, std::optional<int64_t> ignore_index, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream, IndexCheck check = IndexCheck::host_error);

void gather_rows(const Matrix& dst, const ConstMatrix& x, const IndexVector& index,
                 const WeightVector& weight, std::optional<int64_t> ignore_index, void* workspace,
                 size_t workspace_bytes, cudaStream_t stream, IndexCheck check = IndexCheck::host_error);

}  // namespace cuda
}  // namespace scatter_add
