// The suite's main. With --skip-above-cpu, a run whose SCATTER_ADD_CPU_ISA names a level above
// this CPU's exits with kSkipCode before any test: the library would clamp it down to a level
// that its own CTest entry already runs, so the same kernels would be tested twice. CTest reports
// such an entry as skipped, naming the CPU's level (tests/cpp/CMakeLists.txt).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "scatter_add/scatter_add.h"

namespace sa = scatter_add;

namespace {
constexpr int kSkipCode = 77;
}

int main(int argc, char** argv) {
  bool skip_above_cpu = false;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--skip-above-cpu") == 0)
      skip_above_cpu = true;
    else
      argv[kept++] = argv[i];
  }
  argc = kept;
  argv[argc] = nullptr;
  const char* want = std::getenv("SCATTER_ADD_CPU_ISA");
  bool above = false;  // a known level's name, above the level in use
  for (sa::Isa isa : {sa::Isa::scalar, sa::Isa::avx2, sa::Isa::avx512, sa::Isa::avx512_bf16})
    if (want != nullptr && std::strcmp(want, sa::isa_name(isa)) == 0) above = isa > sa::active_isa();
  if (skip_above_cpu && above) {
    std::printf("skipped: SCATTER_ADD_CPU_ISA=%s is above this CPU's level (%s), to which the library clamps it; "
                "the entry for %s runs those kernels\n",
                want, sa::isa_name(sa::supported_isa()), sa::isa_name(sa::active_isa()));
    return kSkipCode;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
