// Device kernels of the CUDA path. One warp per destination row (index_add) or per output row
// (gather); each lane moves 16-byte vectors of VEC elements and accumulates in AccT registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace scatter_add {
namespace cuda {
namespace kernels {

template <class T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

template <class T, class A> __device__ __forceinline__ A to_acc(T v) { return static_cast<A>(v); }
template <> __device__ __forceinline__ float to_acc<__nv_bfloat16, float>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_acc<__half, float>(__half v) { return __half2float(v); }
template <class T, class A> __device__ __forceinline__ T from_acc(A v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16, float>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_acc<__half, float>(float v) { return __float2half_rn(v); }

// VEC elements moved as one aligned chunk (16 bytes when VEC * sizeof(T) == 16).
template <class T, int VEC>
struct alignas(sizeof(T) * VEC) Chunk {
  T v[VEC];
};

// Marks the first out-of-range index (not ignore_index) in *first_bad (initialised to ~0).
template <class I>
__global__ void validate_index(const I* index, int64_t k, int64_t n, bool has_ignore, int64_t ignore,
                               unsigned long long* first_bad) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < k; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t v = static_cast<int64_t>(index[i]);
    if (has_ignore && v == ignore) continue;
    if (v < 0 || v >= n) atomicMin(first_bad, static_cast<unsigned long long>(i));
  }
}

// Sort keys: the destination row, or n (sorted last, then skipped) for ignore_index.
template <class I>
__global__ void make_keys(const I* index, int64_t k, int64_t n, bool has_ignore, int64_t ignore,
                          uint32_t* keys, uint32_t* ids) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < k; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t v = static_cast<int64_t>(index[i]);
    keys[i] = static_cast<uint32_t>((has_ignore && v == ignore) ? n : v);
    ids[i] = static_cast<uint32_t>(i);
  }
}

// One warp per run of equal keys: out[row] = round(out[row] + sum_j w[id_j] * src[id_j]).
template <class T, int VEC, bool WEIGHTED>
__global__ void add_rows(T* __restrict__ out, int64_t out_stride, const T* __restrict__ src,
                         int64_t src_stride, const typename Acc<T>::type* __restrict__ w,
                         const uint32_t* __restrict__ run_keys, const uint32_t* __restrict__ run_offsets,
                         const uint32_t* __restrict__ run_counts, const int* __restrict__ num_runs,
                         const uint32_t* __restrict__ ids, uint32_t sentinel, int64_t d) {
  using A = typename Acc<T>::type;
  using C = Chunk<T, VEC>;
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= *num_runs) return;
  const uint32_t row = run_keys[warp];
  if (row == sentinel) return;
  const uint32_t beg = run_offsets[warp], n = run_counts[warp];
  T* o = out + int64_t(row) * out_stride;
  for (int64_t c = int64_t(lane) * VEC; c < d; c += 32 * VEC) {
    A acc[VEC];
    const C oc = *reinterpret_cast<const C*>(o + c);
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = to_acc<T, A>(oc.v[e]);
    for (uint32_t j = 0; j < n; ++j) {
      const uint32_t id = ids[beg + j];
      const C sc = *reinterpret_cast<const C*>(src + int64_t(id) * src_stride + c);
      if (WEIGHTED) {
        const A wj = w[id];
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = fma(wj, to_acc<T, A>(sc.v[e]), acc[e]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] += to_acc<T, A>(sc.v[e]);
      }
    }
    C r;
#pragma unroll
    for (int e = 0; e < VEC; ++e) r.v[e] = from_acc<T, A>(acc[e]);
    *reinterpret_cast<C*>(o + c) = r;
  }
}

// One warp per output row: dst[i] = w[i] * x[index[i]], zeros for ignore_index.
template <class T, class I, int VEC, bool WEIGHTED>
__global__ void gather_rows(T* __restrict__ dst, int64_t dst_stride, const T* __restrict__ x,
                            int64_t x_stride, const I* __restrict__ index, int64_t k, bool has_ignore,
                            int64_t ignore, const typename Acc<T>::type* __restrict__ w, int64_t d) {
  using A = typename Acc<T>::type;
  using C = Chunk<T, VEC>;
  const int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (i >= k) return;
  const int64_t v = static_cast<int64_t>(index[i]);
  T* o = dst + i * dst_stride;
  const bool skip = has_ignore && v == ignore;
  const T* s = x + (skip ? 0 : v) * x_stride;
  for (int64_t c = int64_t(lane) * VEC; c < d; c += 32 * VEC) {
    C r;
    if (skip) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) r.v[e] = from_acc<T, A>(A(0));
    } else {
      r = *reinterpret_cast<const C*>(s + c);
      if (WEIGHTED) {
        const A wi = w[i];
#pragma unroll
        for (int e = 0; e < VEC; ++e) r.v[e] = from_acc<T, A>(wi * to_acc<T, A>(r.v[e]));
      }
    }
    *reinterpret_cast<C*>(o + c) = r;
  }
}

}  // namespace kernels
}  // namespace cuda
}  // namespace scatter_add
