// AVX-512 row kernels: 16 float32 (or 8 float64) accumulators per register. This file is compiled
// twice: with SCATTER_ADD_AVX512_BF16=0 (-mavx512f -mavx512bw -mavx512vl ...) and with
// SCATTER_ADD_AVX512_BF16=1 (adds -mavx512bf16, rounding float32 to bf16 with VCVTNEPS2BF16).
// Each build is called only when CPUID and XGETBV report the features it was compiled for.
#include <immintrin.h>

#include "convert.h"
#include "row_kernels.h"

#ifndef SCATTER_ADD_AVX512_BF16
#error "define SCATTER_ADD_AVX512_BF16 to 0 or 1"
#endif

namespace scatter_add {
namespace cpu {
namespace {

struct Avx512F32 {
  using storage = float;
  using acc = float;
  using vec = __m512;
  static constexpr int width = 16;
  static vec load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
  static vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
  static vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
  static vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  static vec set1(float a) { return _mm512_set1_ps(a); }
  static vec load_acc(const float* p) { return _mm512_loadu_ps(p); }
  static void store_acc(float* p, vec v) { _mm512_storeu_ps(p, v); }
};

struct Avx512F64 {
  using storage = double;
  using acc = double;
  using vec = __m512d;
  static constexpr int width = 8;
  static vec load(const double* p) { return _mm512_loadu_pd(p); }
  static void store(double* p, vec v) { _mm512_storeu_pd(p, v); }
  static vec add(vec a, vec b) { return _mm512_add_pd(a, b); }
  static vec mul(vec a, vec b) { return _mm512_mul_pd(a, b); }
  static vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_pd(a, b, c); }
  static vec set1(double a) { return _mm512_set1_pd(a); }
  static vec load_acc(const double* p) { return _mm512_loadu_pd(p); }
  static void store_acc(double* p, vec v) { _mm512_storeu_pd(p, v); }
};

struct Avx512BF16 : Avx512F32 {
  using storage = uint16_t;
  static vec load(const uint16_t* p) {
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static void store(uint16_t* p, vec v) {
#if SCATTER_ADD_AVX512_BF16
    const __m256bh h = _mm512_cvtneps_pbh(v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<const __m256i&>(h));
#else
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
  }
};

struct Avx512F16 : Avx512F32 {
  using storage = uint16_t;
  static vec load(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(uint16_t* p, vec v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

}  // namespace

#if SCATTER_ADD_AVX512_BF16
const KernelTable& kernels_avx512_bf16() {
#else
const KernelTable& kernels_avx512() {
#endif
  static const KernelTable t = make_table<Avx512F32, Avx512F64, Avx512BF16, Avx512F16>();
  return t;
}

}  // namespace cpu
}  // namespace scatter_add
