// Software prefetch of a sequential stream (a thread's run of packed weight tiles) a fixed distance
// ahead, one prefetch per cache line, into L2. Decode streams its weights from DRAM once a step, and
// a far prefetch keeps more lines in flight than the hardware's own prefetch (docs/benchmarks.md).
#pragma once
#include <cstdint>

namespace kvserve {

constexpr int64_t kPrefetchDistance = 16384;

class StreamPrefetch {
 public:
  StreamPrefetch() = default;  // not started: start() gives it its stream
  explicit StreamPrefetch(const void* start) { this->start(start); }
  bool started() const { return next_ != 0; }
  // the stream's first `distance` bytes are asked for at once: the hardware's prefetch needs a few
  // misses to start, and a decode step starts ~130 streams (each thread's share of each linear)
  void start(const void* at) {
    next_ = reinterpret_cast<uintptr_t>(at) & ~uintptr_t{63};
    upto(at);
  }
  // every line up to `end` + the distance not prefetched yet (the stream only moves forward)
  inline void upto(const void* end) {
    const uintptr_t last = reinterpret_cast<uintptr_t>(end) + kPrefetchDistance;
    for (; next_ < last; next_ += 64) __builtin_prefetch(reinterpret_cast<const void*>(next_), 0, 2);
  }

 private:
  uintptr_t next_ = 0;
};

}  // namespace kvserve
