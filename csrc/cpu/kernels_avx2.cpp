// AVX2 + FMA + F16C row kernels: 8 float32 (or 4 float64) accumulators per register.
// Compiled with -mavx2 -mfma -mf16c; called only when CPUID and XGETBV report AVX2 support.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "convert.h"
#include "row_kernels.h"

namespace scatter_add {
namespace cpu {
namespace {

__m256i mask32(int64_t m) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
__m256i mask64(int64_t m) { return _mm256_cmpgt_epi64(_mm256_set1_epi64x(m), _mm256_setr_epi64x(0, 1, 2, 3)); }
// Lane q all ones where bit q of `lanes` is set (32- and 64-bit lanes).
__m256i lanes32(uint64_t lanes) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(lanes)), bit), bit);
}
__m256i lanes64(uint64_t lanes) {
  const __m256i bit = _mm256_setr_epi64x(1, 2, 4, 8);
  return _mm256_cmpeq_epi64(_mm256_and_si256(_mm256_set1_epi64x(static_cast<int64_t>(lanes)), bit), bit);
}

struct Avx2F32 {
  using storage = float;
  using acc = float;
  using vec = __m256;
  using elem = ElemF32;
  static constexpr int width = 8;
  static vec load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
  static vec load_part(const float* p, int64_t m) { return _mm256_maskload_ps(p, mask32(m)); }
  static void store_part(float* p, vec v, int64_t m) { _mm256_maskstore_ps(p, mask32(m), v); }
  static vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
  static vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
  static vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
  static vec set1(float a) { return _mm256_set1_ps(a); }
  static vec load_acc(const float* p) { return _mm256_loadu_ps(p); }
  static void store_acc(float* p, vec v) { _mm256_storeu_ps(p, v); }
  static vec load_acc_part(const float* p, int64_t m) { return _mm256_maskload_ps(p, mask32(m)); }
  static void store_acc_part(float* p, vec v, int64_t m) { _mm256_maskstore_ps(p, mask32(m), v); }
  static void store_lanes(float* p, vec v, uint64_t lanes) { _mm256_maskstore_ps(p, lanes32(lanes), v); }
  static uint64_t differ(const float* a, const float* b) {
    const __m256i same = _mm256_cmpeq_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)),
                                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    return ~static_cast<uint64_t>(_mm256_movemask_ps(_mm256_castsi256_ps(same))) & 0xFF;
  }
};

struct Avx2F64 {
  using storage = double;
  using acc = double;
  using vec = __m256d;
  using elem = ElemF64;
  static constexpr int width = 4;
  static vec load(const double* p) { return _mm256_loadu_pd(p); }
  static void store(double* p, vec v) { _mm256_storeu_pd(p, v); }
  static vec load_part(const double* p, int64_t m) { return _mm256_maskload_pd(p, mask64(m)); }
  static void store_part(double* p, vec v, int64_t m) { _mm256_maskstore_pd(p, mask64(m), v); }
  static vec add(vec a, vec b) { return _mm256_add_pd(a, b); }
  static vec mul(vec a, vec b) { return _mm256_mul_pd(a, b); }
  static vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_pd(a, b, c); }
  static vec set1(double a) { return _mm256_set1_pd(a); }
  static vec load_acc(const double* p) { return _mm256_loadu_pd(p); }
  static void store_acc(double* p, vec v) { _mm256_storeu_pd(p, v); }
  static vec load_acc_part(const double* p, int64_t m) { return _mm256_maskload_pd(p, mask64(m)); }
  static void store_acc_part(double* p, vec v, int64_t m) { _mm256_maskstore_pd(p, mask64(m), v); }
  static void store_lanes(double* p, vec v, uint64_t lanes) { _mm256_maskstore_pd(p, lanes64(lanes), v); }
  static uint64_t differ(const double* a, const double* b) {
    const __m256i same = _mm256_cmpeq_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)),
                                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    return ~static_cast<uint64_t>(_mm256_movemask_pd(_mm256_castsi256_pd(same))) & 0xF;
  }
};

// Eight 16-bit lanes stored where `lanes` has their bit. AVX2 has no 16-bit masked store, and a
// blend with what memory holds would write the other lanes back: another call may be updating
// those rows at the same time.
void store_lanes16(uint16_t* p, __m128i h, uint64_t lanes) {
  alignas(16) uint16_t v[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(v), h);
  for (; lanes != 0; lanes &= lanes - 1) {
    const int q = __builtin_ctzll(lanes);
    p[q] = v[q];
  }
}

struct Avx2BF16 : Avx2F32 {
  using storage = uint16_t;
  using elem = ElemBF16;
  static vec load(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  // Round to nearest even in integer arithmetic; NaN becomes 0x7FC0 like the scalar path.
  static __m128i narrow(vec v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  static void store(uint16_t* p, vec v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow(v)); }
  static vec load_part(const uint16_t* p, int64_t m) { return PartByCopy<Avx2BF16>::load_part(p, m); }
  static void store_part(uint16_t* p, vec v, int64_t m) { PartByCopy<Avx2BF16>::store_part(p, v, m); }
  static void store_lanes(uint16_t* p, vec v, uint64_t lanes) { store_lanes16(p, narrow(v), lanes); }
};

struct Avx2F16 : Avx2F32 {
  using storage = uint16_t;
  using elem = ElemF16C;
  static vec load(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // VCVTPS2PH keeps NaN payloads; NaN lanes become the canonical sign | 0x7E00, as the scalar
  // level (and c10::Half) give.
  static __m128i narrow(vec v) {
    __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    if (_mm256_movemask_ps(nan) != 0) {
      const __m256i c = _mm256_or_si256(
          _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(v), 16), _mm256_set1_epi32(0x8000)),
          _mm256_set1_epi32(0x7E00));
      const __m256i m = _mm256_castps_si256(nan);
      h = _mm_blendv_epi8(h, _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)),
                          _mm_packs_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1)));
    }
    return h;
  }
  static void store(uint16_t* p, vec v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow(v)); }
  static vec load_part(const uint16_t* p, int64_t m) { return PartByCopy<Avx2F16>::load_part(p, m); }
  static void store_part(uint16_t* p, vec v, int64_t m) { PartByCopy<Avx2F16>::store_part(p, v, m); }
  static void store_lanes(uint16_t* p, vec v, uint64_t lanes) { store_lanes16(p, narrow(v), lanes); }
};

// ---- expert products ----------------------------------------------------------------------------
// y = x @ w.T in bfloat16 (small_matmul.cpp). Each 32-byte step of a row holds 16 bf16 values:
// the even ones become float32 by a shift, the odd ones by a mask, and each of the 8 lanes adds
// its even product, then its odd one, by FMA into the accumulator of its (x row, w row) pair; the
// lanes are summed by lanes_sum8 in a fixed order and rounded once. A block of M rows of x and R
// rows of w shares each step's widened vectors (R * M accumulators + 2 * M x vectors + 2 w
// vectors within the 16 registers). The last 1 to 15 columns go through zero-padded copies: their
// extra lanes add 0 * 0.
inline __m256 bf16_even8(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 bf16_odd8(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline float lanes_sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The accumulators as one array acc[r * M + q], every access by a constant index (folds over
// index sequences): with loops over them GCC kept them in memory, stored at every step (clang
// did not).
template <int M, int R, int... K>
inline void nt_zero(__m256 (&acc)[R * M], std::integer_sequence<int, K...>) {
  ((acc[K] = _mm256_setzero_ps()), ...);
}
template <int M, int R, int... Q>
inline void nt_widen(__m256 (&xe)[M], __m256 (&xo)[M], const uint16_t* const (&x)[M], int64_t c,
                     std::integer_sequence<int, Q...>) {
  ((xe[Q] = bf16_even8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[Q] + c))),
    xo[Q] = bf16_odd8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[Q] + c)))), ...);
}
template <int M, int R, int... K>
inline void nt_fma(__m256 (&acc)[R * M], const __m256 (&xe)[M], const __m256 (&xo)[M], const uint16_t* const (&w)[R],
                   int64_t c, std::integer_sequence<int, K...>) {
  ((acc[K] = _mm256_fmadd_ps(bf16_odd8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[K / M] + c))), xo[K % M],
                             _mm256_fmadd_ps(bf16_even8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[K / M] + c))),
                                             xe[K % M], acc[K]))), ...);
}
template <int M, int R, int... K>
inline void nt_sums(float (&out)[R * M], const __m256 (&acc)[R * M], std::integer_sequence<int, K...>) {
  ((out[K] = lanes_sum8(acc[K])), ...);
}

template <int M, int R>
void matmul_block(const SmallMatmulJob& j, int64_t i, int64_t o) {
  using All = std::make_integer_sequence<int, R * M>;
  using Rows = std::make_integer_sequence<int, M>;
  __m256 acc[R * M];
  nt_zero<M, R>(acc, All{});
  const uint16_t* w[R];
  const uint16_t* x[M];
  for (int r = 0; r < R; ++r) w[r] = j.w + (o + r) * j.w_stride;
  for (int q = 0; q < M; ++q) x[q] = j.x + (i + q) * j.x_stride;
  const int64_t n = j.cols;
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    __m256 xe[M], xo[M];
    nt_widen<M, R>(xe, xo, x, c, Rows{});
    nt_fma<M, R>(acc, xe, xo, w, c, All{});
  }
  if (c < n) {
    alignas(32) uint16_t xt[M][16] = {}, wt[R][16] = {};
    const uint16_t* xp[M];
    const uint16_t* wp[R];
    const size_t bytes = static_cast<size_t>(n - c) * 2;
    for (int q = 0; q < M; ++q) {
      std::memcpy(xt[q], x[q] + c, bytes);
      xp[q] = xt[q];
    }
    for (int r = 0; r < R; ++r) {
      std::memcpy(wt[r], w[r] + c, bytes);
      wp[r] = wt[r];
    }
    __m256 xe[M], xo[M];
    nt_widen<M, R>(xe, xo, xp, 0, Rows{});
    nt_fma<M, R>(acc, xe, xo, wp, 0, All{});
  }
  float sums[R * M];
  nt_sums<M, R>(sums, acc, All{});
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < M; ++q) j.y[(i + q) * j.y_stride + o + r] = f32_to_bf16(sums[r * M + q]);
}

// Rows [i, i + M) of x against w rows [o0, o1): blocks of R, then single rows.
template <int M, int R>
void matmul_rows(const SmallMatmulJob& j, int64_t i, int64_t o0, int64_t o1) {
  int64_t o = o0;
  for (; o + R <= o1; o += R) matmul_block<M, R>(j, i, o);
  for (; o < o1; ++o) matmul_block<M, 1>(j, i, o);
}

// w rows [o0, o1) in tiles of kTile rows (16 KiB at h = 1024: they stay in L1 / L2 while every
// pair of x rows passes over them). One or two rows of x (decode) are bound by reading w from
// memory: there w is read one row at a time, front to back, which the hardware prefetcher follows
// better than 4 or 8 rows read side by side. The price is one FMA chain in flight, so a w already
// in the cache is read 2-3.5x slower than 8 rows at a time; an MoE layer's experts are not (they
// pass the caches between two uses), and there this pays. An EPYC without AVX-512, two threads:
// GB/s of w over 50 random experts of 768 x 1024 and 1024 x 384 in turn, one w row at a time / 8
// at a time, 12.8-18.3 / 10.2-16.9 at one x row, 11.4-12.4 / 8.7-11.8 at two (one expert again and
// again: 21-27 / 44-80); transformers' blocks against grouped_mm, three alternated runs of 12
// rounds, Qwen3-MoE 1 token 1.26-1.34x / 1.00-1.25x, 8 tokens 1.46-1.53x / 0.98-1.20x, Mixtral 1
// token 1.03-1.13x / 1.03-1.14x, 8 tokens 1.78-1.82x / 1.55-1.68x. From three rows on the products
// bound it, and 4 w rows per x pair pass fewer loads per FMA (16 rows of x: 54 GFLOPS against 36
// one w row at a time). Every element is one chain of FMAs in column order either way: the same
// bits.
void small_matmul(const SmallMatmulJob& j, int64_t o0, int64_t o1) {
  if (j.m <= 2) {
    if (j.m == 2)
      matmul_rows<2, 1>(j, 0, o0, o1);
    else
      matmul_rows<1, 1>(j, 0, o0, o1);
    return;
  }
  constexpr int64_t kTile = 8;
  for (int64_t t = o0; t < o1; t += kTile) {
    const int64_t t1 = std::min(o1, t + kTile);
    int64_t i = 0;
    for (; i + 2 <= j.m; i += 2) matmul_rows<2, 4>(j, i, t, t1);
    if (i < j.m) matmul_rows<1, 8>(j, i, t, t1);
  }
}

// ---- y = x @ w (small_matmul_nn) ------------------------------------------------------------------
// A block of M rows of y by 16 columns: for each c in order, the 16 bf16 values of row c of the
// block's panel of w (even columns widened by a shift, odd ones by a mask) times x[i][c]
// (float32, broadcast), one FMA per accumulator: 2 * M accumulators + 2 w vectors + 1 broadcast
// within the 16 registers.

// Each lane's float32 rounded to bf16 as f32_to_bf16 does (to nearest even, NaN 0x7FC0).
inline __m256i bf16_round8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
// 16 bf16 in column order from the even columns' and the odd columns' float32 sums.
inline __m256i bf16_pairs(__m256 even, __m256 odd) {
  return _mm256_or_si256(bf16_round8(even), _mm256_slli_epi32(bf16_round8(odd), 16));
}

// One step of nn_block over its M rows, the rows named by constants (a loop over them left GCC
// keeping the accumulators in memory, stored at every step).
template <int M, int... Q>
inline void nn_step(__m256 (&ae)[M], __m256 (&ao)[M], __m256 we, __m256 wo, const float* x, int64_t h,
                    std::integer_sequence<int, Q...>) {
  ((ae[Q] = _mm256_fmadd_ps(we, _mm256_broadcast_ss(x + Q * h), ae[Q]),
    ao[Q] = _mm256_fmadd_ps(wo, _mm256_broadcast_ss(x + Q * h), ao[Q])), ...);
}

template <int M, int... Q>
inline void nn_zero(__m256 (&ae)[M], __m256 (&ao)[M], std::integer_sequence<int, Q...>) {
  ((ae[Q] = _mm256_setzero_ps(), ao[Q] = _mm256_setzero_ps()), ...);
}
template <int M, int... Q>
inline void nn_round(uint16_t (&out)[M][16], const __m256 (&ae)[M], const __m256 (&ao)[M], std::integer_sequence<int, Q...>) {
  (_mm256_store_si256(reinterpret_cast<__m256i*>(out[Q]), bf16_pairs(ae[Q], ao[Q])), ...);
}

template <int M>
void nn_block(const SmallMatmulJob& j, int64_t i, const uint16_t* panel, int64_t stride, int64_t o, int64_t width) {
  __m256 ae[M], ao[M];
  const int64_t h = j.cols;
  const float* x = j.xf + i * h;
  nn_zero(ae, ao, std::make_integer_sequence<int, M>{});
  for (int64_t c = 0; c < h; ++c) {
    const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + c * stride));
    nn_step(ae, ao, bf16_even8(v), bf16_odd8(v), x + c, h, std::make_integer_sequence<int, M>{});
  }
  // (rounded into a local block first: indexing the accumulators by a loop that does not unroll
  // would keep them in memory, stored at every step of the loop above)
  alignas(32) uint16_t out[M][16];
  nn_round(out, ae, ao, std::make_integer_sequence<int, M>{});
  for (int q = 0; q < M; ++q) std::memcpy(j.y + (i + q) * j.y_stride + o, out[q], static_cast<size_t>(width) * 2);
}

}  // namespace

// Columns [o0, o1) in blocks of 16, each copied first into a panel of h rows of 16 (zero-padded
// past the last column), which blocks of 6 rows of y then read in order. Read in place, a
// block's rows a w row apart put each step on another page (x [128, 1024] @ w [1024, 3584], two
// threads: 33 GFLOPS in place). The panels of up to kPanelBytes of w are copied in one pass over
// w's rows, row c of each panel side by side (one copy of the row's piece of w), and each block
// of 6 rows of y passes all of them in turn, so that y is written a row block at a time. Two
// threads, ms, against a copy per panel and a pass of all rows of y per panel: g [1, 7168] @ w
// [7168, 1024] 7.5 -> 3.2, g.T [7168, 1] @ x [1, 1024] 15.9 -> 3.0 (each line of y was written in
// two halves, far apart). The panels stay in a buffer per thread between calls, up to
// kPanelBytes (a longer h, whose single panel is larger, releases it).
void small_matmul_nn_avx2(const SmallMatmulJob& j, int64_t o0, int64_t o1) {
  constexpr int64_t kPanelBytes = 1 << 20;
  const int64_t h = j.cols, m = j.m;
  struct alignas(32) Row {
    uint16_t v[16];
  };
  thread_local std::vector<Row> rows;
  const int64_t per_pass = std::max<int64_t>(1, kPanelBytes / (std::max<int64_t>(h, 1) * 32));
  rows.resize(static_cast<size_t>(std::max<int64_t>(h, 1) * std::min(per_pass, (o1 - o0 + 15) / 16)));
  for (int64_t s = o0; s < o1; s += 16 * per_pass) {
    const int64_t panels = std::min<int64_t>(per_pass, (o1 - s + 15) / 16);
    // row c of every panel side by side: one copy of the row's piece of w
    const int64_t cols = std::min<int64_t>(16 * panels, o1 - s);
    for (int64_t c = 0; c < h; ++c) {
      Row* r = &rows[static_cast<size_t>(c * panels)];
      if (cols < 16 * panels) std::memset(r + panels - 1, 0, sizeof(Row));
      std::memcpy(r, j.w + c * j.w_stride + s, static_cast<size_t>(cols) * 2);
    }
    const uint16_t* base = rows.empty() ? nullptr : rows[0].v;
    auto pass = [&](int64_t i, auto block) {
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t o = s + 16 * p;
        block(j, i, base + 16 * p, 16 * panels, o, std::min<int64_t>(16, o1 - o));
      }
    };
    int64_t i = 0;
    for (; i + 6 <= m; i += 6) pass(i, nn_block<6>);
    switch (m - i) {
      case 1: pass(i, nn_block<1>); break;
      case 2: pass(i, nn_block<2>); break;
      case 3: pass(i, nn_block<3>); break;
      case 4: pass(i, nn_block<4>); break;
      case 5: pass(i, nn_block<5>); break;
      default: break;
    }
  }
  if (rows.capacity() * sizeof(Row) > static_cast<size_t>(kPanelBytes)) {  // a long h: not kept
    rows.clear();
    rows.shrink_to_fit();
  }
}

const KernelTable& kernels_avx2() {
  static const KernelTable t = [] {
    KernelTable k = make_table<Avx2F32, Avx2F64, Avx2BF16, Avx2F16>();
    k.small_matmul = &small_matmul;
    k.small_matmul_nn = &small_matmul_nn_avx2;
    return k;
  }();
  return t;
}

}  // namespace cpu
}  // namespace scatter_add
