// What the row-wise kernels share (the decoder layer's fused ops in model/, the samplers in sampling/):
// how many rows make a thread's chunk, and reading any element type as a float.
#pragma once
#include <algorithm>
#include <cstdint>

namespace kvserve {
namespace rowops {

// Rows per thread chunk: below ~64k elements an op runs on one thread. Each parallel region costs a
// wake-up of every thread, and one whose core is taken (the server's API process on a 2-core machine)
// stalls the region; these ops take microseconds, so they only split when the work is large.
inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row_elems)); }

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

}  // namespace rowops
}  // namespace kvserve
