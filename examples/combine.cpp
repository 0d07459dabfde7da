// The MoE combine step through the torch-free C++ API: 6 tokens, 4 experts x capacity 2, bf16
// rows, float32 routing weights, padding slots marked -1. Builds one plan and uses it for the
// combine (index_add_rows) and for the dispatch of the next layer (gather_rows).
//   make cpp && .build/release/combine_example        (ctest runs it as example_combine)
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "scatter_add/scatter_add.h"

namespace sa = scatter_add;

static uint16_t to_bf16(float f) {  // truncation is enough for these small integers
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>(b >> 16);
}
static float from_bf16(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

int main() {
  const int64_t tokens = 6, slots = 8, hidden = 4;
  std::vector<uint16_t> y(tokens * hidden, to_bf16(0.f));         // combine output [6, 4]
  std::vector<uint16_t> expert_out(slots * hidden);                // [8, 4]
  for (int64_t s = 0; s < slots; ++s)
    for (int64_t j = 0; j < hidden; ++j) expert_out[s * hidden + j] = to_bf16(static_cast<float>(s + 1));
  const std::vector<int32_t> slot_token = {0, 3, 1, -1, 0, 2, 5, 4};  // -1: empty slot
  const std::vector<float> slot_weight = {0.5f, 1, 1, 1, 0.5f, 1, 1, 1};

  const sa::IndexVector index{slot_token.data(), slots, sa::IndexType::i32};
  const sa::Plan plan = sa::Plan::build(index, tokens, /*ignore_index=*/-1);
  sa::Options opt;
  opt.ignore_index = -1;
  try {
    sa::index_add_rows({y.data(), tokens, hidden, hidden, sa::DType::bf16}, plan,
                       {expert_out.data(), slots, hidden, hidden, sa::DType::bf16},
                       {slot_weight.data(), slots, sa::DType::f32}, opt);
    std::vector<uint16_t> dispatched(slots * hidden);
    sa::gather_rows({dispatched.data(), slots, hidden, hidden, sa::DType::bf16},
                    {y.data(), tokens, hidden, hidden, sa::DType::bf16}, plan, {}, opt);
    // token 0 = 0.5 * 1 + 0.5 * 5 = 3; slot 3 (empty) gathers zeros
    std::printf("token 0: %g, token 3: %g, dispatched slot 3: %g\n", from_bf16(y[0]),
                from_bf16(y[3 * hidden]), from_bf16(dispatched[3 * hidden]));
    if (from_bf16(y[0]) != 3.f || from_bf16(y[3 * hidden]) != 2.f || from_bf16(dispatched[3 * hidden]) != 0.f)
      return 1;
    // A bad index is reported and leaves y untouched.
    const std::vector<int32_t> bad = {0, 3, 1, 9, 0, 2, 5, 4};
    const std::vector<uint16_t> before = y;
    try {
      sa::index_add_rows({y.data(), tokens, hidden, hidden, sa::DType::bf16},
                         {bad.data(), slots, sa::IndexType::i32},
                         {expert_out.data(), slots, hidden, hidden, sa::DType::bf16});
      return 1;
    } catch (const sa::Error& e) {
      std::printf("error as expected: %s\n", e.what());
    }
    return y == before ? 0 : 1;
  } catch (const sa::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
