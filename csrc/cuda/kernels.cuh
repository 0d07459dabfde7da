// Device kernels of the CUDA path. Each kernel is a grid-stride loop over "warp tasks"; the work of
// one task is a __host__ __device__ function of (task, lane) that shares nothing with other lanes
// (no shuffles, no shared memory), so tests/cuda/host_sim.cu runs exactly this code on the CPU,
// task by task and lane by lane, and compares it with the CPU core bit for bit.
//
//   check_index   every index value against [0, N) (ignore_index excepted): the first bad
//                 position goes to *bad (atomicMin); also writes the sort keys and ids for the plan.
//   add_tile      one run of the sorted keys (a destination row) x one column tile:
//                 out = round(out + sum_j w_j * src_j), the contributions in source order,
//                 accumulated in float32 (float64 for f64); runs longer than kSegment in pieces,
//   finish_tile   which this second pass adds up.
//   gather_tile   one output row x one column tile: dst[i] = w[i] * x[index[i]] (0 for ignored).
// Both writers return before touching memory when *bad is set, so a bad index writes nothing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#define SA_HD __host__ __device__ __forceinline__

namespace scatter_add {
namespace cuda {
namespace kernels {

constexpr unsigned long long kNoBad = ~0ull;

template <class T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };
template <class T> using acc_t = typename Acc<T>::type;

template <class T, class A> SA_HD A to_acc(T v) { return static_cast<A>(v); }
template <> SA_HD float to_acc<__nv_bfloat16, float>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> SA_HD float to_acc<__half, float>(__half v) { return __half2float(v); }
template <class T, class A> SA_HD T from_acc(A v) { return static_cast<T>(v); }
template <> SA_HD __nv_bfloat16 from_acc<__nv_bfloat16, float>(float v) { return __float2bfloat16_rn(v); }
template <> SA_HD __half from_acc<__half, float>(float v) { return __float2half_rn(v); }
// w * x + a with one rounding, as the CPU core's FMA paths.
SA_HD float mad(float w, float x, float a) { return fmaf(w, x, a); }
SA_HD double mad(double w, double x, double a) { return fma(w, x, a); }

SA_HD void note_bad(unsigned long long* bad, unsigned long long i) {
#if defined(__CUDA_ARCH__)
  atomicMin(bad, i);
#else
  if (i < *bad) *bad = i;
#endif
}

// VEC elements moved as one aligned chunk (16 bytes when VEC * sizeof(T) == 16).
template <class T, int VEC>
struct alignas(sizeof(T) * VEC) Chunk {
  T v[VEC];
};

// Chunks per lane in one tile: a few independent 16-byte loads in flight per lane and source.
template <int VEC> constexpr int kChunksPerLane = VEC == 1 ? 4 : 2;
template <int VEC> constexpr int64_t kTileCols = 32 * VEC * kChunksPerLane<VEC>;
template <int VEC> inline int64_t tiles(int64_t d) { return (d + kTileCols<VEC> - 1) / kTileCols<VEC>; }

// Elements per 16-byte chunk (16 / sizeof(T)) if d is a multiple of it and every row start of
// every view is 16-byte aligned, else 1.
template <class T>
int vec_width(int64_t d, std::initializer_list<std::pair<const void*, int64_t>> views) {
  constexpr int v = static_cast<int>(16 / sizeof(T));
  if (d % v != 0) return 1;
  for (auto& p : views)
    if (reinterpret_cast<uintptr_t>(p.first) % 16 != 0 || (p.second * int64_t(sizeof(T))) % 16 != 0) return 1;
  return v;
}

// Calls f(std::integral_constant<int, VEC>{}, std::bool_constant<WEIGHTED>{}) for the variant the
// launcher and the host simulation both use.
template <class T, class F>
void with_variant(int vec, bool weighted, F&& f) {
  constexpr int V = static_cast<int>(16 / sizeof(T));
  if (vec == V) {
    if (weighted) f(std::integral_constant<int, V>{}, std::true_type{});
    else f(std::integral_constant<int, V>{}, std::false_type{});
  } else {
    if (weighted) f(std::integral_constant<int, 1>{}, std::true_type{});
    else f(std::integral_constant<int, 1>{}, std::false_type{});
  }
}

// ---- index check + sort keys ---------------------------------------------------------------
template <class I>
struct KeyArgs {
  const I* index;
  int64_t k, n;
  bool has_ignore;
  int64_t ignore;
  uint32_t* keys;  // null: check only (gather)
  uint32_t* ids;
  unsigned long long* bad;
};

// Key = destination row, or n (sorted last, then skipped) for ignore_index and for bad values.
template <class I>
SA_HD void check_one(const KeyArgs<I>& a, int64_t i) {
  const int64_t v = static_cast<int64_t>(a.index[i]);
  const bool ignored = a.has_ignore && v == a.ignore;
  const bool ok = ignored || (v >= 0 && v < a.n);
  if (!ok) note_bad(a.bad, static_cast<unsigned long long>(i));
  if (a.keys != nullptr) {
    a.keys[i] = static_cast<uint32_t>(ignored || !ok ? a.n : v);
    a.ids[i] = static_cast<uint32_t>(i);
  }
}

// ---- index_add: one warp task per (sorted position, column tile) ---------------------------
// keys/ids are the stable sort of (destination, source id) pairs; a run of equal keys is one
// destination row. The task at the first position of a run sums it; the others return at once
// (the plan is the sort alone: no run-length encoding, no scan).
//
// A run of more than kSegment contributions (a hot row) would leave one warp per column tile to
// walk it alone, so it is cut at the sorted positions that are multiples of kSegment ("blocks"):
// the run's first task sums its piece up to the next multiple into tail[block], the task at each
// multiple it crosses sums the next piece into head[block], and finish_tile (a second kernel)
// adds out + tail + head + head + ... in block order. The pieces depend only on the sorted
// positions, so the result is still bitwise deterministic; only rounding differs from one
// sequential sum. Runs of at most kSegment contributions are one sequential sum seeded with out,
// exactly as the CPU core computes them.
constexpr int64_t kSegment = 256;

template <class T>
struct AddArgs {
  T* out;
  int64_t out_stride;
  const T* src;
  int64_t src_stride;
  const acc_t<T>* w;     // per source row; unused when unweighted
  const uint32_t* keys;  // sorted destinations; the sentinel (N, ignored entries) sorts last
  const uint32_t* ids;   // source rows in the same order (ascending within a destination)
  int64_t k;
  uint32_t sentinel;
  int64_t d, tiles;
  const unsigned long long* bad;
  acc_t<T>* tail;         // [blocks, d] the first piece of the long run that starts in block b
  acc_t<T>* head;         // [blocks, d] the piece of a long run that continues through block b
  uint32_t* long_start;   // [blocks] where that long run starts, or ~0 (set before the call)
};

// Length of the run of `key` from pos, stopping at `limit`, reading 4 keys per step
// (independent loads); the keys read are keys[pos + stride * i].
SA_HD int64_t run_length(const uint32_t* keys, int64_t limit, int64_t pos, uint32_t key, int64_t stride = 1) {
  int64_t m_total = 1;
  for (;;) {
    uint32_t next[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t at = pos + stride * (m_total + u);
      next[u] = at < limit ? keys[at] : ~key;
    }
    int m = 0;
    while (m < 4 && next[m] == key) ++m;
    m_total += m;
    if (m < 4) return m_total;
  }
}

// Loads the lane's chunks of row `o` (VEC elements each, U chunks 32 * VEC apart) into acc.
template <class T, int VEC, int U>
SA_HD void load_acc(acc_t<T> (&acc)[U][VEC], const T* o, const bool (&live)[U]) {
  using C = Chunk<T, VEC>;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!live[u]) continue;
    const C oc = *reinterpret_cast<const C*>(o + u * 32 * VEC);
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[u][e] = to_acc<T, acc_t<T>>(oc.v[e]);
  }
}

template <class T, int VEC, int U>
SA_HD void store_acc(T* o, const acc_t<T> (&acc)[U][VEC], const bool (&live)[U]) {
  using C = Chunk<T, VEC>;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!live[u]) continue;
    C r;
#pragma unroll
    for (int e = 0; e < VEC; ++e) r.v[e] = from_acc<T, acc_t<T>>(acc[u][e]);
    *reinterpret_cast<C*>(o + u * 32 * VEC) = r;
  }
}

// acc += sum over sorted positions [beg, end) of w[id] * src[id], in order.
template <class T, int VEC, int U, bool WEIGHTED>
SA_HD void add_sources(acc_t<T> (&acc)[U][VEC], const AddArgs<T>& a, int64_t c0, int64_t beg, int64_t end,
                       const bool (&live)[U]) {
  using A = acc_t<T>;
  using C = Chunk<T, VEC>;
  for (int64_t j = beg; j < end; ++j) {
    const uint32_t id = a.ids[j];
    const T* s = a.src + int64_t(id) * a.src_stride + c0;
    C x[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (live[u]) x[u] = *reinterpret_cast<const C*>(s + u * 32 * VEC);
    const A wj = WEIGHTED ? a.w[id] : A(1);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!live[u]) continue;
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        acc[u][e] = WEIGHTED ? mad(wj, to_acc<T, A>(x[u].v[e]), acc[u][e]) : acc[u][e] + to_acc<T, A>(x[u].v[e]);
    }
  }
}

template <int VEC, int U>
SA_HD void live_chunks(bool (&live)[U], int64_t c0, int64_t d) {
#pragma unroll
  for (int u = 0; u < U; ++u) live[u] = c0 + u * 32 * VEC < d;  // VEC > 1 only when VEC divides d
}

template <class T, int VEC, bool WEIGHTED>
SA_HD void add_tile(const AddArgs<T>& a, int64_t task, int lane) {
  constexpr int U = kChunksPerLane<VEC>;
  if (*a.bad != kNoBad) return;
  const int64_t pos = task / a.tiles;
  const uint32_t row = a.keys[pos];
  if (row == a.sentinel) return;
  const bool first = pos == 0 || a.keys[pos - 1] != row;
  if (!first && pos % kSegment != 0) return;
  const int64_t c0 = (task % a.tiles) * kTileCols<VEC> + int64_t(lane) * VEC;
  bool live[U];
  live_chunks<VEC, U>(live, c0, a.d);
  // What this task sums, [pos, end), and where: into out (seeded with it) or into a piece.
  const int64_t block = pos / kSegment, block_end = (block + 1) * kSegment;
  acc_t<T>* piece = nullptr;
  int64_t end;
  if (!first) {  // a run crossing a multiple of kSegment: its piece in this block (unused when short)
    end = pos + run_length(a.keys, block_end < a.k ? block_end : a.k, pos, row);
    piece = a.head + block * a.d;
  } else if (pos + kSegment < a.k && a.keys[pos + kSegment] == row) {  // > kSegment contributions
    end = block_end;
    piece = a.tail + block * a.d;
    if (task % a.tiles == 0 && lane == 0) a.long_start[block] = static_cast<uint32_t>(pos);
  } else {
    end = pos + run_length(a.keys, a.k, pos, row);
  }
  acc_t<T> acc[U][VEC];
  T* o = a.out + int64_t(row) * a.out_stride + c0;
  if (piece == nullptr) {
    load_acc<T, VEC, U>(acc, o, live);
  } else {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[u][e] = acc_t<T>(0);
  }
  add_sources<T, VEC, U, WEIGHTED>(acc, a, c0, pos, end, live);
  if (piece == nullptr) {
    store_acc<T, VEC, U>(o, acc, live);
    return;
  }
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (live[u])
#pragma unroll
      for (int e = 0; e < VEC; ++e) piece[c0 + u * 32 * VEC + e] = acc[u][e];
}

// The second pass for long runs: one task per (block, column tile); out = out + tail + heads.
template <class T, int VEC>
SA_HD void finish_tile(const AddArgs<T>& a, int64_t task, int lane) {
  constexpr int U = kChunksPerLane<VEC>;
  if (*a.bad != kNoBad) return;
  const int64_t block = task / a.tiles;
  const uint32_t start = a.long_start[block];
  if (start == ~0u) return;
  const uint32_t row = a.keys[start];
  const int64_t c0 = (task % a.tiles) * kTileCols<VEC> + int64_t(lane) * VEC;
  bool live[U];
  live_chunks<VEC, U>(live, c0, a.d);
  // Blocks the run reaches: this one, then each next block whose first key is still `row`.
  const int64_t blocks = run_length(a.keys, a.k, block * kSegment, row, kSegment);
  acc_t<T> acc[U][VEC];
  T* o = a.out + int64_t(row) * a.out_stride + c0;
  load_acc<T, VEC, U>(acc, o, live);
  for (int64_t b = 0; b < blocks; ++b) {
    const acc_t<T>* p = (b == 0 ? a.tail + block * a.d : a.head + (block + b) * a.d) + c0;
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (live[u])
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[u][e] += p[u * 32 * VEC + e];
  }
  store_acc<T, VEC, U>(o, acc, live);
}

// ---- gather: one warp task per (output row, column tile) -----------------------------------
template <class T, class I>
struct GatherArgs {
  T* dst;
  int64_t dst_stride;
  const T* x;
  int64_t x_stride;
  const I* index;
  int64_t k;
  bool has_ignore;
  int64_t ignore;
  const acc_t<T>* w;
  int64_t d, tiles;
  const unsigned long long* bad;
};

template <class T, class I, int VEC, bool WEIGHTED>
SA_HD void gather_tile(const GatherArgs<T, I>& a, int64_t task, int lane) {
  using A = acc_t<T>;
  using C = Chunk<T, VEC>;
  constexpr int U = kChunksPerLane<VEC>;
  if (*a.bad != kNoBad) return;
  const int64_t i = task / a.tiles;
  if (i >= a.k) return;
  const int64_t v = static_cast<int64_t>(a.index[i]);
  const bool skip = a.has_ignore && v == a.ignore;
  const int64_t c0 = (task % a.tiles) * kTileCols<VEC> + int64_t(lane) * VEC;
  T* o = a.dst + i * a.dst_stride + c0;
  const T* s = a.x + (skip ? 0 : v) * a.x_stride + c0;
  C r[U];
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (!skip && c0 + u * 32 * VEC < a.d) r[u] = *reinterpret_cast<const C*>(s + u * 32 * VEC);
  const A wi = WEIGHTED && !skip ? a.w[i] : A(1);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (c0 + u * 32 * VEC >= a.d) continue;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      if (skip) r[u].v[e] = from_acc<T, A>(A(0));
      else if (WEIGHTED) r[u].v[e] = from_acc<T, A>(wi * to_acc<T, A>(r[u].v[e]));
    }
    *reinterpret_cast<C*>(o + u * 32 * VEC) = r[u];
  }
}

// ---- the __global__ wrappers ---------------------------------------------------------------
template <class I>
__global__ void check_index(KeyArgs<I> a) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < a.k; i += int64_t(gridDim.x) * blockDim.x)
    check_one(a, i);
}

template <class T, int VEC, bool WEIGHTED>
__global__ void __launch_bounds__(256) add_rows(AddArgs<T> a, int64_t tasks) {
  const int64_t step = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t t = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; t < tasks; t += step)
    add_tile<T, VEC, WEIGHTED>(a, t, threadIdx.x % 32);
}

template <class T, int VEC>
__global__ void __launch_bounds__(256) finish_rows(AddArgs<T> a, int64_t tasks) {
  const int64_t step = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t t = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; t < tasks; t += step)
    finish_tile<T, VEC>(a, t, threadIdx.x % 32);
}

template <class T, class I, int VEC, bool WEIGHTED>
__global__ void __launch_bounds__(256) gather_rows(GatherArgs<T, I> a, int64_t tasks) {
  const int64_t step = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t t = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; t < tasks; t += step)
    gather_tile<T, I, VEC, WEIGHTED>(a, t, threadIdx.x % 32);
}

// The no-wait mode: a bad index stops the stream's work here, as torch's device-side asserts do.
__global__ void trap_if_bad(const unsigned long long* bad) {
  if (*bad != kNoBad) {
    printf("scatter_add: index[%llu] is out of range (or not ignore_index); nothing was written\n", *bad);
    __trap();
  }
}

}  // namespace kernels
}  // namespace cuda
}  // namespace scatter_add
