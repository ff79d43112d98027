// The packed layout of a weight-only quantized weight (quant_gemm.cpp's header says it in full):
// output columns in tiles of NR = 8, blocks of QK = 32 weights along K, q8_0 or q4_1.
#pragma once
#include "common/common.h"

#include <cstdint>
#include <string>

namespace kvserve {
namespace quant {

constexpr int64_t QK = 32;  // weights per block
constexpr int64_t NR = 8;   // output columns per tile

enum Fmt { kQ8_0, kQ4_1, kQ4_0 };

// one block of a tile: 8 columns' values, their fp16 d, and Q4_1's fp16 m
constexpr int64_t block_bytes_of(Fmt f) { return f == kQ8_0 ? NR * 32 + NR * 2 : f == kQ4_1 ? NR * 16 + NR * 4 : NR * 16 + NR * 2; }

struct Format {
  bool q4;
  bool min;             // Q4_1's fp16 m per column after the d's; Q4_0 has none (w = d (q - 8))
  int64_t q_bytes;      // one column's quantized values in a block
  int64_t block_bytes;  // one block of a tile: 8 columns' values and scales
};

inline Format format_of(const std::string& kind) {
  if (kind == "q8_0") return {false, false, 32, block_bytes_of(kQ8_0)};
  if (kind == "q4_1") return {true, true, 16, block_bytes_of(kQ4_1)};
  if (kind == "q4_0") return {true, false, 16, block_bytes_of(kQ4_0)};
  TORCH_CHECK(false, "unknown quantized format '", kind, "' (q8_0, q4_1 or q4_0)");
}

inline const char* kind_of(bool q4, bool min) { return q4 ? (min ? "q4_1" : "q4_0") : "q8_0"; }

// Where column j of a tile (0..7) keeps its values within a Q4 block: 16 bytes each, in the order 0,4,1,5,2,6,3,7.
inline int64_t q4_column_slot(int64_t j) { return (j % 4) * 2 + j / 4; }

// Where q[k] of column j sits within a Q8_0 block: in groups of 4 along K, the 8 columns' 4 bytes of a
// group side by side (32 bytes), so one u8 x s8 multiply-add of a group against x's 4 values broadcast
// leaves column j's partial sum in lane j: no horizontal sums.
inline int64_t q8_offset(int64_t j, int64_t k) { return (k / 4) * 32 + j * 4 + k % 4; }

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

}  // namespace quant
}  // namespace kvserve
