// gather_rows: dst[i] = w[i] * x[index[i]] (zero rows at ignore_index).
//   by index  the index is validated in one pass, then each thread copies a range of dst rows
//             (or, when there are fewer rows than threads, a range of columns of every row)
//             with the next source rows prefetched; one-element rows are copied as scalars, and
//             the rows of a large dst already in memory by non-temporal stores (policy.h)
//   by plan   each x row is read once and written to all its destinations (split by Splitter)
#include <cpuid.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "dispatch.h"
#include "parallel.h"
#include "policy.h"
#include "splitter.h"
#include "strategy.h"
#include "validate.h"

namespace scatter_add {
namespace cpu {

namespace {

// Whether the pages of [p, p + bytes) are in memory already, judged by kResidentSamples pages
// spread over it: a buffer written before, not freshly mapped. Streaming stores pay only there:
// a fresh page is zeroed by the kernel on its first write, which leaves its lines in the cache,
// where a streaming store first has to evict them (a freshly allocated 32 MiB dst: 0.78x of
// plain stores; the same dst written before: 2.1x).
bool pages_resident(const void* p, size_t bytes) {
#if defined(__linux__)
  const long ps = sysconf(_SC_PAGESIZE);
  if (ps <= 0 || bytes == 0) return false;
  const uintptr_t page = static_cast<uintptr_t>(ps), begin = reinterpret_cast<uintptr_t>(p);
  for (int i = 0; i < CpuPolicy::kResidentSamples; ++i) {
    const uintptr_t at = (begin + (bytes - 1) / (CpuPolicy::kResidentSamples - 1) * i) & ~(page - 1);
    unsigned char in = 0;
    if (mincore(reinterpret_cast<void*>(at), page, &in) != 0 || (in & 1) == 0) return false;
  }
  return true;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

// The L3's size where it keeps a dst written again and again (AMD, policy.h), else 0: read
// once from sysfs, cache index3 when it is level 3 (sysconf's figure can be the whole
// package's or the host's: 320 MiB where sysfs says 32 MiB on one EPYC VM); where sysfs does not
// tell, CpuPolicy::kAssumedL3Bytes.
int64_t read_l3_bytes() {
  const char* dir = "/sys/devices/system/cpu/cpu0/cache/index3/";
  char path[96];
  long long level = 0, v = 0;
  char unit = 0;
  std::snprintf(path, sizeof path, "%slevel", dir);
  if (std::FILE* f = std::fopen(path, "r")) {
    if (std::fscanf(f, "%lld", &level) != 1) level = 0;
    std::fclose(f);
  }
  if (level != 3) return CpuPolicy::kAssumedL3Bytes;
  std::snprintf(path, sizeof path, "%ssize", dir);
  std::FILE* f = std::fopen(path, "r");
  if (f == nullptr) return CpuPolicy::kAssumedL3Bytes;
  const int got = std::fscanf(f, "%lld%c", &v, &unit);
  std::fclose(f);
  if (got < 1 || v <= 0) return CpuPolicy::kAssumedL3Bytes;
  const int64_t scale = unit == 'K' ? 1 << 10 : unit == 'M' ? 1 << 20 : unit == 'G' ? 1 << 30 : 1;
  return static_cast<int64_t>(v) * scale;
}

int64_t store_keeping_l3_bytes() {
  static const int64_t bytes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return int64_t(0);
    char vendor[13] = {};
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    if (std::strcmp(vendor, "AuthenticAMD") != 0 && std::strcmp(vendor, "HygonGenuine") != 0) return int64_t(0);
    return read_l3_bytes();
  }();
  return bytes;
}

// Whether an unweighted gather writes its dst rows by streaming stores (policy.h).
// SCATTER_ADD_GATHER_STREAM, read by calls past the size threshold only (a dst of 4 MiB or
// more, where a getenv costs nothing measurable): "1" streams every such call whatever the cache
// and pages, "0" none; any other value leaves the choice to this rule.
// x_bytes: the whole of x, rows times stride (x_span_bytes).
bool stream_pays(const Matrix& dst, const ConstMatrix& x, int64_t k, double row_bytes, double x_bytes) {
  const double dst_bytes = row_bytes * static_cast<double>(k);
  if (row_bytes < static_cast<double>(CpuPolicy::kStreamMinRowBytes) ||
      row_bytes > static_cast<double>(CpuPolicy::kStreamMaxRowBytes) ||
      dst_bytes < static_cast<double>(CpuPolicy::kStreamAboveBytes))
    return false;
  if (const char* env = std::getenv("SCATTER_ADD_GATHER_STREAM");
      env != nullptr && (std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0))
    return *env == '1';
  const double src_bytes = row_bytes * static_cast<double>(std::min(x.rows, k));
  const int64_t l3 = store_keeping_l3_bytes();
  if (l3 > 0) {
    // AMD: only with the AVX-512 kernels, rows of kStreamMinRowBytesL3 to kStreamMaxRowBytesL3, a
    // dst that fills the L3 with the rows it reads, and an x whose rows come from memory.
    const double l3d = static_cast<double>(l3);
    if (active_isa() < Isa::avx512 || row_bytes < static_cast<double>(CpuPolicy::kStreamMinRowBytesL3) ||
        row_bytes > static_cast<double>(CpuPolicy::kStreamMaxRowBytesL3) ||
        dst_bytes + src_bytes < l3d || x_bytes < static_cast<double>(CpuPolicy::kStreamSourceL3s) * l3d)
      return false;
  } else if (dst_bytes < static_cast<double>(CpuPolicy::kStreamAboveBytesNoL3)) {
    return false;  // other CPUs (Intel): a smaller dst, dirty in the cache from its last writer
  }
  const size_t es = dtype_size(dst.dtype);
  return pages_resident(dst.data, static_cast<size_t>(((k - 1) * dst.row_stride + dst.cols)) * es);
}

double x_span_bytes(const ConstMatrix& x) {
  return static_cast<double>(x.rows) * static_cast<double>(std::max(x.row_stride, x.cols)) *
         static_cast<double>(dtype_size(x.dtype));
}

}  // namespace

void run_gather(const Matrix& dst, const ConstMatrix& x, const IndexVector& index, const void* w,
                const Options& o) {
  scan_index(index, x.rows, o.ignore_index);  // before the first write
  const int64_t k = index.size, d = dst.cols;
  if (k == 0 || d == 0) return;
  const size_t es = dtype_size(dst.dtype);
  const double x_bytes = x_span_bytes(x);
  const bool stream =
      w == nullptr && stream_pays(dst, x, k, static_cast<double>(d) * static_cast<double>(es), x_bytes);
  const GatherJob job{dst.data, dst.row_stride, x.data,  x.row_stride, index.data,
                      w,        o.ignore_index.has_value(), o.ignore_index.value_or(0), stream};
  const GatherFn fn =
      active_kernels().gather[static_cast<int>(dst.dtype)][w != nullptr][index.type == IndexType::i64];
  // Work in bytes moved, plus a row's price where x's rows are read at random from memory: at
  // least kGatherRandomRowBytes, and twice its bytes (CpuPolicy::kGatherRandomRowBytes).
  const double row_bytes = static_cast<double>(d) * static_cast<double>(es);
  const double work = 2.0 * static_cast<double>(k) * row_bytes +
                      (x_bytes >= static_cast<double>(CpuPolicy::kGatherRandomRowsFromBytes)
                           ? static_cast<double>(k) *
                                 std::max(static_cast<double>(CpuPolicy::kGatherRandomRowBytes), 2.0 * row_bytes)
                           : 0.0);
  const int nt = threads_for(o, work, CpuPolicy::kGatherMinBytesPerThread);
  const bool by_columns = k < nt;
  parallel_run(nt, [&](int t, int n) {
    if (by_columns) {
      const int64_t a = CpuPolicy::kColumnAlign;
      const int64_t c0 = std::min(d, d * t / n / a * a);
      const int64_t c1 = t + 1 == n ? d : std::min(d, d * (t + 1) / n / a * a);
      if (c0 < c1) fn(job, 0, k, c0, c1);
    } else {
      fn(job, k * t / n, k * (t + 1) / n, 0, d);
    }
  });
}

void run_gather_planned(const Matrix& dst, const ConstMatrix& x, const Plan& plan, const void* w,
                        const Options& o) {
  const int64_t d = dst.cols;
  if (plan.num_entries() == 0 || d == 0) return;
  const size_t es = dtype_size(dst.dtype);
  const ScaleRowFn scale = active_kernels().scale[static_cast<int>(dst.dtype)];
  const double* wd = dst.dtype == DType::f64 ? static_cast<const double*>(w) : nullptr;
  const float* wf = dst.dtype == DType::f64 ? nullptr : static_cast<const float*>(w);
  // Each x row is read once and written to all its destinations: cost = count + 1 per row.
  const Splitter split(plan.offsets(), plan.num_distinct(), d, 1);
  const int nt = threads_for(o, static_cast<double>(split.total()) * static_cast<double>(d) * static_cast<double>(es),
                            CpuPolicy::kGatherMinBytesPerThread);
  const int64_t* rows = plan.rows().data();
  const int64_t* off = plan.offsets().data();
  const int64_t* srcs = plan.sources().data();
  const std::vector<int64_t>& ign = plan.ignored();
  const int64_t ni = static_cast<int64_t>(ign.size());
  char* dbase = static_cast<char*>(dst.data);
  const char* xbase = static_cast<const char*>(x.data);
  auto copy = [&](int64_t to, int64_t from, int64_t c0, int64_t c1) {
    char* dp = dbase + static_cast<size_t>(to * dst.row_stride + c0) * es;
    const size_t bytes = static_cast<size_t>(c1 - c0) * es;
    if (from < 0) {
      std::memset(dp, 0, bytes);
    } else if (w == nullptr) {
      std::memcpy(dp, xbase + static_cast<size_t>(from * x.row_stride + c0) * es, bytes);
    } else {
      const double wv = wd != nullptr ? wd[to] : static_cast<double>(wf[to]);
      scale(dp, xbase + static_cast<size_t>(from * x.row_stride + c0) * es, wv, 0, c1 - c0);
    }
  };
  parallel_run(nt, [&](int t, int n) {
    split.for_share(t, n, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t j = off[r]; j < off[r + 1]; ++j) copy(srcs[j], rows[r], c0, c1);
    });
    for (int64_t j = ni * t / n; j < ni * (t + 1) / n; ++j) copy(ign[static_cast<size_t>(j)], -1, 0, d);
  });
}

}  // namespace cpu
}  // namespace scatter_add
