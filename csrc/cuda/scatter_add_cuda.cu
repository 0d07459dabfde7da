// Launchers of the CUDA path (see scatter_add_cuda.h): argument checks, device-side index
// validation, the plan (CUB stable radix sort of (row, source id) pairs, run-length encoding of
// the rows, exclusive scan of the run lengths), then one warp per destination row.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <string>

#include "kernels.cuh"
#include "scatter_add_cuda.h"

namespace scatter_add {
namespace cuda {
namespace {

constexpr int kThreads = 256;  // 8 warps per block

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("scatter_add CUDA: ") + what + ": " + cudaGetErrorString(e));
}

[[noreturn]] void fail(const char* op, Error::Kind kind, const std::string& msg) {
  throw Error(kind, std::string(op) + ": " + msg);
}

size_t align_up(size_t x) { return (x + 255) & ~size_t(255); }

int key_bits(int64_t n) {
  int b = 1;
  while (b < 32 && (int64_t(1) << b) <= n) ++b;
  return b;
}

// Workspace layout, 256-byte aligned pieces.
struct Layout {
  size_t keys_in, keys_out, ids_in, ids_out, run_keys, run_counts, run_offsets, num_runs, bad, temp, temp_bytes, total;
};

Layout layout(int64_t k, int64_t n) {
  size_t sort_b = 0, rle_b = 0, scan_b = 0;
  const int kk = static_cast<int>(k);
  cub::DeviceRadixSort::SortPairs(nullptr, sort_b, (uint32_t*)nullptr, (uint32_t*)nullptr, (uint32_t*)nullptr,
                                  (uint32_t*)nullptr, kk, 0, key_bits(n));
  cub::DeviceRunLengthEncode::Encode(nullptr, rle_b, (uint32_t*)nullptr, (uint32_t*)nullptr, (uint32_t*)nullptr,
                                     (int*)nullptr, kk);
  cub::DeviceScan::ExclusiveSum(nullptr, scan_b, (uint32_t*)nullptr, (uint32_t*)nullptr, kk);
  Layout l{};
  const size_t arr = align_up(sizeof(uint32_t) * std::max<int64_t>(k, 1));
  size_t at = 0;
  for (size_t* f : {&l.keys_in, &l.keys_out, &l.ids_in, &l.ids_out, &l.run_keys, &l.run_counts, &l.run_offsets}) {
    *f = at;
    at += arr;
  }
  l.num_runs = at;
  at += 256;
  l.bad = at;
  at += 256;
  l.temp = at;
  l.temp_bytes = std::max({sort_b, rle_b, scan_b, size_t(1)});
  l.total = at + align_up(l.temp_bytes);
  return l;
}

template <class T>
T* at(void* ws, size_t off) { return reinterpret_cast<T*>(static_cast<char*>(ws) + off); }

// Elements per 16-byte chunk if every row start is 16-byte aligned, else 1.
int vec_width(size_t es, int64_t d, std::initializer_list<std::pair<const void*, int64_t>> views) {
  const int v = static_cast<int>(16 / es);
  if (d % v != 0) return 1;
  for (auto& p : views) {
    if (reinterpret_cast<uintptr_t>(p.first) % 16 != 0 || (p.second * int64_t(es)) % 16 != 0) return 1;
  }
  return v;
}

template <class I>
void validate(const char* op, const IndexVector& index, int64_t n, std::optional<int64_t> ignore, void* ws,
              const Layout& l, cudaStream_t stream) {
  const int64_t k = index.size;
  auto* bad = at<unsigned long long>(ws, l.bad);
  check_cuda(cudaMemsetAsync(bad, 0xFF, sizeof(*bad), stream), "memset");
  const int blocks = static_cast<int>(std::min<int64_t>((k + kThreads - 1) / kThreads, 4096));
  kernels::validate_index<I><<<blocks, kThreads, 0, stream>>>(static_cast<const I*>(index.data), k, n,
                                                               ignore.has_value(), ignore.value_or(0), bad);
  check_cuda(cudaGetLastError(), "validate_index launch");
  unsigned long long first = 0;
  check_cuda(cudaMemcpyAsync(&first, bad, sizeof(first), cudaMemcpyDeviceToHost, stream), "copy");
  check_cuda(cudaStreamSynchronize(stream), "sync");
  if (first == ~0ull) return;
  I value{};
  check_cuda(cudaMemcpy(&value, static_cast<const I*>(index.data) + first, sizeof(I), cudaMemcpyDeviceToHost), "copy");
  std::string msg = "index[" + std::to_string(first) + "] = " + std::to_string(static_cast<int64_t>(value)) +
                    " is out of range for " + std::to_string(n) + " rows (valid: 0.." + std::to_string(n - 1) + ")";
  if (ignore) msg += " and is not ignore_index = " + std::to_string(*ignore);
  fail(op, Error::Kind::index, msg);
}

// Checks shared by both ops: `big` is the [N, D] operand, `small` the [K, D] one. Returns the
// workspace layout (CUB's size queries run once per call).
Layout check_args(const char* op, const ConstMatrix& big, const char* big_name, const ConstMatrix& small,
                  const char* small_name, int64_t k, const WeightVector& w, size_t ws_bytes) {
  if (small.dtype != big.dtype)
    fail(op, Error::Kind::value, std::string(small_name) + " dtype " + dtype_name(small.dtype) + " does not match " +
                                     big_name + " dtype " + dtype_name(big.dtype));
  if (small.cols != big.cols)
    fail(op, Error::Kind::value, std::string(small_name) + " has " + std::to_string(small.cols) + " columns but " +
                                     big_name + " has " + std::to_string(big.cols));
  const int64_t n = big.rows;
  if (n >= (int64_t(1) << 31) || k >= (int64_t(1) << 31))
    fail(op, Error::Kind::value, "the CUDA path supports fewer than 2^31 rows and indices, got N=" +
                                     std::to_string(n) + " K=" + std::to_string(k));
  if (small.rows != k)
    fail(op, Error::Kind::value, "index has " + std::to_string(k) + " entries but " + small_name + " has " +
                                     std::to_string(small.rows) + " rows");
  const DType acc = big.dtype == DType::f64 ? DType::f64 : DType::f32;
  if (w.data != nullptr && (w.dtype != acc || w.size != k))
    fail(op, Error::Kind::value, std::string("weight must be ") + dtype_name(acc) + " with " + std::to_string(k) +
                                     " entries");
  const Layout l = layout(k, n);
  if (ws_bytes < l.total)
    fail(op, Error::Kind::value, "workspace of " + std::to_string(ws_bytes) + " bytes is smaller than the " +
                                     std::to_string(l.total) + " needed");
  return l;
}

template <class T, int VEC>
void launch_add(const Matrix& out, const ConstMatrix& src, const void* w, void* ws, const Layout& l, int64_t k,
                cudaStream_t stream) {
  const int64_t warps = k;  // runs <= K
  const int64_t blocks = (warps * 32 + kThreads - 1) / kThreads;
  auto args = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<T*>(out.data), out.row_stride, static_cast<const T*>(src.data), src.row_stride,
        static_cast<const typename kernels::Acc<T>::type*>(w), at<uint32_t>(ws, l.run_keys),
        at<uint32_t>(ws, l.run_offsets), at<uint32_t>(ws, l.run_counts), at<int>(ws, l.num_runs),
        at<uint32_t>(ws, l.ids_out), static_cast<uint32_t>(out.rows), out.cols);
  };
  if (w) args(kernels::add_rows<T, VEC, true>);
  else args(kernels::add_rows<T, VEC, false>);
}

template <class T>
void dispatch_add(const Matrix& out, const ConstMatrix& src, const void* w, void* ws, const Layout& l, int64_t k,
                  cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  if (vec_width(sizeof(T), out.cols, {{out.data, out.row_stride}, {src.data, src.row_stride}}) == V)
    launch_add<T, V>(out, src, w, ws, l, k, stream);
  else
    launch_add<T, 1>(out, src, w, ws, l, k, stream);
}

template <class T, class I>
void dispatch_gather(const Matrix& dst, const ConstMatrix& x, const IndexVector& index, const void* w,
                     std::optional<int64_t> ignore, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const int64_t k = index.size;
  const int64_t blocks = (k * 32 + kThreads - 1) / kThreads;
  const bool vec = vec_width(sizeof(T), dst.cols, {{dst.data, dst.row_stride}, {x.data, x.row_stride}}) == V;
  auto go = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<T*>(dst.data), dst.row_stride, static_cast<const T*>(x.data), x.row_stride,
        static_cast<const I*>(index.data), k, ignore.has_value(), ignore.value_or(0),
        static_cast<const typename kernels::Acc<T>::type*>(w), dst.cols);
  };
  if (vec) {
    if (w) go(kernels::gather_rows<T, I, V, true>); else go(kernels::gather_rows<T, I, V, false>);
  } else {
    if (w) go(kernels::gather_rows<T, I, 1, true>); else go(kernels::gather_rows<T, I, 1, false>);
  }
}

template <class F>
void by_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: f(float{}); break;
    case DType::f64: f(double{}); break;
    case DType::bf16: f(__nv_bfloat16{}); break;
    case DType::f16: f(__half{}); break;
  }
}

}  // namespace

size_t workspace_bytes(int64_t k, int64_t n) { return layout(k, n).total; }

void index_add_rows(const Matrix& out, const IndexVector& index, const ConstMatrix& src, const WeightVector& weight,
                    std::optional<int64_t> ignore, void* ws, size_t ws_bytes, cudaStream_t stream) {
  const char* op = "index_add_rows";
  const int64_t k = index.size, n = out.rows;
  const Layout l = check_args(op, out, "out", src, "src", k, weight, ws_bytes);
  if (k == 0) return;
  if (index.type == IndexType::i32) validate<int32_t>(op, index, n, ignore, ws, l, stream);
  else validate<int64_t>(op, index, n, ignore, ws, l, stream);
  if (out.cols == 0) return;
  // Plan: keys (row or n for ignored), stable sort by key, runs of equal keys, their offsets.
  const int blocks = static_cast<int>(std::min<int64_t>((k + kThreads - 1) / kThreads, 4096));
  if (index.type == IndexType::i32)
    kernels::make_keys<int32_t><<<blocks, kThreads, 0, stream>>>(static_cast<const int32_t*>(index.data), k, n,
        ignore.has_value(), ignore.value_or(0), at<uint32_t>(ws, l.keys_in), at<uint32_t>(ws, l.ids_in));
  else
    kernels::make_keys<int64_t><<<blocks, kThreads, 0, stream>>>(static_cast<const int64_t*>(index.data), k, n,
        ignore.has_value(), ignore.value_or(0), at<uint32_t>(ws, l.keys_in), at<uint32_t>(ws, l.ids_in));
  check_cuda(cudaGetLastError(), "make_keys launch");
  size_t tb = l.temp_bytes;
  const int kk = static_cast<int>(k);
  check_cuda(cub::DeviceRadixSort::SortPairs(at<void>(ws, l.temp), tb, at<uint32_t>(ws, l.keys_in),
                                             at<uint32_t>(ws, l.keys_out), at<uint32_t>(ws, l.ids_in),
                                             at<uint32_t>(ws, l.ids_out), kk, 0, key_bits(n), stream), "sort");
  tb = l.temp_bytes;
  check_cuda(cub::DeviceRunLengthEncode::Encode(at<void>(ws, l.temp), tb, at<uint32_t>(ws, l.keys_out),
                                                at<uint32_t>(ws, l.run_keys), at<uint32_t>(ws, l.run_counts),
                                                at<int>(ws, l.num_runs), kk, stream), "run-length encode");
  tb = l.temp_bytes;
  check_cuda(cub::DeviceScan::ExclusiveSum(at<void>(ws, l.temp), tb, at<uint32_t>(ws, l.run_counts),
                                           at<uint32_t>(ws, l.run_offsets), kk, stream), "scan");
  by_dtype(out.dtype, [&](auto tag) { dispatch_add<decltype(tag)>(out, src, weight.data, ws, l, k, stream); });
  check_cuda(cudaGetLastError(), "add_rows launch");
}

void gather_rows(const Matrix& dst, const ConstMatrix& x, const IndexVector& index, const WeightVector& weight,
                 std::optional<int64_t> ignore, void* ws, size_t ws_bytes, cudaStream_t stream) {
  const char* op = "gather_rows";
  const int64_t k = index.size;
  const Layout l = check_args(op, x, "x", dst, "dst", k, weight, ws_bytes);
  if (k == 0) return;
  if (index.type == IndexType::i32) validate<int32_t>(op, index, x.rows, ignore, ws, l, stream);
  else validate<int64_t>(op, index, x.rows, ignore, ws, l, stream);
  if (dst.cols == 0) return;
  by_dtype(dst.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (index.type == IndexType::i32) dispatch_gather<T, int32_t>(dst, x, index, weight.data, ignore, stream);
    else dispatch_gather<T, int64_t>(dst, x, index, weight.data, ignore, stream);
  });
  check_cuda(cudaGetLastError(), "gather_rows launch");
}

}  // namespace cuda
}  // namespace scatter_add
