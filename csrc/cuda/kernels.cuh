// Device kernels of the CUDA path. The work of every kernel that reads or writes rows is a
// __host__ __device__ function of (task, lane) that shares nothing with other lanes (no shuffles,
// no shared memory), and the plan's per-element steps are __host__ __device__ functions too, so
// tests/cuda/host_sim.cu runs exactly this code on the CPU and compares it with the CPU core bit
// for bit. Only the glue is device-only: CUB's sorts, block reductions, warp-aggregated slots.
//
// The plan of an index (what Plan::build leaves in its memory):
//   keys     [K]    the destination row of each source (N for ignore_index and for bad values)
//   ids      [K]    source ids stably sorted by destination, so ascending within a row
//   runs     [cap]  one (row, begin, length) record per destination row that has contributions:
//                   rows of at most kHotRun contributions from the front, hotter rows from the back
//   header          the counts, the first bad position and its value
// Built by plan_small (K <= kSmallK: one block validates, sorts in shared memory and emits runs;
// one launch) or by check_index + CUB's radix sort + emit_runs.
//
// index_add: one warp task per (run, column tile). The task loads out's tile, adds the run's
// contributions in source order (fma(w, s, acc), or acc + s unweighted, in float32, float64 for
// f64), rounds once and stores: the CPU core's arithmetic, so the same bits. A hot row is summed
// the same way, sequentially; its parallelism comes from narrower column tiles (4 bytes per lane
// instead of 32), so more warps share the row. Every task issues the loads of several sources
// (kAhead, kHotAhead) before their FMAs, which still run in source order.
// gather: one warp task per (output row, column tile): dst[i] = round(w[i] * x[index[i]]).
// No writing kernel touches memory when the index has a bad value, so a bad index writes nothing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

#if defined(__CUDACC__)
#include <cub/block/block_radix_sort.cuh>
#endif

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
// Round to nearest even, keeping subnormals (nvcc does not flush unless built with -ftz=true).
template <class T, class A> SA_HD T from_acc(A v) { return static_cast<T>(v); }
template <> SA_HD __nv_bfloat16 from_acc<__nv_bfloat16, float>(float v) { return __float2bfloat16_rn(v); }
template <> SA_HD __half from_acc<__half, float>(float v) { return __float2half_rn(v); }
// w * x + a with one rounding, as the CPU core computes weighted contributions.
SA_HD float mad(float w, float x, float a) { return fmaf(w, x, a); }
SA_HD double mad(double w, double x, double a) { return fma(w, x, a); }

// ---- the plan's records -----------------------------------------------------------------------
struct alignas(16) Run {
  uint32_t row, begin, len, unused;
};

struct alignas(16) Header {
  unsigned long long bad;  // first bad source position, or kNoBad
  long long bad_value;     // index[bad]
  uint32_t n_normal;       // runs[0, n_normal): rows of at most kHotRun contributions
  uint32_t n_hot;          // runs[cap - n_hot, cap): the others
  uint32_t kept;           // sorted positions before the first N key (ignored and bad values)
  uint32_t unused;
};

// A call's outcome as the host reads it: written by the device into pinned host memory.
struct alignas(32) Report {
  unsigned long long bad;
  long long value;
  unsigned int done;  // written last
  unsigned int unused[3];
};

// A row with more contributions than this is "hot": summed over narrow column tiles.
constexpr uint32_t kHotRun = 64;
// Sources whose loads are in flight before their FMAs: wide tiles, and hot rows' narrow tiles.
constexpr int kAhead = 4;
constexpr int kHotAhead = 8;
// add_rows' block: 4 warps (its tasks need about 90 to 160 registers per thread, so small
// blocks fill the register file better).
constexpr int kAddThreads = 128;
// plan_small: one block of kSmallThreads threads x kSmallItems indices.
constexpr int kSmallThreads = 1024;
constexpr int kSmallItems = 4;
constexpr int64_t kSmallK = int64_t(kSmallThreads) * kSmallItems;

// VEC elements moved as one aligned chunk (16 bytes when VEC * sizeof(T) == 16).
template <class T, int VEC>
struct alignas(sizeof(T) * VEC) Chunk {
  T v[VEC];
};

// Wide tiles: chunks per lane (a few independent 16-byte loads in flight per source).
template <int VEC> constexpr int kChunksPerLane = VEC == 1 ? 4 : 2;
template <int VEC> constexpr int64_t kTileCols = 32 * VEC * kChunksPerLane<VEC>;
// Hot rows' narrow tiles: 4 bytes per lane (one element for float32/float64), one chunk.
template <class T, int VEC> constexpr int kNarrowVec = (VEC == 1 || sizeof(T) >= 4) ? 1 : int(4 / sizeof(T));
template <class T, int VEC> constexpr int64_t kNarrowCols = 32 * kNarrowVec<T, VEC>;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

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

// ---- the plan's per-element steps -------------------------------------------------------------
// Key of source i: its destination row, or n (sorted last, then skipped) for ignore_index and for
// bad values; *ok is false for a bad value.
template <class I>
SA_HD uint32_t key_of(const I* index, int64_t i, int64_t n, bool has_ignore, int64_t ignore, bool* ok) {
  const int64_t v = static_cast<int64_t>(index[i]);
  const bool ignored = has_ignore && v == ignore;
  *ok = ignored || (v >= 0 && v < n);
  return static_cast<uint32_t>(ignored || !*ok ? n : v);
}

// End of the run of keys[p] in the sorted keys[0, k), reading O(log length) keys.
SA_HD int64_t run_end(const uint32_t* keys, int64_t k, int64_t p) {
  const uint32_t key = keys[p];
  int64_t lo = p, hi = k, step = 1;  // keys[lo] == key; keys[hi] != key or hi == k
  for (;;) {
    const int64_t q = lo + step;
    if (q >= k) break;
    if (keys[q] != key) {
      hi = q;
      break;
    }
    lo = q;
    step *= 2;
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (keys[mid] == key ? lo : hi) = mid;
  }
  return hi;
}

enum class RunKind { none, sentinel, normal, hot };

// What starts at sorted position p: nothing (not a run's first position), the run of ignored and
// bad entries (key n), or a destination row's run, written to *r.
SA_HD RunKind run_at(const uint32_t* keys, int64_t k, int64_t p, uint32_t n, Run* r) {
  const uint32_t key = keys[p];
  if (p > 0 && keys[p - 1] == key) return RunKind::none;
  if (key == n) return RunKind::sentinel;
  const int64_t len = run_end(keys, k, p) - p;
  *r = Run{key, static_cast<uint32_t>(p), static_cast<uint32_t>(len), 0u};
  return len > kHotRun ? RunKind::hot : RunKind::normal;
}

// Normal runs fill runs[] from the front, hot runs from the back (cap >= the number of runs).
SA_HD void put_run(Run* runs, uint32_t cap, RunKind kind, uint32_t slot, const Run& r) {
  runs[kind == RunKind::hot ? cap - 1 - slot : slot] = r;
}

SA_HD void publish(Report* r, unsigned long long bad, long long value) {
  r->bad = bad;
  r->value = value;
#if defined(__CUDA_ARCH__)
  __threadfence_system();  // the payload reaches the host before `done`
  *reinterpret_cast<volatile unsigned int*>(&r->done) = 1u;
#else
  __atomic_store_n(&r->done, 1u, __ATOMIC_RELEASE);
#endif
}

// The end of a check: the first bad position (and its value) into the plan's header and the
// host's report; in trap mode a bad index stops the stream's work here.
template <class I>
SA_HD void conclude(Header* h, unsigned long long bad, const I* index, Report* report, bool trap) {
  const long long value = bad != kNoBad ? static_cast<long long>(index[bad]) : 0;
  if (h != nullptr) {
    h->bad = bad;
    h->bad_value = value;
  }
  if (report != nullptr) publish(report, bad, value);
#if defined(__CUDA_ARCH__)
  if (trap && bad != kNoBad) {
    printf("scatter_add: index[%llu] = %lld is out of range (or not ignore_index); nothing was written\n", bad,
           value);
    __trap();
  }
#else
  (void)trap;
#endif
}

// ---- index_add: one warp task per (run, column tile) ------------------------------------------
template <class T>
struct AddArgs {
  T* out;
  int64_t out_stride;
  const T* src;
  int64_t src_stride;
  const acc_t<T>* w;    // per source row; unused when unweighted
  const uint32_t* ids;  // the plan's sorted source ids
  const Run* runs;
  uint32_t cap;
  const Header* h;
  int64_t d, tiles_w, tiles_h;  // column tiles per normal run (wide) and per hot run (narrow)
};

// acc += the run's contributions, in source order. The ids of the next P sources are loaded
// while the current P are added; each group's source and weight loads are all issued before the
// group's first FMA.
template <class T, int VEC, int U, int P, bool WEIGHTED>
SA_HD void sum_run(acc_t<T> (&acc)[U][VEC], const AddArgs<T>& a, const Run& r, int64_t c0, const bool (&live)[U]) {
  using A = acc_t<T>;
  using C = Chunk<T, VEC>;
  const uint32_t* ids = a.ids + r.begin;
  const uint32_t len = r.len;
  uint32_t next[P];
#pragma unroll
  for (int p = 0; p < P; ++p) next[p] = uint32_t(p) < len ? ids[p] : 0u;
  for (uint32_t j = 0; j < len; j += P) {
    C x[P][U];
    A wv[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const bool in = j + p < len;
      const T* s = a.src + int64_t(next[p]) * a.src_stride + c0;
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (in && live[u]) x[p][u] = *reinterpret_cast<const C*>(s + u * 32 * VEC);
      wv[p] = WEIGHTED && in ? a.w[next[p]] : A(1);
    }
#pragma unroll
    for (int p = 0; p < P; ++p) next[p] = j + P + p < len ? ids[j + P + p] : 0u;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      if (j + p >= len) break;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (!live[u]) continue;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const A s = to_acc<T, A>(x[p][u].v[e]);
          acc[u][e] = WEIGHTED ? mad(wv[p], s, acc[u][e]) : acc[u][e] + s;
        }
      }
    }
  }
}

// out[row, tile] = round(out[row, tile] + the run's contributions); lane's chunks at c0, 32*VEC apart.
template <class T, int VEC, int U, int P, bool WEIGHTED>
SA_HD void row_tile(const AddArgs<T>& a, const Run& r, int64_t c0) {
  using A = acc_t<T>;
  using C = Chunk<T, VEC>;
  bool live[U];
#pragma unroll
  for (int u = 0; u < U; ++u) live[u] = c0 + u * 32 * VEC < a.d;  // VEC > 1 only when VEC divides d
  T* o = a.out + int64_t(r.row) * a.out_stride + c0;
  A acc[U][VEC];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!live[u]) continue;
    const C oc = *reinterpret_cast<const C*>(o + u * 32 * VEC);
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[u][e] = to_acc<T, A>(oc.v[e]);
  }
  sum_run<T, VEC, U, P, WEIGHTED>(acc, a, r, c0, live);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!live[u]) continue;
    C res;
#pragma unroll
    for (int e = 0; e < VEC; ++e) res.v[e] = from_acc<T, A>(acc[u][e]);
    *reinterpret_cast<C*>(o + u * 32 * VEC) = res;
  }
}

// Tasks [0, n_hot * tiles_h) are the hot runs' narrow tiles (first, as they take longest), then
// n_normal * tiles_w wide tiles.
template <class T>
SA_HD int64_t add_tasks(const AddArgs<T>& a, uint32_t n_normal, uint32_t n_hot) {
  return int64_t(n_hot) * a.tiles_h + int64_t(n_normal) * a.tiles_w;
}

template <class T, int VEC, bool WEIGHTED>
SA_HD void add_task(const AddArgs<T>& a, int64_t task, int lane, uint32_t n_hot) {
  constexpr int VH = kNarrowVec<T, VEC>;
  const int64_t hot_tasks = int64_t(n_hot) * a.tiles_h;
  if (task < hot_tasks) {
    const Run r = a.runs[a.cap - 1 - task / a.tiles_h];
    const int64_t c0 = (task % a.tiles_h) * kNarrowCols<T, VEC> + int64_t(lane) * VH;
    row_tile<T, VH, 1, kHotAhead, WEIGHTED>(a, r, c0);
  } else {
    const int64_t t = task - hot_tasks;
    const Run r = a.runs[t / a.tiles_w];
    const int64_t c0 = (t % a.tiles_w) * kTileCols<VEC> + int64_t(lane) * VEC;
    row_tile<T, VEC, kChunksPerLane<VEC>, kAhead, WEIGHTED>(a, r, c0);
  }
}

// ---- gather: one warp task per (output row, column tile) --------------------------------------
// With a plan, index is the plan's keys (uint32, N for ignored entries: ignore = N).
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
};

template <class T, class I, int VEC, bool WEIGHTED>
SA_HD void gather_tile(const GatherArgs<T, I>& a, int64_t task, int lane) {
  using A = acc_t<T>;
  using C = Chunk<T, VEC>;
  constexpr int U = kChunksPerLane<VEC>;
  const int64_t i = task / a.tiles;
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

// ---- the __global__ kernels (device-only glue around the functions above) --------------------
#if defined(__CUDACC__)

template <class I>
struct CheckArgs {
  const I* index;
  int64_t k, n;
  bool has_ignore;
  int64_t ignore;
  uint32_t* keys;                 // [k] key_of each source; null: check only (gather)
  uint32_t* ids;                  // [k] 0..k-1, the sort's values (with keys)
  unsigned long long* block_bad;  // [gridDim.x] the first bad position each block saw
  Header* h;                      // counters reset by block 0 (null: gather)
};

// Every index value against [0, n) (ignore_index excepted); grid-stride over at most
// kCheckBlocks blocks, each leaving its first bad position in block_bad.
template <class I>
__global__ void __launch_bounds__(256) check_index(CheckArgs<I> a) {
  __shared__ unsigned long long first;
  if (threadIdx.x == 0) first = kNoBad;
  if (blockIdx.x == 0 && threadIdx.x == 0 && a.h != nullptr) {
    a.h->n_normal = 0;
    a.h->n_hot = 0;
    a.h->kept = static_cast<uint32_t>(a.k);
  }
  __syncthreads();
  unsigned long long mine = kNoBad;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < a.k; i += int64_t(gridDim.x) * blockDim.x) {
    bool ok;
    const uint32_t key = key_of(a.index, i, a.n, a.has_ignore, a.ignore, &ok);
    if (!ok && mine == kNoBad) mine = static_cast<unsigned long long>(i);
    if (a.keys != nullptr) {
      a.keys[i] = key;
      a.ids[i] = static_cast<uint32_t>(i);
    }
  }
  if (mine != kNoBad) atomicMin(&first, mine);
  __syncthreads();
  if (threadIdx.x == 0) a.block_bad[blockIdx.x] = first;
}

// The first bad position over check_index's blocks, in every thread of the calling block.
__device__ __forceinline__ unsigned long long first_bad(const unsigned long long* block_bad, int blocks) {
  __shared__ unsigned long long first;
  if (threadIdx.x == 0) first = kNoBad;
  __syncthreads();
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) {
    const unsigned long long v = block_bad[b];
    if (v != kNoBad) atomicMin(&first, v);
  }
  __syncthreads();
  return first;
}

template <class I>
struct RunsArgs {
  const uint32_t* keys;  // sorted
  int64_t k;
  uint32_t n;
  Run* runs;
  uint32_t cap;
  Header* h;
  const unsigned long long* block_bad;
  int check_blocks;
  const I* index;
  Report* report;
  bool trap;
};

// One thread per sorted position: the runs that start there, appended with one atomic per warp
// (their order in runs[] is free: every run is summed on its own). Block 0 also concludes the
// check (the first bad position, the host's report, the trap).
template <class I>
__global__ void __launch_bounds__(256) emit_runs(RunsArgs<I> a) {
  if (blockIdx.x == 0) {
    const unsigned long long bad = first_bad(a.block_bad, a.check_blocks);
    if (threadIdx.x == 0) conclude(a.h, bad, a.index, a.report, a.trap);
  }
  const int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  Run r{};
  const RunKind kind = p < a.k ? run_at(a.keys, a.k, p, a.n, &r) : RunKind::none;
  if (kind == RunKind::sentinel) a.h->kept = static_cast<uint32_t>(p);
  const unsigned lane = threadIdx.x % 32;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const RunKind want = c == 0 ? RunKind::normal : RunKind::hot;
    const unsigned m = __ballot_sync(~0u, kind == want);
    if (m == 0) continue;
    const int leader = __ffs(m) - 1;
    unsigned base = 0;
    if (int(lane) == leader) base = atomicAdd(c == 0 ? &a.h->n_normal : &a.h->n_hot, unsigned(__popc(m)));
    base = __shfl_sync(~0u, base, leader);
    if (kind == want) put_run(a.runs, a.cap, kind, base + __popc(m & ((1u << lane) - 1u)), r);
  }
}

template <class I>
struct SmallPlanArgs {
  const I* index;
  int64_t k, n;
  bool has_ignore;
  int64_t ignore;
  int bits;        // key bits to sort on: keys are at most n
  uint32_t* keys;  // [k] key_of each source
  uint32_t* ids;   // [k] sorted source ids
  Run* runs;
  uint32_t cap;
  Header* h;
  Report* report;
  bool trap;
};

// The whole plan of an index of at most kSmallK entries in one block: check, stable sort in
// shared memory, runs, conclusion.
template <class I>
__global__ void __launch_bounds__(kSmallThreads) plan_small(SmallPlanArgs<I> a) {
  using Sort = cub::BlockRadixSort<uint32_t, kSmallThreads, kSmallItems, uint32_t>;
  __shared__ union {
    typename Sort::TempStorage sort;
    uint32_t keys[kSmallK];
  } s;
  __shared__ unsigned long long first;
  __shared__ uint32_t n_normal, n_hot, kept;
  const int t = threadIdx.x;
  if (t == 0) {
    first = kNoBad;
    n_normal = 0;
    n_hot = 0;
    kept = static_cast<uint32_t>(a.k);
  }
  uint32_t key[kSmallItems], id[kSmallItems];
  unsigned long long mine = kNoBad;
#pragma unroll
  for (int j = 0; j < kSmallItems; ++j) {  // blocked: thread t holds positions t * items + j
    const int64_t i = int64_t(t) * kSmallItems + j;
    id[j] = static_cast<uint32_t>(i);
    key[j] = ~0u;  // padding sorts after every key (its low `bits` bits are all ones, >= n)
    if (i < a.k) {
      bool ok;
      key[j] = key_of(a.index, i, a.n, a.has_ignore, a.ignore, &ok);
      a.keys[i] = key[j];
      if (!ok && mine == kNoBad) mine = static_cast<unsigned long long>(i);
    }
  }
  __syncthreads();
  if (mine != kNoBad) atomicMin(&first, mine);
  Sort(s.sort).Sort(key, id, 0, a.bits);  // stable
  __syncthreads();                        // s.sort is reused as s.keys
#pragma unroll
  for (int j = 0; j < kSmallItems; ++j) {
    const int64_t p = int64_t(t) * kSmallItems + j;
    if (p < a.k) {
      s.keys[p] = key[j];
      a.ids[p] = id[j];
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kSmallItems; ++j) {
    const int64_t p = int64_t(t) * kSmallItems + j;
    if (p >= a.k) break;
    Run r{};
    const RunKind kind = run_at(s.keys, a.k, p, static_cast<uint32_t>(a.n), &r);
    if (kind == RunKind::sentinel) kept = static_cast<uint32_t>(p);
    if (kind == RunKind::normal) put_run(a.runs, a.cap, kind, atomicAdd(&n_normal, 1u), r);
    if (kind == RunKind::hot) put_run(a.runs, a.cap, kind, atomicAdd(&n_hot, 1u), r);
  }
  __syncthreads();
  if (t == 0) {
    a.h->n_normal = n_normal;
    a.h->n_hot = n_hot;
    a.h->kept = kept;
    conclude(a.h, first, a.index, a.report, a.trap);
  }
}

// The hot tasks first, then the normal ones: two loops, so that the two tile shapes' registers
// are not live at once.
template <class T, int VEC, bool WEIGHTED>
__global__ void __launch_bounds__(kAddThreads) add_rows(AddArgs<T> a) {
  if (a.h->bad != kNoBad) return;
  const uint32_t n_normal = a.h->n_normal, n_hot = a.h->n_hot;
  const int64_t hot_tasks = int64_t(n_hot) * a.tiles_h;
  const int64_t tasks = add_tasks(a, n_normal, n_hot);
  const int64_t step = int64_t(gridDim.x) * (blockDim.x / 32);
  const int lane = threadIdx.x % 32;
  int64_t t = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  for (; t < hot_tasks; t += step) add_task<T, VEC, WEIGHTED>(a, t, lane, n_hot);
  for (; t < tasks; t += step) add_task<T, VEC, WEIGHTED>(a, t, lane, n_hot);
}

// Whether the writes may go ahead: a plan's header (h), or check_index's blocks, whose block 0
// also concludes the check.
template <class I>
struct Gate {
  const Header* h;
  const unsigned long long* block_bad;
  int check_blocks;
  Report* report;
  bool trap;
};

template <class T, class I, int VEC, bool WEIGHTED>
__global__ void __launch_bounds__(256) gather_rows(GatherArgs<T, I> a, int64_t tasks, Gate<I> g) {
  if (g.h != nullptr) {
    if (g.h->bad != kNoBad) return;
  } else {
    const unsigned long long bad = first_bad(g.block_bad, g.check_blocks);
    if (blockIdx.x == 0 && threadIdx.x == 0) conclude<I>(nullptr, bad, a.index, g.report, g.trap);
    if (bad != kNoBad) return;
  }
  const int64_t step = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t t = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; t < tasks; t += step)
    gather_tile<T, I, VEC, WEIGHTED>(a, t, threadIdx.x % 32);
}

#endif  // __CUDACC__

}  // namespace kernels
}  // namespace cuda
}  // namespace scatter_add
