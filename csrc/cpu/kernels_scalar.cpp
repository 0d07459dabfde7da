// Portable row kernels: one element per "register", compiled with no ISA flags. The fallback on
// any x86-64 CPU, and the reference path the SIMD levels are tested against.
#include <cmath>
#include <cstring>

#include "convert.h"
#include "row_kernels.h"

namespace scatter_add {
namespace cpu {
namespace {

// One element per "register"; fmadd is std::fma (one rounding, as the SIMD levels' FMA).
template <class S, class Acc, class Elem>
struct ScalarOps {
  using storage = S;
  using acc = Acc;
  using vec = Acc;
  using elem = Elem;
  static constexpr int width = 1;
  static vec load(const S* p) { return Elem::get(*p); }
  static void store(S* p, vec v) { *p = Elem::put(v); }
  static vec load_part(const S* p, int64_t) { return load(p); }
  static void store_part(S* p, vec v, int64_t) { store(p, v); }
  static vec add(vec a, vec b) { return a + b; }
  static vec mul(vec a, vec b) { return a * b; }
  static vec fmadd(vec a, vec b, vec c) { return std::fma(a, b, c); }
  static vec set1(Acc a) { return a; }
  static vec load_acc(const Acc* p) { return *p; }
  static void store_acc(Acc* p, vec v) { *p = v; }
  static vec load_acc_part(const Acc* p, int64_t) { return *p; }
  static void store_acc_part(Acc* p, vec v, int64_t) { *p = v; }
  static void store_lanes(S* p, vec v, uint64_t lanes) {
    if (lanes & 1) store(p, v);
  }
  static uint64_t differ(const Acc* a, const Acc* b) { return std::memcmp(a, b, sizeof(Acc)) != 0; }
};

}  // namespace

const KernelTable& kernels_scalar() {
  static const KernelTable t =
      make_table<ScalarOps<float, float, ElemF32>, ScalarOps<double, double, ElemF64>,
                 ScalarOps<uint16_t, float, ElemBF16>, ScalarOps<uint16_t, float, ElemF16>>();
  return t;
}

}  // namespace cpu
}  // namespace scatter_add
