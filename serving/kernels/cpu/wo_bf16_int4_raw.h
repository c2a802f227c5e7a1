// int4 over a panel of the raw codes, for the dpbf16 panel path at decode batches (AVX-512-BF16 without AMX:
// AMD's calls of 8 to kRawRowsBelow rows). Int4Panel writes bf16((q - 8) * scale + zero) per weight: ~9 vector ops per 32 weights beside the 16
// dpbf16 a 16-row call spends on them, and int4-awq ran 0.84-0.89x the bf16 baseline at batch 16 on an EPYC
// Zen 4 (docs/results/2026-12-07-amd-epyc-zen4.md). Here the panel holds q - 8 (exact in bf16): one table lookup
// per 32 weights, the codes' words already in dpbf16's pair order. The scale and zero come after the exact dot
// products, per group: y = sum_g scale_g * sum_{i in g} x_i (q_i - 8) + zero_g * sum_{i in g} x_i, the sums of x
// per group computed once per call. A block of 4 rows x 3 tiles holds the accumulators and a group's sums.
// Included by wo_bf16.cpp after store_rows.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "wo_bf16_common.h"

namespace {

constexpr int kRawRows = 4;  // 4 x 3 accumulators + 4 x 3 group sums + 3 weights + 1 broadcast of 32 zmm
// Below this many rows the raw panel; from it Int4Panel's rounded weights under the 8-row block. Paired against
// Int4Panel (EPYC Zen 4, SmolLM2's and an 8B's shapes): 1.14-1.27x at 8 rows, 1.03-1.10x at 16, 1.01-1.03x at
// 32, 0.94-1.00x at 64, 0.87-1.08x at 512; with 8 rows a block (the accumulators spilled) 0.62-0.91x from 16.
constexpr int64_t kRawRowsBelow = 48;

// Tiles tile0 + t * second_tile(p), t < tiles, as bf16 (q - 8): vector (k-pair kp, tile t) at panel[kp * tiles + t].
// A code word (8 inputs x 16 channels) shifted by 4i and looked up gives k-pair 4 * (word) + i in pair order.
inline void raw_int4_panel(const Problem& p, int64_t tile0, int tiles, __m512i* panel) {
  prefetch_scales(p, tile0, tiles);
  const __m512i table = int4_value_table();
  const int64_t words = p.k / 8;
  for (int t = 0; t < tiles; ++t) {
    const uint16_t* src = static_cast<const uint16_t*>(p.weight) + (tile0 + t * second_tile(p)) * words * 32;
    for (int64_t w = 0; w < words; ++w, src += 32) {
      prefetch_ahead(src);
      const __m512i codes = _mm512_loadu_si512(src);
      for (int i = 0; i < 4; ++i)
        _mm512_store_si512(panel + (w * 4 + i) * tiles + t, _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4 * i), table));
    }
  }
}

inline float bf16_value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

// Each row's inputs summed per group, bf16 as dpbf16 reads them: [M, K/g].
inline std::vector<float> group_sums(const Problem& p) {
  const int64_t groups = p.k / p.group_size;
  std::vector<float> sums(static_cast<size_t>(p.m * groups));
  for (int64_t r = 0; r < p.m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t end = (g + 1) * p.group_size;
      __m512 total = _mm512_setzero_ps();
      int64_t i = g * p.group_size;
      for (; i + kTile <= end; i += kTile) total = _mm512_add_ps(total, bf16_to_ps(p.x + r * p.k + i));
      float sum = _mm512_reduce_add_ps(total);
      for (; i < end; ++i) sum += bf16_value(p.x[r * p.k + i]);
      sums[r * groups + g] = sum;
    }
  return sums;
}

template <int ROWS, int TILES>
void rows_over_raw(const Problem& p, int64_t row0, int64_t tile0, const __m512i* panel, const float* x_sums) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t pairs = p.k / 2, group_pairs = p.group_size / 2, groups = p.k / p.group_size;
  const int32_t* x = reinterpret_cast<const int32_t*>(p.x + row0 * p.k);  // one int32 = inputs k, k+1
  __m512 acc[ROWS][TILES];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TILES; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 dot[ROWS][TILES];
    for (int r = 0; r < ROWS; ++r)
      for (int t = 0; t < TILES; ++t) dot[r][t] = _mm512_setzero_ps();
    for (int64_t kp = g * group_pairs; kp < (g + 1) * group_pairs; ++kp) {
      __m512i w[TILES];
      for (int t = 0; t < TILES; ++t) w[t] = _mm512_load_si512(panel + kp * TILES + t);
      for (int r = 0; r < ROWS; ++r) {
        const __m512i xr = _mm512_set1_epi32(x[r * pairs + kp]);
        for (int t = 0; t < TILES; ++t) dot[r][t] = _mm512_dpbf16_ps(dot[r][t], (__m512bh)xr, (__m512bh)w[t]);
      }
    }
    for (int t = 0; t < TILES; ++t) {
      const __m512i pair = _mm512_loadu_si512(p.scale_zero + g * p.n + (tile0 + t * second_tile(p)) * kTile);
      const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
      const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pair, high));
      for (int r = 0; r < ROWS; ++r)
        acc[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(x_sums[(row0 + r) * groups + g]), zero,
                                    _mm512_fmadd_ps(dot[r][t], scale, acc[r][t]));
    }
  }
  store_rows<ROWS, TILES>(p, row0, tile0, acc, nullptr);
}

template <int TILES>
void all_rows_raw(const Problem& p, int64_t row0, int64_t end, int64_t tile0, const __m512i* panel,
                  const float* x_sums) {
  for (; row0 + kRawRows <= end; row0 += kRawRows) rows_over_raw<kRawRows, TILES>(p, row0, tile0, panel, x_sums);
  switch (end - row0) {
    case 3: rows_over_raw<3, TILES>(p, row0, tile0, panel, x_sums); break;
    case 2: rows_over_raw<2, TILES>(p, row0, tile0, panel, x_sums); break;
    case 1: rows_over_raw<1, TILES>(p, row0, tile0, panel, x_sums); break;
    default: break;
  }
}

// Whether run_int4 takes the raw panel: without AMX, up to kRawRowsBelow rows.
inline bool int4_raw_takes(const Problem& p, bool amx) { return !amx && p.m < kRawRowsBelow; }

// The raw panel's calls (fewer than kRawRowsBelow rows: x stays in L1/L2 beside a block's panel), block by block.
inline void run_int4_raw(const Problem& p) {
  const Blocks blocks(p, kTilesPerBlock);
  const std::vector<float> x_sums = group_sums(p);
  at::parallel_for(0, blocks.count(), 1, [&](int64_t begin, int64_t end) {
    __m512i* panel = thread_panel(p.k / 2 * kTilesPerBlock);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t tile0 = blocks.first(b);
      const int count = blocks.size(b);
      raw_int4_panel(p, tile0, count, panel);
      if (count == 3) all_rows_raw<3>(p, 0, p.m, tile0, panel, x_sums.data());
      else if (count == 2) all_rows_raw<2>(p, 0, p.m, tile0, panel, x_sums.data());
      else all_rows_raw<1>(p, 0, p.m, tile0, panel, x_sums.data());
    }
  });
}

}  // namespace
