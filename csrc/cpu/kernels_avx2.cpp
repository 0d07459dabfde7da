// AVX2 + FMA + F16C row kernels: 8 float32 (or 4 float64) accumulators per register.
// Compiled with -mavx2 -mfma -mf16c; called only when CPUID and XGETBV report AVX2 support.
#include <immintrin.h>

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
  using elem = ElemF16;
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

}  // namespace

const KernelTable& kernels_avx2() {
  static const KernelTable t = make_table<Avx2F32, Avx2F64, Avx2BF16, Avx2F16>();
  return t;
}

}  // namespace cpu
}  // namespace scatter_add
