// Launchers of the CUDA path (see scatter_add_cuda.h): argument checks that need no GPU, then a
// device guard and the pointer checks, then the plan (plan_small, or check_index + CUB's radix
// sort + emit_runs) and the writing kernel, and the bad-index report. Nothing waits for the GPU
// unless the caller asked for IndexCheck::sync.
//
// Launches per call: index_add with K <= 4096: 2 (plan_small, add_rows); larger K: check_index,
// CUB's sort (1 kernel up to about 4.9K entries, a few beyond), emit_runs, add_rows. gather: 2
// (check_index, gather_rows). With a plan: 1. No memset: every flag and counter is written by the
// kernel before the one that reads it.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "kernels.cuh"
#include "scatter_add_cuda.h"
#include "validate.h"  // the CPU core's argument checks

namespace scatter_add {
namespace cuda {

namespace kn = kernels;

namespace {

constexpr int kThreads = 256;      // 8 warps per block
constexpr int kCheckBlocks = 256;  // check_index's grid at most (grid-stride beyond)
constexpr int64_t kLimit = int64_t(1) << 31;
constexpr size_t kAlign = 16;  // the workspace's and a plan's alignment (16-byte run records)

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("scatter_add CUDA: ") + what + ": " + cudaGetErrorString(e));
}

[[noreturn]] void fail(const char* op, Error::Kind kind, const std::string& msg) {
  throw Error(kind, std::string(op) + ": " + msg);
}


std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

size_t align_up(size_t x) { return (x + 255) & ~size_t(255); }

int key_bits(int64_t n) {  // bits of the largest key, n (the sentinel)
  int b = 1;
  while (b < 32 && (int64_t(1) << b) <= n) ++b;
  return b;
}

// ---- argument checks (no CUDA call) ------------------------------------------------------------
// The views, dtypes, shapes and overlaps are the CPU core's checks (csrc/cpu/validate.h), with its
// messages; what follows is the CUDA path's own: limits, weight dtype, workspace, plan memory.

// Byte range [begin, end) of a buffer; empty when null.
struct Span {
  uintptr_t begin = 0, end = 0;
};
bool overlaps(Span a, Span b) { return a.begin < a.end && b.begin < b.end && a.begin < b.end && b.begin < a.end; }
Span bytes_span(const void* p, size_t bytes) {
  return p == nullptr ? Span{} : Span{reinterpret_cast<uintptr_t>(p), reinterpret_cast<uintptr_t>(p) + bytes};
}
// The bytes a view spans (it passed the core's checks, so this fits in the address space).
Span view_span(const ConstMatrix& m) {
  if (m.data == nullptr || m.rows <= 0 || m.cols <= 0) return {};
  return bytes_span(m.data, static_cast<size_t>((m.rows - 1) * (m.rows > 1 ? m.row_stride : 0) + m.cols) *
                                dtype_size(m.dtype));
}

void check_limits(const char* op, int64_t k, int64_t n) {
  if (k < 0) fail(op, Error::Kind::value, "index size must be >= 0, got " + std::to_string(k));
  if (n < 0) fail(op, Error::Kind::value, "num_rows must be >= 0, got " + std::to_string(n));
  if (n >= kLimit || k >= kLimit)
    fail(op, Error::Kind::value, "the CUDA path supports fewer than 2^31 rows and indices, got N=" +
                                     std::to_string(n) + " K=" + std::to_string(k));
}

void check_index_type(const char* op, const IndexVector& index) {
  if (index.type != IndexType::i32 && index.type != IndexType::i64)
    fail(op, Error::Kind::value, "index must be int32 or int64, got type code " + std::to_string(static_cast<int>(index.type)));
  if (index.size > 0 && index.data == nullptr)
    fail(op, Error::Kind::value, "index is null but has " + std::to_string(index.size) + " entries");
}

// The kernels read weights in the accumulator type.
void check_weight_dtype(const char* op, const WeightVector& w, int64_t k, DType data) {
  if (w.data == nullptr) return;
  const DType acc = data == DType::f64 ? DType::f64 : DType::f32;
  if (w.dtype != acc)
    fail(op, Error::Kind::value, std::string("weight must be ") + dtype_name(acc) + " with " + std::to_string(k) +
                                     " entries, got " + dtype_name(w.dtype));
}

// Scratch memory (the workspace or a plan's) must not share a byte with the written view.
void check_memory_overlap(const char* op, const char* name, const void* p, size_t bytes, const ConstMatrix& out,
                          const char* out_name) {
  if (overlaps(bytes_span(p, bytes), view_span(out)))
    fail(op, Error::Kind::value, std::string(name) + " memory overlaps " + out_name);
}

// The workspace (or a plan's memory): present, 16-byte aligned (its 8-byte flags and 16-byte run
// records need it), large enough.
void check_memory_arg(const char* op, const char* name, const void* p, size_t bytes, std::optional<size_t> needed) {
  if (p == nullptr) fail(op, Error::Kind::value, std::string(name) + " is null");
  if (reinterpret_cast<uintptr_t>(p) % kAlign != 0)
    fail(op, Error::Kind::value, std::string(name) + " at " + hex(p) + " is not " + std::to_string(kAlign) +
                                     "-byte aligned (cudaMalloc and torch's allocator give 256)");
  if (needed && bytes < *needed)
    fail(op, Error::Kind::value, std::string(name) + " of " + std::to_string(bytes) + " bytes is smaller than the " +
                                     std::to_string(*needed) + " needed");
}

// ---- the device: guard and pointers -------------------------------------------------------------
int stream_device(cudaStream_t stream) {
  int d = -1;
  check_cuda(cudaStreamGetDevice(stream, &d), "cudaStreamGetDevice");
  return d;
}

// Makes `device` current for the call and restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ == device) {
      prev_ = -1;
    } else {
      check_cuda(cudaSetDevice(device), "cudaSetDevice");
    }
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

// Every pointer the kernels use must be memory the stream's device can reach.
void check_pointer(const char* op, const char* name, const void* p, int device) {
  if (p == nullptr) return;
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: it is the answer for unregistered host memory on old drivers
    attr.type = cudaMemoryTypeUnregistered;
  }
  if (attr.type == cudaMemoryTypeUnregistered)
    fail(op, Error::Kind::value, std::string(name) + " at " + hex(p) +
                                     " is host memory the GPU cannot read (use cudaMalloc'd or pinned memory)");
  if (attr.type == cudaMemoryTypeDevice && attr.device != device)
    fail(op, Error::Kind::value, std::string(name) + " is on cuda:" + std::to_string(attr.device) +
                                     " but the stream is on cuda:" + std::to_string(device));
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus s = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &s), "cudaStreamIsCapturing");
  return s != cudaStreamCaptureStatusNone;
}

int sm_count(int device) {
  static std::atomic<int> cached[64];
  if (device >= 0 && device < 64) {
    const int v = cached[device].load(std::memory_order_relaxed);
    if (v > 0) return v;
  }
  int v = 0;
  check_cuda(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  if (device >= 0 && device < 64) cached[device].store(v, std::memory_order_relaxed);
  return v;
}

// Grid for `tasks` warp tasks in blocks of `threads`: up to 64 warps per multiprocessor,
// grid-stride beyond that.
int grid_for_tasks(int64_t tasks, int threads, int device) {
  const int64_t cap = int64_t(sm_count(device)) * (64 * 32 / threads);
  return static_cast<int>(std::clamp<int64_t>(kn::ceil_div(tasks, threads / 32), 1, std::max<int64_t>(cap, 1)));
}

// ---- bad-index reports: pinned host slots the device writes, read at the next call -------------
std::string bad_index_text(int64_t n, std::optional<int64_t> ignore, unsigned long long pos, long long value) {
  std::string msg = "index[" + std::to_string(pos) + "] = " + std::to_string(value) + " is out of range for " +
                    std::to_string(n) + " rows (valid: 0.." + std::to_string(n - 1) + ")";
  if (ignore) msg += " and is not ignore_index = " + std::to_string(*ignore);
  return msg;
}

class Reports {
 public:
  static Reports& instance() {
    static Reports* r = new Reports;  // never destroyed: its pinned memory must outlive every stream
    return *r;
  }

  // A slot for one call; the call's last check kernel writes it.
  kn::Report* open(const char* op, int64_t n, std::optional<int64_t> ignore, int device) {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) grow();
    kn::Report* slot = free_.back();
    free_.pop_back();
    slot->done = 0;
    slot->bad = kn::kNoBad;
    slot->value = 0;
    pending_.push_back({slot, op, n, ignore, device});
    return slot;
  }

  // A call that threw before its kernels were queued: its slot will never be written.
  void cancel(kn::Report* slot) {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < pending_.size(); ++i)
      if (pending_[i].slot == slot) {
        pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
        free_.push_back(slot);
        return;
      }
  }

  // Throws (as `op`) the earliest written report of a bad index; recycles the good ones.
  void raise_ready(const char* op) {
    std::string msg;
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_t keep = 0;
      bool found = false;
      for (size_t i = 0; i < pending_.size(); ++i) {
        Pending& p = pending_[i];
        if (!found && __atomic_load_n(&p.slot->done, __ATOMIC_ACQUIRE) != 0) {
          if (p.slot->bad != kn::kNoBad) {
            found = true;
            msg = bad_index_text(p.n, p.ignore, p.slot->bad, p.slot->value) + ", found on cuda:" +
                  std::to_string(p.device) + " after an earlier " + p.op +
                  " call had returned; that call wrote nothing, and this one was not run";
          }
          free_.push_back(p.slot);
          continue;
        }
        pending_[keep++] = p;
      }
      pending_.resize(keep);
      if (!found) return;
    }
    fail(op, Error::Kind::index, msg);
  }

  // sync mode, after the stream was synchronised: this call's own report.
  void raise_now(const char* op, kn::Report* slot) {
    std::string msg;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < pending_.size(); ++i) {
        if (pending_[i].slot != slot) continue;
        const Pending p = pending_[i];
        if (__atomic_load_n(&slot->done, __ATOMIC_ACQUIRE) == 0)
          throw std::runtime_error("scatter_add CUDA: the index check did not report after the stream completed");
        pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
        free_.push_back(slot);
        if (slot->bad == kn::kNoBad) return;
        msg = bad_index_text(p.n, p.ignore, slot->bad, slot->value);
        break;
      }
    }
    if (!msg.empty()) fail(op, Error::Kind::index, msg);
  }

  std::vector<int> pending_devices() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int> d;
    for (const Pending& p : pending_)
      if (std::find(d.begin(), d.end(), p.device) == d.end()) d.push_back(p.device);
    return d;
  }

 private:
  struct Pending {
    kn::Report* slot;
    const char* op;
    int64_t n;
    std::optional<int64_t> ignore;
    int device;
  };
  static constexpr size_t kChunk = 512;  // slots per pinned allocation

  void grow() {
    void* p = nullptr;
    // Portable: every device may write it; mapped: with unified addressing the host pointer is
    // the device pointer.
    check_cuda(cudaHostAlloc(&p, kChunk * sizeof(kn::Report), cudaHostAllocPortable | cudaHostAllocMapped),
               "cudaHostAlloc (bad-index reports)");
    auto* slots = static_cast<kn::Report*>(p);
    for (size_t i = 0; i < kChunk; ++i) free_.push_back(&slots[kChunk - 1 - i]);
  }

  std::mutex mu_;
  std::vector<kn::Report*> free_;
  std::vector<Pending> pending_;
};

// How one call reports a bad index: a slot (deferred, sync) or a trap.
struct Reporting {
  kn::Report* slot = nullptr;
  bool trap = false;
  bool wait = false;
};

Reporting start_report(const char* op, int64_t n, std::optional<int64_t> ignore, int device, IndexCheck check,
                       cudaStream_t stream) {
  Reporting r;
  if (check == IndexCheck::trap || capturing(stream)) {
    r.trap = true;
    return r;
  }
  r.slot = Reports::instance().open(op, n, ignore, device);
  r.wait = check == IndexCheck::sync;
  return r;
}

// Cancels the slot if the call throws before its kernels were queued.
class ReportScope {
 public:
  explicit ReportScope(const Reporting& r) : slot_(r.slot) {}
  void queued() { slot_ = nullptr; }
  ~ReportScope() {
    if (slot_ != nullptr) Reports::instance().cancel(slot_);
  }

 private:
  kn::Report* slot_;
};

void finish_report(const char* op, const Reporting& r, cudaStream_t stream) {
  if (!r.wait) return;
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  Reports::instance().raise_now(op, r.slot);
}

// ---- a plan's memory ---------------------------------------------------------------------------
// 256-byte aligned pieces from the plan's start: header, keys [k], ids [k], runs [cap], and for
// the large path the sort's input ids, output keys, check_index's block results and CUB's scratch.
struct Layout {
  bool small;
  uint32_t cap;
  int check_blocks;
  size_t header, keys, ids, runs, ids_in, keys_out, block_bad, temp, temp_bytes, total;
};

Layout layout(int64_t k, int64_t n, bool with_scratch) {
  Layout l{};
  l.small = k <= kn::kSmallK;
  l.cap = static_cast<uint32_t>(std::max<int64_t>(1, std::min(k, n)));
  l.check_blocks = static_cast<int>(std::clamp<int64_t>(kn::ceil_div(k, kThreads), 1, kCheckBlocks));
  const size_t arr = align_up(sizeof(uint32_t) * static_cast<size_t>(std::max<int64_t>(k, 1)));
  size_t at = 0;
  l.header = at;
  at += align_up(sizeof(kn::Header));
  l.keys = at;
  at += arr;
  l.ids = at;
  at += arr;
  l.runs = at;
  at += align_up(sizeof(kn::Run) * l.cap);
  if (!l.small) {
    l.ids_in = at;
    at += arr;
    l.keys_out = at;
    at += arr;
    l.block_bad = at;
    at += align_up(sizeof(unsigned long long) * kCheckBlocks);
    l.temp = at;
    if (with_scratch) {
      check_cuda(cub::DeviceRadixSort::SortPairs(nullptr, l.temp_bytes, (uint32_t*)nullptr, (uint32_t*)nullptr,
                                                 (uint32_t*)nullptr, (uint32_t*)nullptr, static_cast<int>(k), 0,
                                                 key_bits(n)),
                 "sort size query");
      at += align_up(std::max<size_t>(l.temp_bytes, 1));
    }
  }
  l.total = at;
  return l;
}

template <class T>
T* at(const void* base, size_t off) {
  return reinterpret_cast<T*>(static_cast<char*>(const_cast<void*>(base)) + off);
}

template <class F>
void by_index(IndexType t, F&& f) {
  if (t == IndexType::i32) f(int32_t{});
  else f(int64_t{});
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

// Queues the plan's kernels; the check concludes into `r`.
template <class I>
void launch_plan(const IndexVector& index, int64_t n, std::optional<int64_t> ignore, void* mem, const Layout& l,
                 const Reporting& r, cudaStream_t stream) {
  const int64_t k = index.size;
  const I* idx = static_cast<const I*>(index.data);
  auto* h = at<kn::Header>(mem, l.header);
  if (l.small) {
    const kn::SmallPlanArgs<I> a{idx, k, n, ignore.has_value(), ignore.value_or(0), key_bits(n),
                                 at<uint32_t>(mem, l.keys), at<uint32_t>(mem, l.ids), at<kn::Run>(mem, l.runs),
                                 l.cap, h, r.slot, r.trap};
    kn::plan_small<I><<<1, kn::kSmallThreads, 0, stream>>>(a);
    check_cuda(cudaGetLastError(), "plan_small launch");
    return;
  }
  const kn::CheckArgs<I> c{idx, k, n, ignore.has_value(), ignore.value_or(0), at<uint32_t>(mem, l.keys),
                           at<uint32_t>(mem, l.ids_in), at<unsigned long long>(mem, l.block_bad), h};
  kn::check_index<I><<<l.check_blocks, kThreads, 0, stream>>>(c);
  check_cuda(cudaGetLastError(), "check_index launch");
  size_t tb = l.temp_bytes;
  check_cuda(cub::DeviceRadixSort::SortPairs(at<void>(mem, l.temp), tb, at<uint32_t>(mem, l.keys),
                                             at<uint32_t>(mem, l.keys_out), at<uint32_t>(mem, l.ids_in),
                                             at<uint32_t>(mem, l.ids), static_cast<int>(k), 0, key_bits(n), stream),
             "sort");
  const kn::RunsArgs<I> ra{at<uint32_t>(mem, l.keys_out), k, static_cast<uint32_t>(n), at<kn::Run>(mem, l.runs),
                           l.cap, h, at<unsigned long long>(mem, l.block_bad), l.check_blocks, idx, r.slot, r.trap};
  kn::emit_runs<I><<<static_cast<unsigned>(kn::ceil_div(k, kThreads)), kThreads, 0, stream>>>(ra);
  check_cuda(cudaGetLastError(), "emit_runs launch");
}

template <class T>
void launch_add(const Matrix& out, const ConstMatrix& src, const void* w, const void* mem, const Layout& l, int64_t k,
                int device, cudaStream_t stream) {
  const int vec = kn::vec_width<T>(out.cols, {{out.data, out.row_stride}, {src.data, src.row_stride}});
  kn::with_variant<T>(vec, w != nullptr, [&](auto v, auto weighted) {
    constexpr int V = decltype(v)::value;
    using A = kn::acc_t<T>;
    const kn::AddArgs<T> a{static_cast<T*>(out.data), out.row_stride, static_cast<const T*>(src.data),
                           src.row_stride, static_cast<const A*>(w), at<uint32_t>(mem, l.ids),
                           at<kn::Run>(mem, l.runs), l.cap, at<kn::Header>(mem, l.header), out.cols,
                           kn::ceil_div(out.cols, kn::kTileCols<V>), kn::ceil_div(out.cols, kn::kNarrowCols<T, V>)};
    // At most cap runs, and at most k / (kHotRun + 1) hot ones.
    const int64_t most = int64_t(l.cap) * a.tiles_w + (k / (kn::kHotRun + 1)) * a.tiles_h;
    kn::add_rows<T, V, decltype(weighted)::value>
        <<<grid_for_tasks(most, kn::kAddThreads, device), kn::kAddThreads, 0, stream>>>(a);
    check_cuda(cudaGetLastError(), "add_rows launch");
  });
}

template <class T, class I>
void launch_gather(const Matrix& dst, const ConstMatrix& x, const I* index, int64_t k, bool has_ignore, int64_t ignore,
                   const void* w, const kn::Gate<I>& gate, int device, cudaStream_t stream) {
  const int vec = kn::vec_width<T>(dst.cols, {{dst.data, dst.row_stride}, {x.data, x.row_stride}});
  kn::with_variant<T>(vec, w != nullptr, [&](auto v, auto weighted) {
    constexpr int V = decltype(v)::value;
    const int64_t tiles = kn::ceil_div(dst.cols, kn::kTileCols<V>);
    const kn::GatherArgs<T, I> a{static_cast<T*>(dst.data), dst.row_stride, static_cast<const T*>(x.data),
                                 x.row_stride, index, k, has_ignore, ignore,
                                 static_cast<const kn::acc_t<T>*>(w), dst.cols, tiles};
    const int64_t tasks = k * tiles;  // 0 when D == 0: one block still concludes the check
    kn::gather_rows<T, I, V, decltype(weighted)::value><<<grid_for_tasks(tasks, kThreads, device), kThreads, 0, stream>>>(
        a, tasks, gate);
    check_cuda(cudaGetLastError(), "gather_rows launch");
  });
}

}  // namespace

// ---- Plan ----------------------------------------------------------------------------------------
struct PlanAccess {
  static Plan make(void* mem, size_t bytes, int64_t k, int64_t n, std::optional<int64_t> ignore, int device) {
    Plan p;
    p.memory_ = mem;
    p.bytes_ = bytes;
    p.num_entries_ = k;
    p.num_rows_ = n;
    p.ignore_index_ = ignore;
    p.device_ = device;
    return p;
  }
  static size_t bytes(const Plan& p) { return p.bytes_; }
};

namespace {

// Checks a plan against the [N, D] and [K, D] operands, as the CPU core does.
void check_plan(const char* op, const Plan& plan, int64_t n, const char* n_name, int64_t k, const char* k_name) {
  if (plan.empty()) fail(op, Error::Kind::value, "plan is empty (make it with Plan::build)");
  if (plan.num_rows() != n)
    fail(op, Error::Kind::value, "plan was built for " + std::to_string(plan.num_rows()) + " rows but " + n_name +
                                     " has " + std::to_string(n));
  if (plan.num_entries() != k)
    fail(op, Error::Kind::value, "plan was built for " + std::to_string(plan.num_entries()) + " entries but " +
                                     k_name + " has " + std::to_string(k) + " rows");
}

}  // namespace

size_t Plan::bytes(int64_t num_entries, int64_t num_rows) {
  check_limits("Plan::bytes", num_entries, num_rows);
  return layout(num_entries, num_rows, true).total;
}

size_t workspace_bytes(int64_t num_entries, int64_t num_rows) {
  check_limits("workspace_bytes", num_entries, num_rows);
  return layout(num_entries, num_rows, true).total;
}

size_t gather_workspace_bytes() { return align_up(sizeof(unsigned long long) * kCheckBlocks); }

namespace {

Plan build_plan(const char* op, const IndexVector& index, int64_t n, std::optional<int64_t> ignore, void* mem,
                size_t bytes, const char* mem_name, int device, IndexCheck check, cudaStream_t stream) {
  const Layout l = layout(index.size, n, true);
  check_memory_arg(op, mem_name, mem, bytes, l.total);
  check_pointer(op, "index", index.data, device);
  check_pointer(op, mem_name, mem, device);
  const Reporting r = start_report(op, n, ignore, device, check, stream);
  ReportScope scope(r);
  by_index(index.type, [&](auto tag) { launch_plan<decltype(tag)>(index, n, ignore, mem, l, r, stream); });
  scope.queued();
  finish_report(op, r, stream);
  return PlanAccess::make(mem, bytes, index.size, n, ignore, device);
}

void run_add(const Matrix& out, const Plan& plan, const ConstMatrix& src, const WeightVector& weight, int device,
             cudaStream_t stream) {
  if (plan.num_entries() == 0 || out.cols == 0) return;
  const Layout l = layout(plan.num_entries(), plan.num_rows(), false);
  by_dtype(out.dtype, [&](auto tag) {
    launch_add<decltype(tag)>(out, src, weight.data, plan.memory(), l, plan.num_entries(), device, stream);
  });
}

}  // namespace

Plan Plan::build(const IndexVector& index, int64_t num_rows, std::optional<int64_t> ignore_index, void* memory,
                 size_t memory_bytes, cudaStream_t stream, IndexCheck check) {
  const char* op = "Plan::build";
  Reports::instance().raise_ready(op);
  check_index_type(op, index);
  check_limits(op, index.size, num_rows);
  check_memory_arg(op, "memory", memory, memory_bytes, std::nullopt);
  if (overlaps(bytes_span(memory, memory_bytes), bytes_span(index.data, cpu::index_bytes(index))))
    fail(op, Error::Kind::value, "index memory overlaps memory");
  const int device = stream_device(stream);
  DeviceGuard guard(device);
  return build_plan(op, index, num_rows, ignore_index, memory, memory_bytes, "memory", device, check, stream);
}

void index_add_rows(const Matrix& out, const Plan& plan, const ConstMatrix& src, const WeightVector& weight,
                    cudaStream_t stream) {
  const char* op = "index_add_rows";
  Reports::instance().raise_ready(op);
  check_plan(op, plan, out.rows, "out", src.rows, "src");
  cpu::check_add_args(op, out, src, weight, plan.num_entries(), nullptr, 0);
  check_weight_dtype(op, weight, plan.num_entries(), out.dtype);
  check_memory_overlap(op, "plan", plan.memory(), PlanAccess::bytes(plan), out, "out");
  const int device = stream_device(stream);
  if (device != plan.device())
    fail(op, Error::Kind::value, "plan is on cuda:" + std::to_string(plan.device()) + " but the stream is on cuda:" +
                                     std::to_string(device));
  DeviceGuard guard(device);
  if (plan.num_entries() == 0 || out.cols == 0) return;
  check_pointer(op, "out", out.data, device);
  check_pointer(op, "src", src.data, device);
  check_pointer(op, "weight", weight.data, device);
  run_add(out, plan, src, weight, device, stream);
}

void gather_rows(const Matrix& dst, const ConstMatrix& x, const Plan& plan, const WeightVector& weight,
                 cudaStream_t stream) {
  const char* op = "gather_rows";
  Reports::instance().raise_ready(op);
  check_plan(op, plan, x.rows, "x", dst.rows, "dst");
  cpu::check_gather_args(op, dst, x, weight, nullptr, 0);
  check_weight_dtype(op, weight, plan.num_entries(), dst.dtype);
  check_memory_overlap(op, "plan", plan.memory(), PlanAccess::bytes(plan), dst, "dst");
  const int device = stream_device(stream);
  if (device != plan.device())
    fail(op, Error::Kind::value, "plan is on cuda:" + std::to_string(plan.device()) + " but the stream is on cuda:" +
                                     std::to_string(device));
  DeviceGuard guard(device);
  const int64_t k = plan.num_entries();
  if (k == 0 || dst.cols == 0) return;
  check_pointer(op, "dst", dst.data, device);
  check_pointer(op, "x", x.data, device);
  check_pointer(op, "weight", weight.data, device);
  const Layout l = layout(k, plan.num_rows(), false);
  const kn::Gate<uint32_t> gate{at<kn::Header>(plan.memory(), l.header), nullptr, 0, nullptr, false};
  by_dtype(dst.dtype, [&](auto tag) {
    launch_gather<decltype(tag), uint32_t>(dst, x, at<uint32_t>(plan.memory(), l.keys), k, true, plan.num_rows(),
                                           weight.data, gate, device, stream);
  });
}

void index_add_rows(const Matrix& out, const IndexVector& index, const ConstMatrix& src, const WeightVector& weight,
                    std::optional<int64_t> ignore, void* ws, size_t ws_bytes, cudaStream_t stream, IndexCheck check) {
  const char* op = "index_add_rows";
  Reports::instance().raise_ready(op);
  cpu::check_index(op, index, src.rows, "src");
  check_limits(op, index.size, out.rows);  // before anything is sized
  cpu::check_add_args(op, out, src, weight, index.size, index.data, cpu::index_bytes(index));
  check_weight_dtype(op, weight, index.size, out.dtype);
  if (index.size == 0) return;
  check_memory_arg(op, "workspace", ws, ws_bytes, std::nullopt);
  check_memory_overlap(op, "workspace", ws, ws_bytes, out, "out");
  const int device = stream_device(stream);
  DeviceGuard guard(device);
  if (out.cols != 0) {
    check_pointer(op, "out", out.data, device);
    check_pointer(op, "src", src.data, device);
    check_pointer(op, "weight", weight.data, device);
  }
  const Plan plan = build_plan(op, index, out.rows, ignore, ws, ws_bytes, "workspace", device, check, stream);
  run_add(out, plan, src, weight, device, stream);
}

void gather_rows(const Matrix& dst, const ConstMatrix& x, const IndexVector& index, const WeightVector& weight,
                 std::optional<int64_t> ignore, void* ws, size_t ws_bytes, cudaStream_t stream, IndexCheck check) {
  const char* op = "gather_rows";
  Reports::instance().raise_ready(op);
  cpu::check_index(op, index, dst.rows, "dst");
  check_limits(op, index.size, x.rows);
  cpu::check_gather_args(op, dst, x, weight, index.data, cpu::index_bytes(index));
  check_weight_dtype(op, weight, index.size, dst.dtype);
  const int64_t k = index.size;
  if (k == 0) return;
  check_memory_arg(op, "workspace", ws, ws_bytes, gather_workspace_bytes());
  check_memory_overlap(op, "workspace", ws, ws_bytes, dst, "dst");
  const int device = stream_device(stream);
  DeviceGuard guard(device);
  check_pointer(op, "index", index.data, device);
  check_pointer(op, "workspace", ws, device);
  if (dst.cols != 0) {
    check_pointer(op, "dst", dst.data, device);
    check_pointer(op, "x", x.data, device);
    check_pointer(op, "weight", weight.data, device);
  }
  const Reporting r = start_report(op, x.rows, ignore, device, check, stream);
  ReportScope scope(r);
  auto* block_bad = static_cast<unsigned long long*>(ws);
  const int blocks = static_cast<int>(std::clamp<int64_t>(kn::ceil_div(k, kThreads), 1, kCheckBlocks));
  by_index(index.type, [&](auto itag) {
    using I = decltype(itag);
    const I* idx = static_cast<const I*>(index.data);
    const kn::CheckArgs<I> c{idx, k, x.rows, ignore.has_value(), ignore.value_or(0), nullptr, nullptr, block_bad,
                             nullptr};
    kn::check_index<I><<<blocks, kThreads, 0, stream>>>(c);
    check_cuda(cudaGetLastError(), "check_index launch");
    const kn::Gate<I> gate{nullptr, block_bad, blocks, r.slot, r.trap};
    by_dtype(dst.dtype, [&](auto tag) {
      launch_gather<decltype(tag), I>(dst, x, idx, k, ignore.has_value(), ignore.value_or(0), weight.data, gate,
                                      device, stream);
    });
  });
  scope.queued();
  finish_report(op, r, stream);
}

void check_errors(bool wait) {
  if (wait) {
    for (const int d : Reports::instance().pending_devices()) {
      DeviceGuard guard(d);
      check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    }
  }
  Reports::instance().raise_ready("check_errors");
}

}  // namespace cuda
}  // namespace scatter_add
