// The AMX tile state every tile kernel here shares: the process's permission to use it, the tile
// configuration, and the compiler barriers its intrinsics need.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace {

// Linux hands a process the AMX tile state only when asked (the kernel's XFEATURE_XTILEDATA permission).
// The dpbf16-only path is another build of each source (`avx512bf16`, compiled without AMX), never a switch
// read per call.
bool amx_allowed() {
  static const bool granted = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC's AMX intrinsics (12.x) tell the optimizer that ldtilecfg reads 8 bytes of its config and that a tile load
// reads no memory at all. So the stores that fill a config on the stack may be dropped as dead (a standalone
// build of this loop faulted in ldtilecfg on a half-written config), and the stores that fill what the tiles
// then load (a dequantized panel, x's padded tail, x's byte planes) may be sunk past the loads. The config goes
// through an asm that reads all 64 bytes; every tile loop starts with tiles_read() over the buffers it loads.
inline void load_tile_config(const TileConfig& config) {
  asm volatile("ldtilecfg %0" : : "m"(config));
}

// All eight tiles 16 rows x 64 bytes: what the weight-only GEMMs and the prefill attention load.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  load_tile_config(config);
}

inline void tiles_read(const void* a, const void* b) {
  asm volatile("" : : "r"(a), "r"(b) : "memory");
}

}  // namespace

#endif  // AMX
