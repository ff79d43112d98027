// How the decode stack's threads work together in one OpenMP region: a spinning barrier between ops,
// each thread's share of an op's rows, and a team started with its barrier set up.
#pragma once
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
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

// The items of a step's phases (a linear's output tiles), handed out in chunks: each thread takes its
// own share's chunks in order, then the chunks still left in the others' shares. A thread that is
// slower, or preempted (by the server's API process on a small machine), leaves its work to the rest
// instead of holding everyone at the next barrier.
class Claims {
 public:
  // phases x threads cursors, all at 0 (before the team starts)
  void reset(size_t phases, int threads) {
    threads_ = threads;
    const size_t n = phases * static_cast<size_t>(threads);
    if (n > size_) cursors_.reset(new Cursor[n]), size_ = n;
    for (size_t i = 0; i < n; ++i) cursors_[i].next.store(0, std::memory_order_relaxed);
  }
  // f(begin, end, own) for every chunk thread `tid` takes of phase `phase`'s n items; own: a chunk of
  // its own share (they come in order, so one stream of memory)
  template <class F>
  void run(size_t phase, int64_t n, int64_t chunk, int tid, F&& f) {
    for (int k = 0; k < threads_; ++k) {
      const int owner = (tid + k) % threads_;
      const int64_t begin = n * owner / threads_, end = n * (owner + 1) / threads_;
      std::atomic<int64_t>& next = cursors_[phase * threads_ + owner].next;
      for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); begin + c * chunk < end;
           c = next.fetch_add(1, std::memory_order_relaxed))
        f(begin + c * chunk, std::min(end, begin + (c + 1) * chunk), k == 0);
    }
  }

 private:
  struct alignas(64) Cursor {
    std::atomic<int64_t> next{0};
  };
  std::unique_ptr<Cursor[]> cursors_;
  size_t size_ = 0;
  int threads_ = 1;
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
