// The int16 paths of wo_bf16.cpp (decode batches; on Intel without AMX every call): x rounded to int16, exact integer sums.
#pragma once

#include <algorithm>
#include <vector>

#include "wo_bf16_common.h"

#include <ATen/Parallel.h>

namespace {

// Few rows (decode): each row of x is rounded once to int16 (scale absmax/32767: finer than x's own bf16
// rounding for every element above absmax/128) and the weights are widened to int16 in registers (int8:
// one sign extension; int4: a shift and a mask per four codes), so one vpdpwssd makes 32 exact products
// per row, with no per-weight float conversion: the step stays bound by reading the weights. Sums are
// exact int32 (int8: flushed to fp32 every 256 inputs, |sum| < 256 * 128 * 32768 = 2^30; int4: per group).
// Each row's result depends on that row alone.
struct Int16Rows {
  std::vector<int16_t> x;  // [M, K]
  std::vector<float> scale;  // [M]: x ~ scale * x16
  std::vector<float> xsum;  // int4: [M, K/g] sums of x16 over each group (exact in fp32: < 2^24)
};

// Vectorized: as a scalar loop this rounding cost more than the product it feeds at a few rows
// (docs/results/design-figures.md).
// K is even; a K that is not a multiple of 16 ends in a masked vector.
Int16Rows round_rows(const Problem& p) {
  const int64_t groups = p.group_size ? p.k / p.group_size : 0;
  Int16Rows q{std::vector<int16_t>(p.m * p.k), std::vector<float>(p.m), std::vector<float>(p.m * groups, 0.0f)};
  for (int64_t r = 0; r < p.m; ++r) {
    const uint16_t* x = p.x + r * p.k;
    __m512 peak = _mm512_setzero_ps();
    for (int64_t k = 0; k < p.k; k += 16) {
      const __mmask16 m = p.k - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (p.k - k)) - 1);
      const __m512i bits = _mm512_maskz_cvtepu16_epi32(m, _mm256_maskz_loadu_epi16(m, x + k));
      peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16))));
    }
    const float absmax = _mm512_reduce_max_ps(peak);
    const __m512 inv = _mm512_set1_ps(absmax > 0.0f ? 32767.0f / absmax : 1.0f);
    q.scale[r] = absmax > 0.0f ? absmax / 32767.0f : 1.0f;
    for (int64_t k = 0; k < p.k; k += 16) {
      const __mmask16 m = p.k - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (p.k - k)) - 1);
      const __m512i bits = _mm512_maskz_cvtepu16_epi32(m, _mm256_maskz_loadu_epi16(m, x + k));
      const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)), inv);
      const __m512i steps = _mm512_max_epi32(_mm512_set1_epi32(-32767),
                                             _mm512_min_epi32(_mm512_set1_epi32(32767), _mm512_cvtps_epi32(v)));
      _mm256_mask_storeu_epi16(q.x.data() + r * p.k + k, m, _mm512_cvtepi32_epi16(steps));
      if (groups && p.group_size % 16 == 0 && m == 0xFFFF) {  // the vector lies in one group
        q.xsum[r * groups + k / p.group_size] += static_cast<float>(_mm512_reduce_add_epi32(steps));
      } else if (groups) {  // groups are multiples of 8: a vector may span two
        alignas(64) int32_t lanes[16];
        _mm512_store_si512(lanes, steps);
        for (int i = 0; i < 16 && k + i < p.k; ++i) q.xsum[r * groups + (k + i) / p.group_size] += lanes[i];
      }
    }
  }
  return q;
}

// Calls under this many rows take the int16 rows (where AMX does not take them). On Intel cores VPDPWSSD issues
// on two ports and VDPBF16PS on one, so the exact int16 sums beat the dpbf16 panel at every row count; on AMD
// Zen 4 the panel paths win from the row counts below. The figures: docs/results/design-figures.md.
int64_t int16_rows_below(bool int4) {
  static const bool intel = __builtin_cpu_is("intel");
  return intel ? INT64_MAX : int4 ? 8 : 24;
}

constexpr int kSmallRows = 4;  // rows per register block on the int16 paths (8 would spill registers)
constexpr int64_t kFlushPairs = 128;  // int8: k-pairs per exact int32 sum

template <int ROWS, int TILES>
void int8_rows(const Problem& p, const Int16Rows& xq, int64_t row0, int64_t tile0) {
  const int64_t pairs = p.k / 2;
  const int8_t* base = static_cast<const int8_t*>(p.weight);
  const int32_t* x = reinterpret_cast<const int32_t*>(xq.x.data() + row0 * p.k);  // one int32 = inputs k, k+1
  __m512 acc[ROWS][TILES];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TILES; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < pairs; k0 += kFlushPairs) {
    __m512i sum[ROWS][TILES];
    for (int r = 0; r < ROWS; ++r)
      for (int t = 0; t < TILES; ++t) sum[r][t] = _mm512_setzero_si512();
    for (int64_t kp = k0; kp < std::min(pairs, k0 + kFlushPairs); ++kp) {
      __m512i w[TILES];
      for (int t = 0; t < TILES; ++t) {
        const int8_t* at = base + ((tile0 + t) * pairs + kp) * 32;
        if (kp % 2 == 0) prefetch_ahead(at);
        w[t] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
      }
      for (int r = 0; r < ROWS; ++r) {
        const __m512i xr = _mm512_set1_epi32(x[r * pairs + kp]);
        for (int t = 0; t < TILES; ++t) sum[r][t] = _mm512_dpwssd_epi32(sum[r][t], xr, w[t]);
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int t = 0; t < TILES; ++t) acc[r][t] = _mm512_add_ps(acc[r][t], _mm512_cvtepi32_ps(sum[r][t]));
  }
  store_rows<ROWS, TILES>(p, row0, tile0, acc, p.scales, xq.scale.data());
}

// Codes of k-pair 4j + i from word j: nibble i of each 16-bit lane, as int16.
inline __m512i nibble_codes(__m512i word, int i) {
  return _mm512_and_si512(_mm512_srli_epi16(word, 4 * i), _mm512_set1_epi16(0xF));
}

// int4 codes are packed [N/16, K/8, 32] u16: lane L (channel L/2, input parity L%2) of word j holds the
// codes of k-pairs 4j..4j+3 in its four nibbles. Per group: y += scale * sum(x16 * q) +
// (zero - 8 * scale) * sum(x16), times the row's scale at the end.
// `widened` (from 8 rows, see widen_int4): the block's codes as int16 vectors [K/2][TILES], read instead of
// extracting the nibbles again for every 4 rows. The sums are the same either way.
template <int ROWS, int TILES>
void int4_rows(const Problem& p, const Int16Rows& xq, int64_t row0, int64_t tile0, const __m512i* widened) {
  const float* xsum = xq.xsum.data();
  const int64_t pairs = p.k / 2, quads = p.k / 8, groups = p.k / p.group_size;
  const int64_t quads_per_group = p.group_size / 8;
  const uint16_t* codes = static_cast<const uint16_t*>(p.weight);
  const int32_t* x = reinterpret_cast<const int32_t*>(xq.x.data() + row0 * p.k);
  __m512 acc[ROWS][TILES];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TILES; ++t) acc[r][t] = _mm512_setzero_ps();
  if (row0 == 0) prefetch_scales(p, tile0, TILES);  // the later rows find them cached
  for (int64_t g = 0; g < groups; ++g) {
    if (row0 == 0) prefetch_scales_ahead(p, tile0, TILES, g);
    __m512i part[ROWS][TILES];
    for (int r = 0; r < ROWS; ++r)
      for (int t = 0; t < TILES; ++t) part[r][t] = _mm512_setzero_si512();
    for (int64_t qd = g * quads_per_group; qd < (g + 1) * quads_per_group; ++qd) {
      __m512i word[TILES];
      if (!widened)
        for (int t = 0; t < TILES; ++t) {
          const uint16_t* at = codes + ((tile0 + t) * quads + qd) * 32;
          prefetch_ahead(at);
          word[t] = _mm512_loadu_si512(at);
        }
      for (int i = 0; i < 4; ++i) {
        const int64_t kp = qd * 4 + i;
        __m512i w[TILES];
        for (int t = 0; t < TILES; ++t)
          w[t] = widened ? _mm512_load_si512(widened + kp * TILES + t)
                         : nibble_codes(word[t], i);
        for (int r = 0; r < ROWS; ++r) {
          const __m512i xr = _mm512_set1_epi32(x[r * pairs + kp]);
          for (int t = 0; t < TILES; ++t) part[r][t] = _mm512_dpwssd_epi32(part[r][t], xr, w[t]);
        }
      }
    }
    for (int t = 0; t < TILES; ++t) {
      const __m512i pair = _mm512_loadu_si512(p.scale_zero + g * p.n + (tile0 + t) * kTile);
      const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
      const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      const __m512 shifted = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero);  // (q - 8) s + z = q s + (z - 8 s)
      for (int r = 0; r < ROWS; ++r) {
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[r][t]), scale, acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[(row0 + r) * groups + g]), shifted, acc[r][t]);
      }
    }
  }
  store_rows<ROWS, TILES>(p, row0, tile0, acc, nullptr, xq.scale.data());
}

template <bool INT4, int ROWS, int TILES>
void small_block(const Problem& p, const Int16Rows& xq, int64_t row0, int64_t tile0, const __m512i* widened) {
  if constexpr (INT4) int4_rows<ROWS, TILES>(p, xq, row0, tile0, widened);
  else int8_rows<ROWS, TILES>(p, xq, row0, tile0);
}

template <bool INT4, int TILES>
void small_rows(const Problem& p, const Int16Rows& xq, int64_t tile0, const __m512i* widened, int64_t row0,
                int64_t end) {
  for (; row0 + kSmallRows <= end; row0 += kSmallRows)
    small_block<INT4, kSmallRows, TILES>(p, xq, row0, tile0, widened);
  switch (end - row0) {
    case 3: small_block<INT4, 3, TILES>(p, xq, row0, tile0, widened); break;
    case 2: small_block<INT4, 2, TILES>(p, xq, row0, tile0, widened); break;
    case 1: small_block<INT4, 1, TILES>(p, xq, row0, tile0, widened); break;
    default: break;
  }
}

// int4 from this many rows: the block's nibbles are widened to int16 once into a panel ([K/2][tiles]
// vectors, 147 KB at K = 1536: it stays in L2) that every block of 4 rows reads.
constexpr int64_t kInt4WidenRows = 8;

void widen_int4(const Problem& p, int64_t tile0, int tiles, __m512i* panel) {
  const int64_t quads = p.k / 8;
  const uint16_t* codes = static_cast<const uint16_t*>(p.weight);
  for (int t = 0; t < tiles; ++t)
    for (int64_t qd = 0; qd < quads; ++qd) {
      prefetch_ahead(codes + ((tile0 + t) * quads + qd) * 32);
      const __m512i word = _mm512_loadu_si512(codes + ((tile0 + t) * quads + qd) * 32);
      for (int i = 0; i < 4; ++i)
        panel[(qd * 4 + i) * tiles + t] = nibble_codes(word, i);
    }
}

template <bool INT4>
void run_small(const Problem& p) {
  const Int16Rows xq = round_rows(p);
  const Blocks blocks(p, kTilesPerBlock);
  const bool widen = INT4 && p.m >= kInt4WidenRows;
  at::parallel_for(0, blocks.count(), 1, [&](int64_t begin, int64_t end) {
    __m512i* panel = widen ? thread_panel(p.k / 2 * kTilesPerBlock) : nullptr;
    const __m512i* widened = panel;
    for (int64_t row0 = 0; row0 < p.m; row0 += kChunkRows) {
      const int64_t rows_end = std::min(p.m, row0 + kChunkRows);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t tile0 = blocks.first(b);
        const int count = blocks.size(b);
        if (widen) widen_int4(p, tile0, count, panel);
        if (count == 3) small_rows<INT4, 3>(p, xq, tile0, widened, row0, rows_end);
        else if (count == 2) small_rows<INT4, 2>(p, xq, tile0, widened, row0, rows_end);
        else small_rows<INT4, 1>(p, xq, tile0, widened, row0, rows_end);
      }
    }
  });
}

}  // namespace
