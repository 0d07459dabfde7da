// AVX-512 row kernels: 16 float32 (or 8 float64) accumulators per register. This file is compiled
// twice: with SCATTER_ADD_AVX512_BF16=0 (-mavx512f -mavx512bw -mavx512vl ...) and with
// SCATTER_ADD_AVX512_BF16=1 (adds -mavx512bf16, rounding float32 to bf16 with VCVTNEPS2BF16,
// whose subnormal and NaN lanes are redone in integer arithmetic so the bits match every level).
// Each build is called only when CPUID and XGETBV report the features it was compiled for.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "convert.h"
#include "row_kernels.h"

#ifndef SCATTER_ADD_AVX512_BF16
#error "define SCATTER_ADD_AVX512_BF16 to 0 or 1"
#endif

namespace scatter_add {
namespace cpu {
namespace {

__mmask16 mask16(int64_t m) { return static_cast<__mmask16>((1u << m) - 1u); }
__mmask8 mask8(int64_t m) { return static_cast<__mmask8>((1u << m) - 1u); }

struct Avx512F32 {
  using storage = float;
  using acc = float;
  using vec = __m512;
  using elem = ElemF32;
  static constexpr int width = 16;
  static vec load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
  static vec load_part(const float* p, int64_t m) { return _mm512_maskz_loadu_ps(mask16(m), p); }
  static void store_part(float* p, vec v, int64_t m) { _mm512_mask_storeu_ps(p, mask16(m), v); }
  static vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
  static vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
  static vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  static vec set1(float a) { return _mm512_set1_ps(a); }
  static vec load_acc(const float* p) { return _mm512_loadu_ps(p); }
  static void store_acc(float* p, vec v) { _mm512_storeu_ps(p, v); }
  static vec load_acc_part(const float* p, int64_t m) { return _mm512_maskz_loadu_ps(mask16(m), p); }
  static void store_acc_part(float* p, vec v, int64_t m) { _mm512_mask_storeu_ps(p, mask16(m), v); }
  static void store_lanes(float* p, vec v, uint64_t lanes) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>(lanes), v); }
  static uint64_t differ(const float* a, const float* b) {
    return _mm512_cmpneq_epi32_mask(_mm512_loadu_si512(a), _mm512_loadu_si512(b));
  }
};

struct Avx512F64 {
  using storage = double;
  using acc = double;
  using vec = __m512d;
  using elem = ElemF64;
  static constexpr int width = 8;
  static vec load(const double* p) { return _mm512_loadu_pd(p); }
  static void store(double* p, vec v) { _mm512_storeu_pd(p, v); }
  static vec load_part(const double* p, int64_t m) { return _mm512_maskz_loadu_pd(mask8(m), p); }
  static void store_part(double* p, vec v, int64_t m) { _mm512_mask_storeu_pd(p, mask8(m), v); }
  static vec add(vec a, vec b) { return _mm512_add_pd(a, b); }
  static vec mul(vec a, vec b) { return _mm512_mul_pd(a, b); }
  static vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_pd(a, b, c); }
  static vec set1(double a) { return _mm512_set1_pd(a); }
  static vec load_acc(const double* p) { return _mm512_loadu_pd(p); }
  static void store_acc(double* p, vec v) { _mm512_storeu_pd(p, v); }
  static vec load_acc_part(const double* p, int64_t m) { return _mm512_maskz_loadu_pd(mask8(m), p); }
  static void store_acc_part(double* p, vec v, int64_t m) { _mm512_mask_storeu_pd(p, mask8(m), v); }
  static void store_lanes(double* p, vec v, uint64_t lanes) { _mm512_mask_storeu_pd(p, static_cast<__mmask8>(lanes), v); }
  static uint64_t differ(const double* a, const double* b) {
    return _mm512_cmpneq_epi64_mask(_mm512_loadu_si512(a), _mm512_loadu_si512(b));
  }
};

// float32 -> bf16 in integer arithmetic: round to nearest even, subnormals kept, NaN -> 0x7FC0
// (as the scalar and AVX2 levels do), one 32-bit lane per result.
__m512i bf16_by_integer(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}

#if SCATTER_ADD_AVX512_BF16
// The lanes of v that VCVTNEPS2BF16 does not round as the other levels do (subnormal, NaN) take
// the integer rounding; out holds its result for the other lanes. Out of line, so that the loops
// that store bf16 rows carry one class test per vector and none of these (see narrow below).
[[gnu::noinline, gnu::cold]] __m256i narrow_fix(__m512 v, __m256i out) {
  const __m512i b = _mm512_castps_si512(v);
  const __mmask16 subnormal =
      _mm512_testn_epi32_mask(b, _mm512_set1_epi32(0x7F800000)) & _mm512_test_epi32_mask(b, _mm512_set1_epi32(0x007FFFFF));
  const __mmask16 nan =
      _mm512_cmpgt_epi32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  const __mmask16 fix = subnormal | nan;
  return fix != 0 ? _mm256_mask_mov_epi16(out, fix, _mm512_cvtepi32_epi16(bf16_by_integer(v))) : out;
}
#endif

struct Avx512BF16 : Avx512F32 {
  using storage = uint16_t;
  using elem = ElemBF16;
  static vec widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static __m256i narrow(vec v) {
#if SCATTER_ADD_AVX512_BF16
    // VCVTNEPS2BF16 rounds to nearest even but flushes subnormals to zero and keeps NaN payloads:
    // those (rare) lanes take the integer rounding, so every level gives the same bits. One
    // class test (VFPCLASSPS: NaN, +-0 or denormal) finds the vectors that may hold such a lane.
    // Under denormals-are-zero (torch.set_flush_denormal) it reads a subnormal as zero, hence the
    // zeros in it; a vector it flags goes to narrow_fix's integer tests only when a flagged lane
    // is not exactly +-0 (zeros round exactly: rows of zeros, and the zero lanes past a row's end,
    // stay on this path). With the three integer tests inline on every vector, a bf16 plan walk
    // over random rows of 512 B took 3.39 ms, 3.06 now (Xeon, 2 threads, N = K = 65536, medians
    // of 4 processes alternated); with half the sources zero 3.42 and 3.42; MoE rows of 4 KiB
    // 0.61 and 0.58. Every flagged vector sent to narrow_fix, zeros included: 2.97 ms on random
    // rows, but 3.67 with half the sources zero.
    const __m256bh h = _mm512_cvtneps_pbh(v);
    __m256i out = reinterpret_cast<const __m256i&>(h);
    const __mmask16 maybe = _mm512_fpclass_ps_mask(v, 0x01 | 0x02 | 0x04 | 0x20 | 0x80);
    if (__builtin_expect(maybe != 0, 0) &&
        (maybe & _mm512_test_epi32_mask(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF))) != 0)
      out = narrow_fix(v, out);
    return out;
#else
    return _mm512_cvtepi32_epi16(bf16_by_integer(v));
#endif
  }
  static vec load(const uint16_t* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(uint16_t* p, vec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow(v)); }
  static vec load_part(const uint16_t* p, int64_t m) { return widen(_mm256_maskz_loadu_epi16(mask16(m), p)); }
  static void store_part(uint16_t* p, vec v, int64_t m) { _mm256_mask_storeu_epi16(p, mask16(m), narrow(v)); }
  static void store_lanes(uint16_t* p, vec v, uint64_t lanes) {
    _mm256_mask_storeu_epi16(p, static_cast<__mmask16>(lanes), narrow(v));
  }
};

struct Avx512F16 : Avx512F32 {
  using storage = uint16_t;
  using elem = ElemF16C;
  // VCVTPS2PH keeps NaN payloads; NaN lanes become the canonical sign | 0x7E00, as the scalar
  // level (and c10::Half) give.
  static __m256i narrow(vec v) {
    __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (nan != 0) {
      const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(v), 16), _mm512_set1_epi32(0x8000));
      h = _mm256_mask_mov_epi16(h, nan, _mm512_cvtepi32_epi16(_mm512_or_si512(sign, _mm512_set1_epi32(0x7E00))));
    }
    return h;
  }
  static vec load(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(uint16_t* p, vec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow(v)); }
  static vec load_part(const uint16_t* p, int64_t m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask16(m), p)); }
  static void store_part(uint16_t* p, vec v, int64_t m) { _mm256_mask_storeu_epi16(p, mask16(m), narrow(v)); }
  static void store_lanes(uint16_t* p, vec v, uint64_t lanes) {
    _mm256_mask_storeu_epi16(p, static_cast<__mmask16>(lanes), narrow(v));
  }
};

// ---- small products ----------------------------------------------------------------------------
// y = x @ w.T for a few rows of x (small_matmul.cpp). Each 64-byte step of a w row holds 32
// bf16 values: the even ones become float32 by a shift, the odd ones by a mask, and each lane
// adds its even product, then its odd one, by FMA into its row pair's accumulator; the 16 lanes
// are summed by lanes_sum and rounded once. R rows of w at a time share each step's
// x vectors (R * M accumulators, at most 16 of the 32 registers).
inline __m512 bf16_even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline __m512 bf16_odd(__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000u)))); }

// The 16 lanes' sum, halves added pairwise in a fixed order. The masked forms of the shuffles
// (all lanes) name their pass-through register, where the plain ones and
// _mm512_reduce_add_ps read an undefined one that GCC 12 warns about.
inline float lanes_sum(__m512 v) {
  v = _mm512_add_ps(v, _mm512_mask_shuffle_f32x4(v, 0xFFFF, v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_mask_shuffle_f32x4(v, 0xFFFF, v, v, 0xB1));
  v = _mm512_add_ps(v, _mm512_mask_permute_ps(v, 0xFFFF, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_mask_permute_ps(v, 0xFFFF, v, 0xB1));
  return _mm512_cvtss_f32(v);
}

template <int M, int R>
void small_matmul_block(const SmallMatmulJob& j, int64_t o) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < M; ++i) acc[r][i] = _mm512_setzero_ps();
  const uint16_t* w[R];
  for (int r = 0; r < R; ++r) w[r] = j.w + (o + r) * j.w_stride;
  const int64_t n = j.cols;
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
    __m512 xe[M], xo[M];
    for (int i = 0; i < M; ++i) {
      const __m512i v = _mm512_loadu_si512(j.x + i * j.x_stride + c);
      xe[i] = bf16_even(v);
      xo[i] = bf16_odd(v);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i v = _mm512_loadu_si512(w[r] + c);
      const __m512 we = bf16_even(v), wo = bf16_odd(v);
      for (int i = 0; i < M; ++i) acc[r][i] = _mm512_fmadd_ps(wo, xo[i], _mm512_fmadd_ps(we, xe[i], acc[r][i]));
    }
  }
  if (c < n) {  // the last 1 to 31 columns: the lanes past the end add nothing
    const int64_t rest = n - c;
    const __mmask32 k = static_cast<__mmask32>((uint64_t(1) << rest) - 1);
    const __mmask16 ke = static_cast<__mmask16>((uint32_t(1) << ((rest + 1) / 2)) - 1);
    const __mmask16 ko = static_cast<__mmask16>((uint32_t(1) << (rest / 2)) - 1);
    __m512 xe[M], xo[M];
    for (int i = 0; i < M; ++i) {
      const __m512i v = _mm512_maskz_loadu_epi16(k, j.x + i * j.x_stride + c);
      xe[i] = bf16_even(v);
      xo[i] = bf16_odd(v);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i v = _mm512_maskz_loadu_epi16(k, w[r] + c);
      const __m512 we = bf16_even(v), wo = bf16_odd(v);
      for (int i = 0; i < M; ++i) {
        acc[r][i] = _mm512_mask3_fmadd_ps(we, xe[i], acc[r][i], ke);
        acc[r][i] = _mm512_mask3_fmadd_ps(wo, xo[i], acc[r][i], ko);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < M; ++i) j.y[i * j.y_stride + o + r] = f32_to_bf16(lanes_sum(acc[r][i]));
}

template <int M>
void small_matmul_m(const SmallMatmulJob& j, int64_t o0, int64_t o1) {
  constexpr int R = M == 1 ? 8 : M == 2 ? 6 : M <= 4 ? 4 : 2;
  int64_t o = o0;
  for (; o + R <= o1; o += R) small_matmul_block<M, R>(j, o);
  for (; o < o1; ++o) small_matmul_block<M, 1>(j, o);
}

void small_matmul_up_to_8(const SmallMatmulJob& j, int64_t o0, int64_t o1) {
  switch (j.m) {
    case 1: return small_matmul_m<1>(j, o0, o1);
    case 2: return small_matmul_m<2>(j, o0, o1);
    case 3: return small_matmul_m<3>(j, o0, o1);
    case 4: return small_matmul_m<4>(j, o0, o1);
    case 5: return small_matmul_m<5>(j, o0, o1);
    case 6: return small_matmul_m<6>(j, o0, o1);
    case 7: return small_matmul_m<7>(j, o0, o1);
    case 8: return small_matmul_m<8>(j, o0, o1);
    default: return;
  }
}

// More than 8 rows of x: tiles of 16 w rows, each passed by chunks of 8 rows (the same
// operations for every element as a call of those rows alone).
void small_matmul(const SmallMatmulJob& j, int64_t o0, int64_t o1) {
  if (j.m <= 8) return small_matmul_up_to_8(j, o0, o1);
  constexpr int64_t kTile = 16;
  for (int64_t t = o0; t < o1; t += kTile) {
    const int64_t t1 = std::min(o1, t + kTile);
    for (int64_t i = 0; i < j.m; i += 8) {
      SmallMatmulJob part = j;
      part.x += i * j.x_stride;
      part.y += i * j.y_stride;
      part.m = std::min<int64_t>(8, j.m - i);
      small_matmul_up_to_8(part, t, t1);
    }
  }
}

#if SCATTER_ADD_AVX512_BF16 && SCATTER_ADD_AMX
// ---- y = x @ w.T on AMX tiles ----------------------------------------------------------------
// Each element of y is the float32 sum, by TDPBF16PS in 32-column steps in increasing order, of
// its row of x against its row of w, rounded once as every level rounds (narrow): the same
// operations whatever rows and columns a call or thread holds. The product is taken swapped,
// y.T = w @ x.T: 16-row tiles of w are loaded as they lie (no repacking of the weight, the large
// operand), x is packed once per call into pairs of columns by 16 rows (a 16 x 16 transpose of
// 32-bit pairs per 1 KiB tile), and the float32 result tiles are transposed back by the same
// shuffles before rounding. Tiles: 0-3 results (2 w tiles x 2 x tiles), 4-5 w, 6-7 x.
// Buffers handed to tile loads start on 64-byte lines: a tile row across two lines doubled the
// time of the inner loop here.
struct TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// r[i] (16 lanes) -> r[j] lane i = old r[i] lane j.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a0 = _mm512_castps_pd(t[4 * i]), a1 = _mm512_castps_pd(t[4 * i + 1]),
                  a2 = _mm512_castps_pd(t[4 * i + 2]), a3 = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_mask_shuffle_f32x4(r[8 * i + j], 0xFFFF, r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_mask_shuffle_f32x4(r[8 * i + j], 0xFFFF, r[8 * i + j], r[8 * i + 4 + j], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_mask_shuffle_f32x4(t[j], 0xFFFF, t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_mask_shuffle_f32x4(t[j], 0xFFFF, t[j], t[8 + j], 0xDD);
  }
}

// A thread's scratch on 64-byte lines, kept between calls.
template <class T>
T* lines(std::vector<unsigned char>& v, size_t count) {
  v.resize(count * sizeof(T) + 64);
  const uintptr_t p = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<T*>((p + 63) & ~uintptr_t{63});
}

constexpr int64_t kTileMaxCols = int64_t{1} << 16;

void small_matmul_amx_rows(const SmallMatmulJob& j, int64_t o0, int64_t o1) {
  const int64_t m = j.m, k = j.cols, kc = (k + 31) / 32, kfull = k / 32, mb = (m + 15) / 16;
  static thread_local std::vector<unsigned char> xs, ws;
  // x packed: [m block][column step][16 pairs of columns][16 rows], 32-bit pairs
  uint32_t* xp = lines<uint32_t>(xs, static_cast<size_t>(mb * kc * 256));
  for (int64_t b = 0; b < mb; ++b)
    for (int64_t c = 0; c < kc; ++c) {
      const int64_t rest = std::min<int64_t>(32, k - 32 * c);
      const __mmask32 cols = static_cast<__mmask32>(rest == 32 ? ~uint32_t{0} : (uint32_t{1} << rest) - 1);
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t row = 16 * b + i;
        r[i] = row < m ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(cols, j.x + row * j.x_stride + 32 * c))
                       : _mm512_setzero_ps();
      }
      transpose16(r);
      uint32_t* dst = xp + (b * kc + c) * 256;
      for (int i = 0; i < 16; ++i) _mm512_store_ps(dst + 16 * i, r[i]);
    }
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) float cb[4][256];
  // Steps of a panel of 32 w rows that tile loads cannot read as w lies (past its last column, or
  // all of a last panel of fewer rows), copied with zeros past w: [step][2 tiles][16 rows][32
  // columns], from step pad_min on.
  const int64_t pad_min = (o1 - o0) % 32 != 0 ? 0 : kfull;
  uint16_t* wp = lines<uint16_t>(ws, static_cast<size_t>((kc - pad_min) * 1024));
  for (int64_t n0 = o0; n0 < o1; n0 += 32) {
    const int64_t nn = std::min<int64_t>(32, o1 - n0);
    const int64_t pad_from = nn == 32 ? kfull : 0;  // the steps read from the padded panel
    if (pad_from < kc) {
      std::fill(wp + (pad_from - pad_min) * 1024, wp + (kc - pad_min) * 1024, uint16_t{0});
      for (int64_t r = 0; r < nn; ++r) {
        const uint16_t* row = j.w + (n0 + r) * j.w_stride;
        for (int64_t c = pad_from; c < kc; ++c)
          std::memcpy(wp + (c - pad_min) * 1024 + (r / 16) * 512 + (r % 16) * 32, row + 32 * c,
                      static_cast<size_t>(std::min<int64_t>(32, k - 32 * c)) * 2);
      }
    }
    const uint16_t* w0 = j.w + n0 * j.w_stride;
    const int64_t w_bytes = j.w_stride * 2;
    for (int64_t b = 0; b < mb; b += 2) {
      const bool two = b + 1 < mb;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t c = 0; c < kc; ++c) {
        if (c < pad_from) {
          _tile_loadd(4, w0 + 32 * c, w_bytes);
          _tile_loadd(5, w0 + 16 * j.w_stride + 32 * c, w_bytes);
        } else {
          _tile_loadd(4, wp + (c - pad_min) * 1024, 64);
          _tile_loadd(5, wp + (c - pad_min) * 1024 + 512, 64);
        }
        _tile_loadd(6, xp + (b * kc + c) * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
          _tile_loadd(7, xp + ((b + 1) * kc + c) * 256, 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, cb[0], 64);
      _tile_stored(1, cb[1], 64);
      if (two) {
        _tile_stored(2, cb[2], 64);
        _tile_stored(3, cb[3], 64);
      }
      for (int q = 0; q < (two ? 4 : 2); ++q) {
        const int64_t col = n0 + 16 * (q & 1), row = 16 * (b + (q >> 1));
        if (col >= n0 + nn) continue;
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(cb[q] + 16 * i);
        transpose16(r);  // r[i]: row `row + i` of y, 16 columns from col
        const int64_t cols = std::min<int64_t>(16, n0 + nn - col);
        for (int i = 0; i < 16 && row + i < m; ++i)
          _mm256_mask_storeu_epi16(j.y + (row + i) * j.y_stride + col, mask16(cols), Avx512BF16::narrow(r[i]));
      }
    }
  }
  _tile_release();
  // Scratch kept for the next call up to a few MiB; a call with very wide rows frees its own.
  constexpr size_t kKeep = size_t{4} << 20;
  if (xs.capacity() > kKeep) std::vector<unsigned char>().swap(xs);
  if (ws.capacity() > kKeep) std::vector<unsigned char>().swap(ws);
}

// Rows of x a few hundred at a time, in passes of about equal rows, so that their packed copy (64
// bytes per row and 32 columns) stays within about 1.5 MiB, in the L2, while every w panel passes
// it; each element's sum is the same in any such split. (2 threads, ms: Mixtral-8x7B's up
// projection, 28672 x 4096, 132 rows, 26.2 in passes of 1 MiB, 19.8 in one pass; Mixtral's down,
// 1024 x 3584, 160 rows 0.85 -> 0.68.)
void small_matmul_amx(const SmallMatmulJob& j, int64_t o0, int64_t o1) {
  // Rows of more than 65536 columns take the vector kernel: packed at 16 rows or more a tile,
  // one such row cost 32 MiB of scratch and 53 ms where the vector kernel took 0.16 ms (1M
  // columns, one row, one column of y). The choice follows the shape alone, never the split.
  if (j.cols > kTileMaxCols) return small_matmul(j, o0, o1);
  const int64_t steps = std::max<int64_t>(1, (j.cols + 31) / 32);
  const int64_t most = std::max<int64_t>(32, (int64_t{3} << 13) / steps / 32 * 32);
  const int64_t passes = (j.m + most - 1) / most;
  const int64_t chunk = ((j.m + passes - 1) / passes + 31) / 32 * 32;  // passes of equal rows
  for (int64_t i = 0; i < j.m; i += chunk) {
    SmallMatmulJob part = j;
    part.x += i * j.x_stride;
    part.y += i * j.y_stride;
    part.m = std::min(chunk, j.m - i);
    small_matmul_amx_rows(part, o0, o1);
  }
}
#endif

}  // namespace

#if SCATTER_ADD_AVX512_BF16
const KernelTable& kernels_avx512_bf16() {
#else
const KernelTable& kernels_avx512() {
#endif
  static const KernelTable t = [] {
    KernelTable k = make_table<Avx512F32, Avx512F64, Avx512BF16, Avx512F16>();
    k.small_matmul = &small_matmul;
    k.small_matmul_nn = &small_matmul_nn_avx2;
    return k;
  }();
  return t;
}

#if SCATTER_ADD_AVX512_BF16 && SCATTER_ADD_AMX
const KernelTable& kernels_avx512_amx() {
  static const KernelTable t = [] {
    KernelTable k = kernels_avx512_bf16();
    k.small_matmul = &small_matmul_amx;
    return k;
  }();
  return t;
}
#endif

}  // namespace cpu
}  // namespace scatter_add
