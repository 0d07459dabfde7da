// parallel_run(n, f): calls f(thread_id, thread_count) on up to n threads and waits for all.
// OpenMP when the build has it (the runtime torch itself uses), std::thread otherwise (the
// ThreadSanitizer build, whose runtime cannot see inside libgomp). thread_count may be smaller
// than n; callers partition work from the count they are given, so results never depend on it.
// Every thread runs f under the caller's floating-point control (x86: MXCSR's flush-to-zero,
// denormals-are-zero and rounding mode), which is per thread: torch.set_flush_denormal(True)
// sets it on the calling thread only, and sums that a worker thread made with subnormals kept
// would have depended on the thread count.
#pragma once

#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#if defined(SCATTER_ADD_USE_OPENMP)
#include <omp.h>
#endif

namespace scatter_add {
namespace cpu {

// The calling thread's floating-point control, set on another thread for a scope (its own
// restored after; the status flags stay the thread's own).
class CallerFpControl {
 public:
#if defined(__x86_64__) || defined(__i386__)
  static constexpr unsigned kControl = ~0x3Fu;  // every MXCSR bit but the six exception flags
  CallerFpControl() : control_(_mm_getcsr() & kControl) {}
  class Scope {
   public:
    explicit Scope(const CallerFpControl& c) : saved_(_mm_getcsr()) {
      if ((saved_ & kControl) != c.control_) _mm_setcsr((saved_ & ~kControl) | c.control_);
    }
    ~Scope() {
      const unsigned now = _mm_getcsr();
      if ((now & kControl) != (saved_ & kControl)) _mm_setcsr((now & ~kControl) | (saved_ & kControl));
    }

   private:
    unsigned saved_;
  };

 private:
  unsigned control_;
#else
  class Scope {
   public:
    explicit Scope(const CallerFpControl&) {}
  };
#endif
};

template <class F>
void parallel_run(int n, F&& f) {
  if (n <= 1) {
    f(0, 1);
    return;
  }
  const CallerFpControl fp;
#if defined(SCATTER_ADD_USE_OPENMP)
#pragma omp parallel num_threads(n)
  {
    const CallerFpControl::Scope scope(fp);
    f(omp_get_thread_num(), omp_get_num_threads());
  }
#else
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n - 1));
  for (int t = 1; t < n; ++t)
    threads.emplace_back([&f, &fp, t, n] {
      const CallerFpControl::Scope scope(fp);
      f(t, n);
    });
  f(0, n);
  for (auto& th : threads) th.join();
#endif
}

}  // namespace cpu
}  // namespace scatter_add
