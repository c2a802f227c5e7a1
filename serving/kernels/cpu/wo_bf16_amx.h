// AMX (Sapphire Rapids and later): 16 rows of x at a time over the same bf16 pairs the dpbf16 paths read.
//
// The pair layout is what an AMX B tile holds: 16 k-pairs x 16 channels x 2 inputs, 64 bytes a row, so a
// bf16 weight packed for dpbf16 (or a dequantized int8/int4 panel) is loaded into tiles in place, with a
// stride. One TDPBF16PS makes 16 x 16 x 32 products, so tiles win from a few rows up; zero-padded to 16
// rows, a call of a few rows still costs only the weight reads (the figures against dpbf16 per row count:
// docs/results/design-figures.md, `quantgate bench woq`). Used for every call of a panel
// path when K is a multiple of 32 and the process was allowed the tile state (arch_prctl), so a bf16
// weight's rows are summed the same way at every batch size.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "wo_bf16_common.h"

#define QUANTGATE_AMX 1

namespace {

constexpr int kAmxRows = 16, kAmxPairs = 16;  // a tile: 16 rows x 64 bytes (16 k-pairs of bf16)

// configure_tiles() (amx_tiles.h): every tile 16 rows x 64 bytes. bf16: 0-2 accumulate up to 3 channel tiles,
// 3 holds x, 4-6 the weight; int8 (wo_bf16_amx_int8.h): 0-3 accumulate, 4-5 hold x's bytes, 6-7 the weight.

// 16 rows of x at `x` (bf16, K a row) x channel tiles [tile0, tile0 + TILES), the first `valid` of them
// written to out from row row0: weight pairs for (k-pair kp, tile t) at w + kp * kp_stride + t * tile_stride
// (in 64-byte vectors), as the dpbf16 paths read them. `between()` runs after each step's tile products: vector
// work placed there (the next block's dequantization) runs while the tile unit multiplies.
template <int TILES, class Between = NoWork>
void amx_block(const Problem& p, const uint16_t* x, int64_t row0, int valid, int64_t tile0, const __m512i* w,
               int64_t kp_stride, int64_t tile_stride, Between&& between = {}) {
  tiles_read(x, w);
  _tile_zero(0);
  if (TILES > 1) _tile_zero(1);
  if (TILES > 2) _tile_zero(2);
  const int64_t pairs = p.k / 2, x_stride = p.k * 2, w_stride = kp_stride * 64;
  for (int64_t kp = 0; kp < pairs; kp += kAmxPairs) {
    if (p.stream_x) _tile_stream_loadd(3, x + kp * 2, x_stride);
    else _tile_loadd(3, x + kp * 2, x_stride);
    _tile_loadd(4, w + kp * kp_stride, w_stride);
    _tile_dpbf16ps(0, 3, 4);
    if (TILES > 1) {
      _tile_loadd(5, w + kp * kp_stride + tile_stride, w_stride);
      _tile_dpbf16ps(1, 3, 5);
    }
    if (TILES > 2) {
      _tile_loadd(6, w + kp * kp_stride + 2 * tile_stride, w_stride);
      _tile_dpbf16ps(2, 3, 6);
    }
    between();
  }
  alignas(64) float sums[TILES][kAmxRows][kTile];
  _tile_stored(0, sums[0], 64);
  if (TILES > 1) _tile_stored(1, sums[TILES > 1 ? 1 : 0], 64);
  if (TILES > 2) _tile_stored(2, sums[TILES > 2 ? 2 : 0], 64);
  for (int r = 0; r < valid; ++r) {
    __m512 acc[1][TILES];
    for (int t = 0; t < TILES; ++t) acc[0][t] = _mm512_load_ps(sums[t][r]);
    store_rows<1, TILES>(p, row0 + r, tile0, acc, p.scales);
  }
}

// Whether AMX takes this call: then it takes every row (the last block of 16 zero-padded by the caller).
bool amx_takes(const Problem& p) {
  return p.k % (2 * kAmxPairs) == 0 && amx_allowed();
}

// x's last m % 16 rows copied into 16 zeroed ones (empty when m is a multiple of 16).
std::vector<uint16_t> amx_tail(const Problem& p) {
  const int64_t full = p.m / kAmxRows * kAmxRows;
  if (full == p.m) return {};
  std::vector<uint16_t> tail(kAmxRows * p.k, 0);
  std::memcpy(tail.data(), p.x + full * p.k, (p.m - full) * p.k * sizeof(uint16_t));
  return tail;
}

template <int TILES, class Between = NoWork>
void amx_rows_over(const Problem& p, const uint16_t* tail, int64_t tile0, const __m512i* w, int64_t kp_stride,
                   int64_t tile_stride, int64_t begin, int64_t end, Between&& between = {}) {
  // rows [begin, end), begin a multiple of 16
  const int64_t full = std::min(end, p.m / kAmxRows * kAmxRows);
  for (int64_t row0 = begin; row0 < full; row0 += kAmxRows)
    amx_block<TILES>(p, p.x + row0 * p.k, row0, kAmxRows, tile0, w, kp_stride, tile_stride, between);
  if (full < end)
    amx_block<TILES>(p, tail, full, static_cast<int>(end - full), tile0, w, kp_stride, tile_stride, between);
}

}  // namespace

#endif  // AMX
