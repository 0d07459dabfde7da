// Scalar conversions between float32 and the 16-bit storage formats (bf16, IEEE fp16), each
// rounding to nearest-even and keeping subnormals, shared by every ISA translation unit.
// Everything here has internal linkage: this header is compiled once per ISA with different
// flags, and an inline function merged across those units could run AVX-512 code on a CPU
// without it.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace scatter_add {
namespace cpu {
namespace {

inline float bits_to_f32(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t f32_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline float bf16_to_f32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN becomes the canonical quiet NaN 0x7FC0 (as c10::BFloat16 does).
inline uint16_t f32_to_bf16(float f) {
  uint32_t x = f32_to_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  x += 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
    // zero or subnormal: mant * 2^-24, exact in float32
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
  }
  if (exp == 31) return bits_to_f32(sign | 0x7F800000u | (mant << 13));
  return bits_to_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t x = f32_to_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return static_cast<uint16_t>(sign | (ax > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {                                                // below 2^-14: subnormal
    if (ax < 0x33000000u) return static_cast<uint16_t>(sign);            // below 2^-25: zero
    const uint32_t e = ax >> 23;
    const uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  const uint32_t r = ax + 0xFFFu + ((ax >> 13) & 1u) - 0x38000000u;
  return static_cast<uint16_t>(sign | (r >> 13));
}

// Scalar element conversions of each storage type (Ops::elem in row_kernels.h).
struct ElemF32 {
  static float get(float x) { return x; }
  static float put(float a) { return a; }
};
struct ElemF64 {
  static double get(double x) { return x; }
  static double put(double a) { return a; }
};
struct ElemBF16 {
  static float get(uint16_t h) { return bf16_to_f32(h); }
  static uint16_t put(float a) { return f32_to_bf16(a); }
};
struct ElemF16 {
  static float get(uint16_t h) { return f16_to_f32(h); }
  static uint16_t put(float a) { return f32_to_f16(a); }
};

#if defined(__F16C__)
// The same conversions by the F16C instructions, for the units compiled with -mf16c: both are
// exact IEEE conversions rounding to nearest even with subnormals kept (MXCSR's FTZ and DAZ do not
// apply to them), and VCVTPS2PH's NaN, which keeps the payload, becomes the canonical one as above
// (and as the vector kernels' narrow() does). The integer path costs a branch tree per element:
// float16 D = 1, N = K = 1M, sorted, one thread, 8.7 ms against bfloat16's 2.7.
struct ElemF16C {
  static float get(uint16_t h) { return _cvtsh_ss(h); }
  static uint16_t put(float a) {
    if (a != a) return static_cast<uint16_t>(((f32_to_bits(a) >> 16) & 0x8000u) | 0x7E00u);
    return static_cast<uint16_t>(_cvtss_sh(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};
#endif

}  // namespace
}  // namespace cpu
}  // namespace scatter_add
