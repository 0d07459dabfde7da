// Helpers shared by the C++ tests: typed host buffers with float64 accessors, index patterns,
// tolerances. Header-only, internal linkage in each test translation unit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "convert.h"
#include "scatter_add/scatter_add.h"

namespace sa = scatter_add;
using sa::DType;
using sa::IndexType;

namespace {

// A host buffer of one dtype with float64 accessors.
struct Buf {
  DType dtype;
  std::vector<unsigned char> bytes;
  Buf(DType t, size_t n) : dtype(t), bytes(n * sa::dtype_size(t)) {}
  size_t size() const { return bytes.size() / sa::dtype_size(dtype); }
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  double get(size_t i) const {
    switch (dtype) {
      case DType::f32: return reinterpret_cast<const float*>(bytes.data())[i];
      case DType::f64: return reinterpret_cast<const double*>(bytes.data())[i];
      case DType::bf16: return sa::cpu::bf16_to_f32(reinterpret_cast<const uint16_t*>(bytes.data())[i]);
      case DType::f16: return sa::cpu::f16_to_f32(reinterpret_cast<const uint16_t*>(bytes.data())[i]);
    }
    return 0;
  }
  void set(size_t i, double v) {
    switch (dtype) {
      case DType::f32: reinterpret_cast<float*>(bytes.data())[i] = static_cast<float>(v); break;
      case DType::f64: reinterpret_cast<double*>(bytes.data())[i] = v; break;
      case DType::bf16:
        reinterpret_cast<uint16_t*>(bytes.data())[i] = sa::cpu::f32_to_bf16(static_cast<float>(v));
        break;
      case DType::f16:
        reinterpret_cast<uint16_t*>(bytes.data())[i] = sa::cpu::f32_to_f16(static_cast<float>(v));
        break;
    }
  }
};

inline Buf random_buf(DType t, size_t n, std::mt19937_64& rng) {
  Buf b(t, n);
  std::uniform_real_distribution<double> u(-2.0, 2.0);
  for (size_t i = 0; i < n; ++i) b.set(i, u(rng));
  return b;
}

// Index values as int64 plus the typed buffer handed to the library.
struct Idx {
  IndexType type;
  std::vector<int64_t> values;
  std::vector<int32_t> v32;
  sa::IndexVector view() const {
    if (type == IndexType::i32) return {v32.data(), static_cast<int64_t>(v32.size()), type};
    return {values.data(), static_cast<int64_t>(values.size()), type};
  }
};
inline Idx make_idx(IndexType t, std::vector<int64_t> v) {
  Idx r{t, std::move(v), {}};
  for (int64_t x : r.values) r.v32.push_back(static_cast<int32_t>(x));
  return r;
}

enum class Pattern { uniform, moe_topk, all_equal, hot_row, sorted, zipf };
inline std::vector<int64_t> make_indices(Pattern p, int64_t n, int64_t k, std::mt19937_64& rng) {
  std::vector<int64_t> v(static_cast<size_t>(k));
  std::uniform_int_distribution<int64_t> u(0, std::max<int64_t>(n - 1, 0));
  for (int64_t i = 0; i < k; ++i) {
    switch (p) {
      case Pattern::uniform: v[i] = u(rng); break;
      case Pattern::moe_topk: v[i] = (i * 7919 + i / 2) % n; break;  // each row about K/N times
      case Pattern::all_equal: v[i] = n / 2; break;
      case Pattern::hot_row: v[i] = (rng() % 4 == 0) ? u(rng) : 0; break;
      case Pattern::sorted: v[i] = u(rng); break;
      case Pattern::zipf: {  // power law (P(rank) ~ 1/rank^1.2), ranks scattered over the rows
        const double x = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
        // Clamped before the cast: (1-x)^-5 exceeds int64 for x close to 1.
        const int64_t rank = static_cast<int64_t>(std::min(std::pow(1.0 - x, -1.0 / 0.2), 1e18)) - 1;
        v[i] = static_cast<int64_t>((static_cast<uint64_t>(rank % std::max<int64_t>(n, 1)) * 2654435761u) %
                                    static_cast<uint64_t>(std::max<int64_t>(n, 1)));
        break;
      }
    }
  }
  if (p == Pattern::sorted) std::sort(v.begin(), v.end());
  if (p == Pattern::moe_topk) std::shuffle(v.begin(), v.end(), rng);
  return v;
}

inline double eps_of(DType t) {
  switch (t) {
    case DType::f32: return std::ldexp(1.0, -24);
    case DType::f64: return std::ldexp(1.0, -53);
    case DType::bf16: return std::ldexp(1.0, -8);
    case DType::f16: return std::ldexp(1.0, -11);
  }
  return 0;
}
inline double acc_eps(DType t) { return t == DType::f64 ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24); }

inline sa::Matrix mat(Buf& b, int64_t rows, int64_t cols, int64_t stride) {
  return {b.data(), rows, cols, stride, b.dtype};
}
inline sa::ConstMatrix cmat(const Buf& b, int64_t rows, int64_t cols, int64_t stride) {
  return {b.data(), rows, cols, stride, b.dtype};
}

struct Case {
  DType dtype;
  IndexType itype;
  bool weighted;
  bool ignore;
};

inline std::string describe(const Case& c, int64_t n, int64_t k, int64_t d) {
  return std::string(sa::dtype_name(c.dtype)) + (c.itype == IndexType::i32 ? " i32" : " i64") +
         (c.weighted ? " weight" : "") + (c.ignore ? " ignore" : "") + " N=" + std::to_string(n) +
         " K=" + std::to_string(k) + " D=" + std::to_string(d) + " isa=" + sa::isa_name(sa::active_isa());
}

const DType kDtypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16};
const IndexType kItypes[] = {IndexType::i32, IndexType::i64};

}  // namespace
