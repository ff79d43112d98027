// What every AMX kernel here shares: whether this build and CPU have the tiles, asking Linux for the
// tile state, and one tile shape (eight tiles of 16 rows x 64 bytes) that each thread loads before a
// call's work and releases after it. oneDNN's GEMMs load their own configuration between calls.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KVSERVE_AMX_TILES 1
#endif

namespace kvserve {
namespace amx {

#if defined(KVSERVE_AMX_TILES)
constexpr bool kBuilt = true;

// The tile state is asked for once (ARCH_REQ_XCOMP_PERM; oneDNN asks the same for its AMX GEMMs);
// KVSERVE_AMX=0 turns the tile kernels off, as it turns off the engine's other AMX paths.
inline bool ready() {
  static const bool ok = [] {
    const char* env = std::getenv("KVSERVE_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

// Eight tiles, each 16 rows of 64 bytes: 16 x 32 bf16, or 16 x 16 float32. The configuration is a
// constant in memory, not built on the stack: GCC's _tile_loadconfig tells the compiler it reads 8 of
// its 64 bytes, so stores to the rest of a stack copy may be dropped (the ldtilecfg then faults).
struct alignas(64) TileConfig {
  uint8_t bytes[64];
};
constexpr TileConfig tile_config() {
  TileConfig cfg{};
  cfg.bytes[0] = 1;  // palette 1
  for (int t = 0; t < 8; ++t) {
    cfg.bytes[16 + 2 * t] = 64;  // bytes per row
    cfg.bytes[48 + t] = 16;      // rows
  }
  return cfg;
}
inline constexpr TileConfig kTileConfig = tile_config();

inline void configure() { _tile_loadconfig(&kTileConfig); }

inline void release() { _tile_release(); }
#else
constexpr bool kBuilt = false;
inline bool ready() { return false; }
inline void configure() {}
inline void release() {}
#endif

}  // namespace amx
}  // namespace kvserve
