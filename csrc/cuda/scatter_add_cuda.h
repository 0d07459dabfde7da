// scatter_add on NVIDIA GPUs: the same semantics as the CPU core (include/scatter_add), for device
// pointers, on a caller's stream, with a caller-provided workspace (CUB's two-phase model).
//
//   size_t bytes = workspace_bytes(K, N);                 // query once
//   index_add_rows(out, index, src, weight, ignore, ws, bytes, stream);
//   gather_rows(dst, x, index, weight, ignore, ws, bytes, stream);
//
// Indices are validated on the device before anything is written; a bad one is copied back and
// thrown as scatter_add::Error (this costs one stream synchronisation). The plan is a stable radix
// sort of (destination, source id) pairs, so every destination row is summed by one warp in
// source order: the result is bitwise deterministic. Weights are float32 (float64 for f64 data).
// Limits: N < 2^31 rows and K < 2^31 indices (64-bit offsets everywhere else).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <optional>

#include "scatter_add/scatter_add.h"

namespace scatter_add {
namespace cuda {

size_t workspace_bytes(int64_t k, int64_t n);

void index_add_rows(const Matrix& out, const IndexVector& index, const ConstMatrix& src,
                    const WeightVector& weight, std::optional<int64_t> ignore_index, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream);

void gather_rows(const Matrix& dst, const ConstMatrix& x, const IndexVector& index,
                 const WeightVector& weight, std::optional<int64_t> ignore_index, void* workspace,
                 size_t workspace_bytes, cudaStream_t stream);

}  // namespace cuda
}  // namespace scatter_add
