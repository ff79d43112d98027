// How the decode stack's threads work together in one OpenMP region: a spinning barrier between ops,
// each thread's share of an op's rows, and a team started with its barrier set up.
#pragma once
#include <omp.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <utility>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace kvserve {
namespace team {

// Threads wait for each other between ops by spinning, then yielding: a thread whose partner was
// preempted (by the server's API process on a small machine) gives its core back to the scheduler
// instead of burning its time slice.
class SpinBarrier {
 public:
  void set_threads(int n) { n_ = n; }
  void wait() {
    const int phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
      if (spins < kSpins) {
#if defined(__SSE2__)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int kSpins = 2000;  // ~10-50 us of pauses before yielding
  std::atomic<int> arrived_{0}, phase_{0};
  int n_ = 1;
};

// [begin, end) of thread `tid`'s share of n items
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int threads) {
  return {n * tid / threads, n * (tid + 1) / threads};
}

// f(tid, threads) on a team of `threads`, with `barrier` set up for it
template <class F>
void in_team(int threads, SpinBarrier& barrier, F&& f) {
#pragma omp parallel num_threads(threads)
  {
#pragma omp single
    barrier.set_threads(omp_get_num_threads());
    f(omp_get_thread_num(), omp_get_num_threads());
  }
}

}  // namespace team
}  // namespace kvserve
