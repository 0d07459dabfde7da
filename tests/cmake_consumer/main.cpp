// A program that uses scatter-add as a dependency. tests/cmake_consumer/run.sh builds it through
// the installed CMake package, add_subdirectory, FetchContent and pkg-config, runs each build and
// compares what it prints with expected.txt.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "scatter_add/scatter_add.h"

namespace sa = scatter_add;

int main() {
  std::vector<float> out(3 * 2, 0.f);                                  // [3, 2]
  const std::vector<float> src = {1, 2, 3, 4, 5, 6, 7, 8};             // [4, 2]
  const std::vector<int32_t> index = {2, 0, 2, -1};                    // row 2 twice; -1 skipped
  const std::vector<float> weight = {1.f, 0.5f, 2.f, 1.f};
  sa::Options opt;
  opt.ignore_index = -1;
  sa::index_add_rows({out.data(), 3, 2, 2, sa::DType::f32}, {index.data(), 4, sa::IndexType::i32},
                     {src.data(), 4, 2, 2, sa::DType::f32}, {weight.data(), 4, sa::DType::f32}, opt);
  for (int r = 0; r < 3; ++r) std::printf("row %d: %g %g\n", r, out[2 * r], out[2 * r + 1]);
  try {  // an index past the end: an error, and out is left as it was
    const std::vector<int32_t> bad = {0, 3, 0, 0};
    sa::index_add_rows({out.data(), 3, 2, 2, sa::DType::f32}, {bad.data(), 4, sa::IndexType::i32},
                       {src.data(), 4, 2, 2, sa::DType::f32});
  } catch (const sa::Error& e) {
    std::printf("error: %s\n", e.what());
  }
  std::printf("row 2 after the error: %g %g\n", out[4], out[5]);
  return 0;
}
