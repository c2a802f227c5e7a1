// Shared by wo_bf16.cpp and wo_bf16_few_rows.h: the problem, the block sizes and the output store.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

namespace {

constexpr int kTile = 16;        // output channels per zmm of fp32 accumulators
constexpr int kTilesPerBlock = 3;  // 48 channels per panel
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
constexpr int kRows = 8;         // rows of x per register block: 8 x 3 accumulators + 3 weights + 1 broadcast
// Rows per chunk of a large call, so a chunk of x stays in L2 beside a block's weights: looping every block over
// all 2048 rows of a prefill re-read x from memory per 48 channels (what that cost: docs/results/design-figures.md).
constexpr int64_t kChunkRows = 256;

struct Problem {
  const uint16_t* x;  // bf16 bits [M, K]
  int64_t m, k, n;
  const void* weight;
  const float* scales;  // int8: [N] fp32
  const uint32_t* scale_zero;  // int4: [K/g, N] pairs of bf16 (scale low, zero high), the stored tensor
  int64_t group_size;
  void* out;  // [M, N], fp32 or bf16
  bool out_bf16;
  bool stream_x;  // AMX: x's tiles loaded with the no-reuse hint, so a block's weight tiles stay in L1 (wide calls)
  const uint16_t* silu;  // set (torch's silu table, silu_table.h): out [M, N/2] = silu(gate) * up, a block's 2
                         // tiles a gate tile and the up tile of the same channels (wo_bf16_silu.h)
};

// 16 bf16 values of x widened to fp32 (exact).
inline __m512 bf16_to_ps(const uint16_t* x) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}

// The default of the kernels' `between` hooks (work run between tile steps): none.
struct NoWork {
  void operator()() const {}
};

// How far ahead of a weight stream the kernels ask for lines: the hardware prefetchers do not run far
// enough ahead of a kernel that spends cycles on every line (wo_fp32.cpp's kPrefetchBytes, the same).
constexpr int64_t kPrefetchAhead = 4096;

inline void prefetch_ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchAhead, _MM_HINT_T0);
}

// int4: the scales of channel tiles [tile0, tile0 + tiles) for group g, one line per tile, each group a row of
// [K/g, N] apart (another page for every group of a wide layer, where the hardware prefetchers do not follow).
inline void prefetch_group_scales(const Problem& p, int64_t tile0, int tiles, int64_t g) {
  const int64_t end = std::min<int64_t>(tile0 + tiles, p.n / kTile);
  for (int64_t t = tile0; t < end; ++t) _mm_prefetch(reinterpret_cast<const char*>(p.scale_zero + g * p.n + t * kTile), _MM_HINT_T1);
}

// Group by group, kScaleGroupsAhead groups ahead of the group being read (the next block's first groups near
// the end of a block), into L2 (prefetcht1, as wo_fp32.cpp's weight streams): a few lines in flight at a time.
// Asked for a block ahead all at once (384 lines at K = 4096), an 8B-shaped int4 call at 16 rows still spent
// ~40 % of its samples waiting on its scale loads (perf); figures: docs/results/2026-12-05-wo-rows.md.
constexpr int64_t kScaleGroupsAhead = 8;

inline void prefetch_scales_ahead(const Problem& p, int64_t tile0, int tiles, int64_t g) {
  const int64_t groups = p.k / p.group_size, ahead = g + kScaleGroupsAhead;
  if (ahead < groups) prefetch_group_scales(p, tile0, tiles, ahead);
  else prefetch_group_scales(p, tile0 + tiles, tiles, ahead - groups);
}

// The first kScaleGroupsAhead groups of tiles [tile0, tile0 + tiles): before a block's first group is read.
inline void prefetch_scales(const Problem& p, int64_t tile0, int tiles) {
  if (tile0 * kTile >= p.n) return;
  const int64_t groups = std::min(p.k / p.group_size, kScaleGroupsAhead);
  for (int64_t g = 0; g < groups; ++g) prefetch_group_scales(p, tile0, tiles, g);
}

// The 16 int4 values q - 8 as bf16 (exact: small integers), twice: vpermw reads an index's low 5 bits, so a code
// word shifted by 4i looks up its nibble i whatever the nibble above it.
inline __m512i int4_value_table() {
  alignas(64) uint16_t values[32];
  for (int i = 0; i < 32; ++i) {
    const float v = static_cast<float>(i % 16 - 8);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    values[i] = static_cast<uint16_t>(bits >> 16);
  }
  return _mm512_load_si512(values);
}

// Tiles between a block's first and second channel tile: the next one, or a silu call's up tile.
inline int64_t second_tile(const Problem& p) { return p.silu ? p.n / kTile / 2 : 1; }

// A call's channel tiles handed out in blocks of `per` (the last may hold fewer); a silu call's block b is gate
// tile b and its up tile (second_tile on): 2 tiles a block, N/32 blocks.
struct Blocks {
  int64_t tiles;  // the call's channel tiles; a silu call's gate tiles
  int per;
  bool silu;
  Blocks(const Problem& p, int tiles_per_block)
      : tiles(p.silu ? p.n / kTile / 2 : p.n / kTile), per(p.silu ? 2 : tiles_per_block), silu(p.silu != nullptr) {}
  int64_t count() const { return silu ? tiles : (tiles + per - 1) / per; }
  int64_t first(int64_t b) const { return silu ? b : b * per; }
  int size(int64_t b) const { return silu ? 2 : static_cast<int>(std::min<int64_t>(per, tiles - b * per)); }
};

// 16 channels from n0 of one output row as the call writes them: times the per-channel scales (int8) and the
// row's scale (x rounded to int16) where given, each product rounded explicitly (-ffast-math may not
// reassociate them differently in each instantiation), so a row's result is the row's alone.
inline __m512 scaled(__m512 acc, const float* scales, int64_t n0, const float* row_scale) {
  const __m512 scale = scales ? _mm512_loadu_ps(scales + n0) : _mm512_set1_ps(1.0f);
  const __m512 s = row_scale ? _mm512_mul_round_ps(scale, _mm512_set1_ps(*row_scale), kRound) : scale;
  return _mm512_mul_round_ps(acc, s, kRound);
}

// An output rounded to bf16 as the unfused call writes it, and widened back (exact).
inline __m512 round_bf16(__m512 v) {
  const __m512i bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}

// silu(gate) * up for ROWS rows of a gate tile (acc[r][0], channels from tile0 * 16) and its up tile (acc[r][1],
// N/2 channels on) into out [M, N/2]: the bits `F.silu(gate) * up` gives over the bf16 outputs of the unfused
// call (gate, up and silu each rounded to bf16, silu by torch's own table, the product rounded again).
template <int ROWS>
void store_silu_rows(const Problem& p, int64_t row0, int64_t tile0, const __m512 (&acc)[ROWS][2],
                     const float* scales, const float* row_scales) {
  const int64_t half = p.n / 2;
  for (int r = 0; r < ROWS; ++r) {
    const float* row_scale = row_scales ? row_scales + row0 + r : nullptr;
    const __m512 gate = scaled(acc[r][0], scales, tile0 * kTile, row_scale);
    const __m512 up = scaled(acc[r][1], scales, half + tile0 * kTile, row_scale);
    const __m512i codes = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(gate));
    const __m512i silu = _mm512_and_si512(_mm512_i32gather_epi32(codes, p.silu, 2), _mm512_set1_epi32(0xFFFF));
    const __m512 y = _mm512_mul_round_ps(_mm512_castsi512_ps(_mm512_slli_epi32(silu, 16)), round_bf16(up), kRound);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p.out) + (row0 + r) * half + tile0 * kTile),
                        (__m256i)_mm512_cvtneps_pbh(y));
  }
}

// Write ROWS x TILES accumulators to out, times the per-channel scales (int8) and the per-row scales
// (x rounded to int16) where given; a silu call (p.silu) writes silu(gate) * up instead.
template <int ROWS, int TILES>
void store_rows(const Problem& p, int64_t row0, int64_t tile0, const __m512 (&acc)[ROWS][TILES],
                const float* scales, const float* row_scales = nullptr) {
  if constexpr (TILES == 2) {
    if (p.silu) return store_silu_rows<ROWS>(p, row0, tile0, acc, scales, row_scales);
  }
  for (int t = 0; t < TILES; ++t) {
    const int64_t n0 = (tile0 + t) * kTile;
    for (int r = 0; r < ROWS; ++r) {
      const __m512 y = scaled(acc[r][t], scales, n0, row_scales ? row_scales + row0 + r : nullptr);
      const int64_t at = (row0 + r) * p.n + n0;
      if (p.out_bf16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p.out) + at),
                            (__m256i)_mm512_cvtneps_pbh(y));
      } else {
        _mm512_storeu_ps(static_cast<float*>(p.out) + at, y);
      }
    }
  }
}

// A thread's panel buffer, kept from call to call and never cleared (every path writes the words it reads): a
// zeroed std::vector per call cost each thread a 110-300 KB memset a projection, ~120 times a decode step.
inline __m512i* thread_panel(int64_t vectors) {
  static thread_local std::unique_ptr<__m512i[]> buffer;
  static thread_local int64_t size = 0;
  if (size < vectors) buffer.reset(new __m512i[vectors]), size = vectors;
  return buffer.get();
}

}  // namespace
