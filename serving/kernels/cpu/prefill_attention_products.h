// The two products of one prefill item (a query head x 16 query rows), on AMX tiles where the build has them,
// else with VDPBF16PS (the `avx512bf16` path: AMD Zen 4, Intel Cooper Lake). Both read the same layouts
// (prefill_attention.cpp packs them) and sum each product in fp32 over bf16 pairs, so the two builds agree to
// the rounding of their summation order.
//   q      16 rows, `q_stride` values apart (zero rows past the chunk's end), dims contiguous
//   kh     one KV head's K: [key block][dim pair][16 keys][2]
//   scores [16 rows][s_stride] fp32: key block b at columns b * 16..
//   p      [16 rows][padded] bf16 probabilities, zero past the keys a row sees
//   vh     one KV head's V: [key pair][dim][2]
//   o      [16 rows][dim] fp32: P V, not yet divided by the row sums
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_tiles.h"
#define QG_PREFILL_TILES 1
#endif

namespace {

constexpr int64_t kRowsPerItem = 16, kKeyBlock = 16, kKeyChunk = 32, kDimChunk = 32;

#ifdef QG_PREFILL_TILES

// Tiles (configure_tiles: all 16 x 64 bytes): 0 accumulates, 1 the queries, 2 K (scores); 0-3 accumulate, 4 P,
// 5-7 V (values).

inline void item_scores(const uint16_t* q, int64_t q_stride, const uint16_t* kh, int64_t blocks, int64_t d,
                        float* scores, int64_t s_stride) {
  tiles_read(q, kh);
  for (int64_t b = 0; b < blocks; ++b) {
    _tile_zero(0);
    for (int64_t c = 0; c < d / kDimChunk; ++c) {
      _tile_loadd(1, q + c * kDimChunk, q_stride * 2);
      _tile_loadd(2, kh + (b * d / 2 + c * kDimChunk / 2) * kKeyBlock * 2, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, scores + b * kKeyBlock, s_stride * 4);
  }
}

// Whole 32-key chunks of P for all 16 rows (P is zero past the keys a row sees).
inline void item_values(const uint16_t* p, int64_t padded, const uint16_t* vh, int64_t d, int64_t /*first*/,
                        int /*rows*/, float* o) {
  const int64_t chunks = padded / kKeyChunk;
  tiles_read(p, vh);
  for (int64_t t0 = 0; t0 < d / 16; t0 += 4) {  // four 16-dim output tiles at a time
    const int tiles = static_cast<int>(std::min<int64_t>(4, d / 16 - t0));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(4, p + c * kKeyChunk, padded * 2);
      const uint16_t* vt = vh + (c * kKeyChunk / 2 * d + t0 * 16) * 2;
      _tile_loadd(5, vt, d * 4);
      _tile_dpbf16ps(0, 4, 5);
      if (tiles > 1) {
        _tile_loadd(6, vt + 32, d * 4);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (tiles > 2) {
        _tile_loadd(7, vt + 64, d * 4);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (tiles > 3) {
        _tile_loadd(5, vt + 96, d * 4);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    float* out = o + t0 * 16;
    _tile_stored(0, out, d * 4);
    if (tiles > 1) _tile_stored(1, out + 16, d * 4);
    if (tiles > 2) _tile_stored(2, out + 32, d * 4);
    if (tiles > 3) _tile_stored(3, out + 48, d * 4);
  }
}

inline bool products_ready() { return amx_allowed(); }
inline void products_begin() { configure_tiles(); }
inline void products_end() { _tile_release(); }

#else  // VDPBF16PS: the same products a dim pair (scores) or a key pair (values) at a time

inline __m512bh pair_of(const uint16_t* at) {  // two bf16 values, broadcast to every lane
  return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(at));
}

// A key block's scores for all 16 rows: one K load (16 keys x a dim pair) feeds 16 rows' accumulators.
inline void item_scores(const uint16_t* q, int64_t q_stride, const uint16_t* kh, int64_t blocks, int64_t d,
                        float* scores, int64_t s_stride) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* kb = kh + b * d / 2 * kKeyBlock * 2;
    __m512 acc[kRowsPerItem];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int64_t pair = 0; pair < d / 2; ++pair) {
      const __m512bh keys = (__m512bh)_mm512_loadu_si512(kb + pair * kKeyBlock * 2);
      for (int r = 0; r < kRowsPerItem; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], pair_of(q + r * q_stride + 2 * pair), keys);
    }
    for (int r = 0; r < kRowsPerItem; ++r) _mm512_storeu_ps(scores + r * s_stride + b * kKeyBlock, acc[r]);
  }
}

// ROWS rows x TILES 16-dim tiles of P V over the first `pairs` key pairs.
template <int ROWS, int TILES>
inline void values_block(const uint16_t* p, int64_t padded, const uint16_t* vh, int64_t d, int64_t pairs, float* o) {
  __m512 acc[ROWS][TILES];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512bh v[TILES];
    for (int t = 0; t < TILES; ++t) v[t] = (__m512bh)_mm512_loadu_si512(vh + (kp * d + t * 16) * 2);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh w = pair_of(p + r * padded + 2 * kp);
      for (int t = 0; t < TILES; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], w, v[t]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TILES; ++t) _mm512_storeu_ps(o + r * d + t * 16, acc[r][t]);
}

// Rows in blocks of 4 (4 x 4 tiles: 16 accumulators), each block only over the key pairs its last row sees:
// row r sees `first` + r keys; P is zero past them up to `padded`.
inline void item_values(const uint16_t* p, int64_t padded, const uint16_t* vh, int64_t d, int64_t first, int rows,
                        float* o) {
  constexpr int kBlockRows = 4;
  for (int r0 = 0; r0 < rows; r0 += kBlockRows) {
    const int64_t pairs = std::min(padded, first + r0 + kBlockRows) / 2;
    const uint16_t* pr = p + r0 * padded;
    float* out = o + r0 * d;
    for (int64_t t0 = 0; t0 < d / 16; t0 += 4) {
      if (d / 16 - t0 >= 4) values_block<kBlockRows, 4>(pr, padded, vh + t0 * 32, d, pairs, out + t0 * 16);
      else values_block<kBlockRows, 2>(pr, padded, vh + t0 * 32, d, pairs, out + t0 * 16);
    }
  }
}

inline bool products_ready() { return true; }
inline void products_begin() {}
inline void products_end() {}

#endif

}  // namespace
