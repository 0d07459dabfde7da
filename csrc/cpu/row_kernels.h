// The row kernels, written once over an "Ops" struct that each ISA translation unit defines:
//   storage  element type in memory (float, double, uint16_t for bf16/fp16)
//   acc      accumulator scalar (float, or double for f64)
//   vec      a register of `width` accumulators
//   load(const storage*) -> vec, store(storage*, vec), add(vec, vec), mul(vec, vec), fmadd(a, b, c) = a*b + c,
//   set1(acc) -> vec, load_acc(const acc*) / store_acc(acc*, vec) on an accumulator buffer
// Full blocks of kUnroll registers keep the running sums of one column block in registers while
// every contribution of the row streams through; the tail goes through a small stack buffer.
// Internal linkage on purpose (see convert.h).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace scatter_add {
namespace cpu {
namespace {

template <class Ops>
struct RowKernels {
  using T = typename Ops::storage;
  using A = typename Ops::acc;
  using V = typename Ops::vec;
  static constexpr int W = Ops::width;
  static constexpr int kUnroll = 4;
  // Hot-row path above this many contributions; its L1 accumulator chunk (4 KiB of float32).
  static constexpr int64_t kManyContributions = 8;
  static constexpr int64_t kBufferCols = 1024;
  // Software prefetch distance inside a row, in elements (512 B of bf16).
  static constexpr int64_t kPrefetchCols = 256;

  static V load_n(const T* p, int64_t m) {
    T tmp[W] = {};
    std::memcpy(tmp, p, static_cast<size_t>(m) * sizeof(T));
    return Ops::load(tmp);
  }
  static void store_n(T* p, V v, int64_t m) {
    T tmp[W];
    Ops::store(tmp, v);
    std::memcpy(p, tmp, static_cast<size_t>(m) * sizeof(T));
  }

  template <bool Weighted>
  static void add_row(void* out_v, const void* src_v, int64_t stride, const int64_t* ids,
                      int64_t n, const void* w_v, int64_t c0, int64_t c1) {
    T* out = static_cast<T*>(out_v);
    const T* src = static_cast<const T*>(src_v);
    const A* w = static_cast<const A*>(w_v);
    if (n > kManyContributions && c1 - c0 >= kBufferCols) {
      add_row_buffered<Weighted>(out, src, stride, ids, n, w, c0, c1);
      return;
    }
    int64_t c = c0;
    for (; c + kUnroll * W <= c1; c += kUnroll * W) {
      V acc[kUnroll];
      __builtin_prefetch(out + c + kPrefetchCols, 1);
      for (int u = 0; u < kUnroll; ++u) acc[u] = Ops::load(out + c + u * W);
      for (int64_t k = 0; k < n; ++k) {
        const T* s = src + ids[k] * stride + c;
        __builtin_prefetch(s + kPrefetchCols);
        if (Weighted) {
          const V wk = Ops::set1(w[ids[k]]);
          for (int u = 0; u < kUnroll; ++u) acc[u] = Ops::fmadd(Ops::load(s + u * W), wk, acc[u]);
        } else {
          for (int u = 0; u < kUnroll; ++u) acc[u] = Ops::add(acc[u], Ops::load(s + u * W));
        }
      }
      for (int u = 0; u < kUnroll; ++u) Ops::store(out + c + u * W, acc[u]);
    }
    for (; c < c1; c += W) {
      const int64_t m = (c1 - c < W) ? (c1 - c) : W;
      V acc = (m == W) ? Ops::load(out + c) : load_n(out + c, m);
      for (int64_t k = 0; k < n; ++k) {
        const T* s = src + ids[k] * stride + c;
        const V x = (m == W) ? Ops::load(s) : load_n(s, m);
        acc = Weighted ? Ops::fmadd(x, Ops::set1(w[ids[k]]), acc) : Ops::add(acc, x);
      }
      if (m == W) {
        Ops::store(out + c, acc);
      } else {
        store_n(out + c, acc, m);
      }
    }
  }

  // Rows with many contributions (hot rows): keep a column chunk's running sums in an L1 buffer
  // and stream each source row's chunk contiguously, instead of striding across all source rows
  // once per register block. Same operations in the same order as the register path, so the
  // same bits.
  template <bool Weighted>
  static void add_row_buffered(T* out, const T* src, int64_t stride, const int64_t* ids, int64_t n,
                               const A* w, int64_t c0, int64_t c1) {
    alignas(64) A buf[kBufferCols];
    for (int64_t cb = c0; cb < c1; cb += kBufferCols) {
      const int64_t m = (c1 - cb < kBufferCols) ? (c1 - cb) : kBufferCols;
      const int64_t full = m - m % W;
      for (int64_t c = 0; c < full; c += W) Ops::store_acc(buf + c, Ops::load(out + cb + c));
      if (full < m) Ops::store_acc(buf + full, load_n(out + cb + full, m - full));
      for (int64_t k = 0; k < n; ++k) {
        const T* s = src + ids[k] * stride + cb;
        if (k + 1 < n) __builtin_prefetch(src + ids[k + 1] * stride + cb);
        const V wk = Ops::set1(Weighted ? w[ids[k]] : A(1));
        for (int64_t c = 0; c < full; c += W) {
          const V x = Ops::load(s + c);
          const V a = Ops::load_acc(buf + c);
          Ops::store_acc(buf + c, Weighted ? Ops::fmadd(x, wk, a) : Ops::add(a, x));
        }
        if (full < m) {
          const V x = load_n(s + full, m - full);
          const V a = Ops::load_acc(buf + full);
          Ops::store_acc(buf + full, Weighted ? Ops::fmadd(x, wk, a) : Ops::add(a, x));
        }
      }
      for (int64_t c = 0; c < full; c += W) Ops::store(out + cb + c, Ops::load_acc(buf + c));
      if (full < m) store_n(out + cb + full, Ops::load_acc(buf + full), m - full);
    }
  }

  static void scale_row(void* dst_v, const void* x_v, double w, int64_t c0, int64_t c1) {
    T* dst = static_cast<T*>(dst_v);
    const T* x = static_cast<const T*>(x_v);
    const V wv = Ops::set1(static_cast<A>(w));
    int64_t c = c0;
    for (; c + W <= c1; c += W) Ops::store(dst + c, Ops::mul(Ops::load(x + c), wv));
    if (c < c1) store_n(dst + c, Ops::mul(load_n(x + c, c1 - c), wv), c1 - c);
  }
};

// Order of the table's first index follows scatter_add::DType: f32, f64, bf16, f16.
template <class F32, class F64, class BF16, class F16>
KernelTable make_table() {
  KernelTable t{};
  t.add[0][0] = &RowKernels<F32>::template add_row<false>;
  t.add[0][1] = &RowKernels<F32>::template add_row<true>;
  t.add[1][0] = &RowKernels<F64>::template add_row<false>;
  t.add[1][1] = &RowKernels<F64>::template add_row<true>;
  t.add[2][0] = &RowKernels<BF16>::template add_row<false>;
  t.add[2][1] = &RowKernels<BF16>::template add_row<true>;
  t.add[3][0] = &RowKernels<F16>::template add_row<false>;
  t.add[3][1] = &RowKernels<F16>::template add_row<true>;
  t.scale[0] = &RowKernels<F32>::scale_row;
  t.scale[1] = &RowKernels<F64>::scale_row;
  t.scale[2] = &RowKernels<BF16>::scale_row;
  t.scale[3] = &RowKernels<F16>::scale_row;
  return t;
}

}  // namespace
}  // namespace cpu
}  // namespace scatter_add
