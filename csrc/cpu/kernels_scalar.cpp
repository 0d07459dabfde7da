// Portable row kernels: one element per "register", compiled with no ISA flags. The fallback on
// any x86-64 CPU, and the reference path the SIMD levels are tested against.
#include "convert.h"
#include "row_kernels.h"

namespace scatter_add {
namespace cpu {
namespace {

template <class S, class Acc>
struct ScalarOps {
  using storage = S;
  using acc = Acc;
  using vec = Acc;
  static constexpr int width = 1;
  static vec load(const S* p) { return static_cast<Acc>(*p); }
  static void store(S* p, vec v) { *p = static_cast<S>(v); }
  static vec add(vec a, vec b) { return a + b; }
  static vec mul(vec a, vec b) { return a * b; }
  static vec fmadd(vec a, vec b, vec c) { return a * b + c; }
  static vec set1(Acc a) { return a; }
  static vec load_acc(const Acc* p) { return *p; }
  static void store_acc(Acc* p, vec v) { *p = v; }
};

struct ScalarBF16 : ScalarOps<float, float> {
  using storage = uint16_t;
  static vec load(const uint16_t* p) { return bf16_to_f32(*p); }
  static void store(uint16_t* p, vec v) { *p = f32_to_bf16(v); }
};
struct ScalarF16 : ScalarOps<float, float> {
  using storage = uint16_t;
  static vec load(const uint16_t* p) { return f16_to_f32(*p); }
  static void store(uint16_t* p, vec v) { *p = f32_to_f16(v); }
};

}  // namespace

const KernelTable& kernels_scalar() {
  static const KernelTable t =
      make_table<ScalarOps<float, float>, ScalarOps<double, double>, ScalarBF16, ScalarF16>();
  return t;
}

}  // namespace cpu
}  // namespace scatter_add
