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

struct Format {
  bool q4;
  int64_t q_bytes;      // one column's quantized values in a block
  int64_t block_bytes;  // one block of a tile: 8 columns' values and scales
};

inline Format format_of(const std::string& kind) {
  if (kind == "q8_0") return {false, 32, NR * 32 + NR * 2};
  if (kind == "q4_1") return {true, 16, NR * 16 + NR * 4};
  TORCH_CHECK(false, "unknown quantized format '", kind, "' (q8_0 or q4_1)");
}

// Where column j of a tile (0..7) keeps its values within a block: Q4_1 interleaves 0,4,1,5,2,6,3,7.
inline int64_t column_slot(bool q4, int64_t j) { return q4 ? (j % 4) * 2 + j / 4 : j; }

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

}  // namespace quant
}  // namespace kvserve
