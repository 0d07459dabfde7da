// parallel_run(n, f): calls f(thread_id, thread_count) on up to n threads and waits for all.
// OpenMP when the build has it (the runtime torch itself uses), std::thread otherwise (the
// ThreadSanitizer build, whose runtime cannot see inside libgomp). thread_count may be smaller
// than n; callers partition work from the count they are given, so results never depend on it.
#pragma once

#include <thread>
#include <vector>

#if defined(SCATTER_ADD_USE_OPENMP)
#include <omp.h>
#endif

namespace scatter_add {
namespace cpu {

template <class F>
void parallel_run(int n, F&& f) {
  if (n <= 1) {
    f(0, 1);
    return;
  }
#if defined(SCATTER_ADD_USE_OPENMP)
#pragma omp parallel num_threads(n)
  { f(omp_get_thread_num(), omp_get_num_threads()); }
#else
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n - 1));
  for (int t = 1; t < n; ++t) threads.emplace_back([&f, t, n] { f(t, n); });
  f(0, n);
  for (auto& th : threads) th.join();
#endif
}

}  // namespace cpu
}  // namespace scatter_add
