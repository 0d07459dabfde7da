// Launchers of the CUDA path (see scatter_add_cuda.h): argument checks; one pass over the index
// that checks every value and writes the sort keys; the plan (a CUB stable radix sort of
// (row, source id) pairs over ceil(log2(N + 1)) key bits); one warp per (run of equal keys, column
// tile); then the bad-index report. The writers skip all work
// when the check found a bad value, so nothing waits for the host between the stages.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <string>

#include "kernels.cuh"
#include "scatter_add_cuda.h"

namespace scatter_add {
namespace cuda {
namespace {

constexpr int kThreads = 256;  // 8 warps per block
constexpr int64_t kMaxBlocks = int64_t(1) << 20;  // grid-stride loops beyond this
constexpr size_t kGatherWorkspace = 256;  // the bad-index flag

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

// Workspace layout, 256-byte aligned pieces. `flags` holds the bad-index flag (8 bytes) and then
// long_start (one uint32 per block of kernels::kSegment sorted positions), set to all-ones by one
// memset; tail and head are the long runs' pieces ([blocks, d] accumulators each).
struct Layout {
  size_t keys_in, keys_out, ids_in, ids_out, flags, flag_bytes, tail, head, temp, temp_bytes, total;
  int64_t blocks;
};

Layout layout(int64_t k, int64_t n, int64_t d, DType dtype) {
  size_t sort_b = 0;
  check_cuda(cub::DeviceRadixSort::SortPairs(nullptr, sort_b, (uint32_t*)nullptr, (uint32_t*)nullptr,
                                             (uint32_t*)nullptr, (uint32_t*)nullptr, static_cast<int>(k), 0,
                                             key_bits(n)), "sort size query");
  Layout l{};
  l.blocks = (k + kernels::kSegment - 1) / kernels::kSegment;
  const size_t arr = align_up(sizeof(uint32_t) * std::max<int64_t>(k, 1));
  size_t at = 0;
  for (size_t* f : {&l.keys_in, &l.keys_out, &l.ids_in, &l.ids_out}) {
    *f = at;
    at += arr;
  }
  l.flags = at;
  l.flag_bytes = sizeof(unsigned long long) + sizeof(uint32_t) * l.blocks;
  at += align_up(l.flag_bytes);
  // Pieces exist only where a run can exceed kSegment contributions.
  const size_t piece = k > kernels::kSegment ? align_up(size_t(l.blocks) * d * (dtype == DType::f64 ? 8 : 4)) : 0;
  l.tail = at;
  at += piece;
  l.head = at;
  at += piece;
  l.temp = at;
  l.temp_bytes = std::max(sort_b, size_t(1));
  l.total = at + align_up(l.temp_bytes);
  return l;
}

template <class T>
T* at(void* ws, size_t off) { return reinterpret_cast<T*>(static_cast<char*>(ws) + off); }

int grid_for(int64_t threads) {
  return static_cast<int>(std::clamp<int64_t>((threads + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus s = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &s), "cudaStreamIsCapturing");
  return s != cudaStreamCaptureStatusNone;
}

// Marks bad values in *bad and, with keys != nullptr, writes the plan's sort keys and ids.
template <class I>
void launch_check(const IndexVector& index, int64_t n, std::optional<int64_t> ignore, unsigned long long* bad,
                  size_t flag_bytes, uint32_t* keys, uint32_t* ids, cudaStream_t stream) {
  check_cuda(cudaMemsetAsync(bad, 0xFF, flag_bytes, stream), "memset");
  const kernels::KeyArgs<I> a{static_cast<const I*>(index.data), index.size, n, ignore.has_value(),
                              ignore.value_or(0), keys, ids, bad};
  kernels::check_index<I><<<grid_for(index.size), kThreads, 0, stream>>>(a);
  check_cuda(cudaGetLastError(), "check_index launch");
}

// After the writers were queued (they write nothing when *bad is set): host_error waits for the
// stream and throws the first bad value; device_trap (and any capturing stream) queues a kernel
// that traps instead, so the call never waits.
template <class I>
void report(const char* op, const IndexVector& index, int64_t n, std::optional<int64_t> ignore,
            const unsigned long long* bad, IndexCheck check, cudaStream_t stream) {
  if (check == IndexCheck::device_trap || capturing(stream)) {
    kernels::trap_if_bad<<<1, 1, 0, stream>>>(bad);
    check_cuda(cudaGetLastError(), "trap_if_bad launch");
    return;
  }
  unsigned long long first = 0;
  check_cuda(cudaMemcpyAsync(&first, bad, sizeof(first), cudaMemcpyDeviceToHost, stream), "copy");
  check_cuda(cudaStreamSynchronize(stream), "sync");
  if (first == kernels::kNoBad) return;
  I value{};
  check_cuda(cudaMemcpyAsync(&value, static_cast<const I*>(index.data) + first, sizeof(I), cudaMemcpyDeviceToHost,
                             stream), "copy");
  check_cuda(cudaStreamSynchronize(stream), "sync");
  std::string msg = "index[" + std::to_string(first) + "] = " + std::to_string(static_cast<int64_t>(value)) +
                    " is out of range for " + std::to_string(n) + " rows (valid: 0.." + std::to_string(n - 1) + ")";
  if (ignore) msg += " and is not ignore_index = " + std::to_string(*ignore);
  fail(op, Error::Kind::index, msg);
}

template <class F>
void by_index(IndexType t, F&& f) {
  if (t == IndexType::i32) f(int32_t{});
  else f(int64_t{});
}

// Checks shared by both ops: `big` is the [N, D] operand, `small` the [K, D] one.
void check_args(const char* op, const ConstMatrix& big, const char* big_name, const ConstMatrix& small,
                const char* small_name, int64_t k, const WeightVector& w, size_t ws_bytes, size_t ws_needed) {
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
  if (ws_bytes < ws_needed)
    fail(op, Error::Kind::value, "workspace of " + std::to_string(ws_bytes) + " bytes is smaller than the " +
                                     std::to_string(ws_needed) + " needed");
}

template <class T>
void launch_add(const Matrix& out, const ConstMatrix& src, const void* w, void* ws, const Layout& l, int64_t k,
                cudaStream_t stream) {
  const int vec = kernels::vec_width<T>(out.cols, {{out.data, out.row_stride}, {src.data, src.row_stride}});
  kernels::with_variant<T>(vec, w != nullptr, [&](auto v, auto weighted) {
    constexpr int V = decltype(v)::value;
    const int64_t tiles = kernels::tiles<V>(out.cols);
    using A = kernels::acc_t<T>;
    const kernels::AddArgs<T> a{static_cast<T*>(out.data), out.row_stride, static_cast<const T*>(src.data),
                                src.row_stride, static_cast<const A*>(w), at<uint32_t>(ws, l.keys_out),
                                at<uint32_t>(ws, l.ids_out), k, static_cast<uint32_t>(out.rows), out.cols, tiles,
                                at<unsigned long long>(ws, l.flags), at<A>(ws, l.tail), at<A>(ws, l.head),
                                at<uint32_t>(ws, l.flags + sizeof(unsigned long long))};
    const int64_t tasks = k * tiles;  // tasks not at the start of a run (or a block) return at once
    kernels::add_rows<T, V, decltype(weighted)::value><<<grid_for(tasks * 32), kThreads, 0, stream>>>(a, tasks);
    check_cuda(cudaGetLastError(), "add_rows launch");
    if (k > kernels::kSegment) {  // a run can be longer than kSegment: add up its pieces
      const int64_t finish_tasks = l.blocks * tiles;
      kernels::finish_rows<T, V><<<grid_for(finish_tasks * 32), kThreads, 0, stream>>>(a, finish_tasks);
      check_cuda(cudaGetLastError(), "finish_rows launch");
    }
  });
}

template <class T, class I>
void launch_gather(const Matrix& dst, const ConstMatrix& x, const IndexVector& index, const void* w,
                   std::optional<int64_t> ignore, const unsigned long long* bad, cudaStream_t stream) {
  const int vec = kernels::vec_width<T>(dst.cols, {{dst.data, dst.row_stride}, {x.data, x.row_stride}});
  kernels::with_variant<T>(vec, w != nullptr, [&](auto v, auto weighted) {
    constexpr int V = decltype(v)::value;
    const int64_t tiles = kernels::tiles<V>(dst.cols);
    const kernels::GatherArgs<T, I> a{static_cast<T*>(dst.data), dst.row_stride, static_cast<const T*>(x.data),
                                      x.row_stride, static_cast<const I*>(index.data), index.size,
                                      ignore.has_value(), ignore.value_or(0),
                                      static_cast<const kernels::acc_t<T>*>(w), dst.cols, tiles, bad};
    const int64_t tasks = index.size * tiles;
    kernels::gather_rows<T, I, V, decltype(weighted)::value><<<grid_for(tasks * 32), kThreads, 0, stream>>>(a, tasks);
  });
  check_cuda(cudaGetLastError(), "gather_rows launch");
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

size_t workspace_bytes(int64_t k, int64_t n, int64_t d, DType dtype) { return layout(k, n, d, dtype).total; }
size_t gather_workspace_bytes() { return kGatherWorkspace; }

void index_add_rows(const Matrix& out, const IndexVector& index, const ConstMatrix& src, const WeightVector& weight,
                    std::optional<int64_t> ignore, void* ws, size_t ws_bytes, cudaStream_t stream, IndexCheck check) {
  const char* op = "index_add_rows";
  const int64_t k = index.size, n = out.rows;
  const Layout l = layout(k, n, out.cols, out.dtype);
  check_args(op, out, "out", src, "src", k, weight, ws_bytes, l.total);
  if (k == 0) return;
  auto* bad = at<unsigned long long>(ws, l.flags);
  const bool plan = out.cols != 0;
  by_index(index.type, [&](auto tag) {
    using I = decltype(tag);
    launch_check<I>(index, n, ignore, bad, l.flag_bytes, plan ? at<uint32_t>(ws, l.keys_in) : nullptr,
                    at<uint32_t>(ws, l.ids_in), stream);
  });
  if (plan) {
    // Plan: stable sort of (key, source id) pairs by key; then the rows, one run each (long runs
    // in pieces, then added up).
    size_t tb = l.temp_bytes;
    check_cuda(cub::DeviceRadixSort::SortPairs(at<void>(ws, l.temp), tb, at<uint32_t>(ws, l.keys_in),
                                               at<uint32_t>(ws, l.keys_out), at<uint32_t>(ws, l.ids_in),
                                               at<uint32_t>(ws, l.ids_out), static_cast<int>(k), 0, key_bits(n),
                                               stream), "sort");
    by_dtype(out.dtype, [&](auto tag) { launch_add<decltype(tag)>(out, src, weight.data, ws, l, k, stream); });
  }
  by_index(index.type, [&](auto tag) { report<decltype(tag)>(op, index, n, ignore, bad, check, stream); });
}

void gather_rows(const Matrix& dst, const ConstMatrix& x, const IndexVector& index, const WeightVector& weight,
                 std::optional<int64_t> ignore, void* ws, size_t ws_bytes, cudaStream_t stream, IndexCheck check) {
  const char* op = "gather_rows";
  const int64_t k = index.size;
  check_args(op, x, "x", dst, "dst", k, weight, ws_bytes, kGatherWorkspace);
  if (k == 0) return;
  auto* bad = static_cast<unsigned long long*>(ws);
  by_index(index.type, [&](auto itag) {
    using I = decltype(itag);
    launch_check<I>(index, x.rows, ignore, bad, sizeof(*bad), nullptr, nullptr, stream);
    if (dst.cols != 0)
      by_dtype(dst.dtype, [&](auto tag) { launch_gather<decltype(tag), I>(dst, x, index, weight.data, ignore, bad, stream); });
    report<I>(op, index, x.rows, ignore, bad, check, stream);
  });
}

}  // namespace cuda
}  // namespace scatter_add
