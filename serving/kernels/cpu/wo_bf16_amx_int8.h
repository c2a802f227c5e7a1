// int8 weights in quads ([N/16, K/4, 16, 4]), where the CPU has AMX-INT8 (woq.py
// packs them so there: `int8_width`): the int16 few-row path's exact integer sums without its per-weight
// widening. Each row of x is rounded to int16 as there (round_rows) and split into bytes, x16 = 256 * hi
// + lo (lo unsigned). More than 2 rows: AMX tiles, TDPBUSD summing lo * w and TDPBSSD hi * w over 64
// inputs a step (a B tile is 16 quads x 16 channels, read in place). 1-2 rows, where tiles padded to
// 16 rows cost more than they save: VPDPBUSD over the same quads, hi taken unsigned (hi + 128) and
// 128 * sum(w) taken off again. Both sums are exact in int32 (|lo * w| <= 255 * 127, K up to 65 536) and
// combined alike, so a row's result is the same on either path, at any batch size.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <cstdint>
#include <vector>

#include "wo_bf16_amx.h"
#include "wo_bf16_common.h"
#include "wo_bf16_few_rows.h"

#define QUANTGATE_AMX_INT8 1

namespace {

constexpr int64_t kAmxQuadsMaxK = 65536;  // lo * w sums stay exact in int32 up to here

constexpr int64_t kVnniMaxRows = 2;  // up to here VPDPBUSD, above AMX tiles (quantgate bench woq)
constexpr int64_t kInt8ChunkRows = 512;  // rows of x's bytes (2 planes) kept in L2 while blocks pass

struct ByteRows {
  std::vector<uint8_t> lo;  // [rows padded to 16, K]
  std::vector<int8_t> hi;   // signed for TDPBSSD; the VPDPBUSD path reads it as uint8 hi + 128
};

// `biased`: hi stored as hi + 128 (its top bit flipped), an unsigned byte.
ByteRows split_bytes(const Int16Rows& q, int64_t m, int64_t k, bool biased) {
  const int64_t padded = (m + kAmxRows - 1) / kAmxRows * kAmxRows;
  ByteRows b{std::vector<uint8_t>(padded * k, 0), std::vector<int8_t>(padded * k, 0)};
  const int8_t flip = biased ? static_cast<int8_t>(0x80) : 0;
  const __m256i flips = _mm256_set1_epi8(flip);
  int64_t i = 0;
  for (; i + 32 <= m * k; i += 32) {
    const __m512i v = _mm512_loadu_si512(q.x.data() + i);
    const __m256i hi = _mm256_xor_si256(_mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)), flips);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.lo.data() + i), _mm512_cvtepi16_epi8(v));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.hi.data() + i), hi);
  }
  for (; i < m * k; ++i) {
    b.lo[i] = static_cast<uint8_t>(q.x[i] & 0xFF);
    b.hi[i] = static_cast<int8_t>((q.x[i] >> 8) ^ flip);
  }
  return b;
}

// 256 * hi + lo in fp32, rounded the same way on both paths.
inline __m512 combine(__m512i hi, __m512i lo) {
  return _mm512_fmadd_round_ps(_mm512_cvt_roundepi32_ps(hi, kRound), _mm512_set1_ps(256.0f),
                               _mm512_cvt_roundepi32_ps(lo, kRound), kRound);
}

// Rows [row0, row0 + 16) of the byte planes x channel tiles [tile0, tile0 + TILES), the first `valid`
// rows written. Tiles 0-1: lo sums, 2-3: hi sums, 4-5: x's bytes, 6-7: the weight.
template <int TILES>
void amx_int8_block(const Problem& p, const ByteRows& b, const float* row_scale, int64_t row0, int valid,
                    int64_t tile0) {
  const int64_t quads = p.k / 4;
  const int8_t* w = static_cast<const int8_t*>(p.weight);
  _tile_zero(0);
  _tile_zero(2);
  if (TILES > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t q0 = 0; q0 < quads; q0 += kAmxRows) {
    _tile_loadd(4, b.lo.data() + row0 * p.k + q0 * 4, p.k);
    _tile_loadd(5, b.hi.data() + row0 * p.k + q0 * 4, p.k);
    _tile_loadd(6, w + (tile0 * quads + q0) * 64, 64);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbssd(2, 5, 6);
    if (TILES > 1) {
      _tile_loadd(7, w + ((tile0 + 1) * quads + q0) * 64, 64);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbssd(3, 5, 7);
    }
  }
  alignas(64) int32_t lo[TILES][kAmxRows][kTile], hi[TILES][kAmxRows][kTile];
  _tile_stored(0, lo[0], 64);
  _tile_stored(2, hi[0], 64);
  if (TILES > 1) {
    _tile_stored(1, lo[TILES - 1], 64);
    _tile_stored(3, hi[TILES - 1], 64);
  }
  for (int r = 0; r < valid; ++r) {
    __m512 acc[1][TILES];
    for (int t = 0; t < TILES; ++t)
      acc[0][t] = combine(_mm512_load_si512(hi[t][r]), _mm512_load_si512(lo[t][r]));
    store_rows<1, TILES>(p, row0 + r, tile0, acc, p.scales, row_scale);
  }
}

// ROWS rows x TILES channel tiles with VPDPBUSD: lo * w and (hi + 128) * w, and sum(w) to take 128 of.
template <int ROWS, int TILES>
void vnni_block(const Problem& p, const ByteRows& b, const float* row_scale, int64_t tile0) {
  const int64_t quads = p.k / 4;
  const int8_t* w = static_cast<const int8_t*>(p.weight);
  const int32_t* lo = reinterpret_cast<const int32_t*>(b.lo.data());  // one int32: x's bytes at 4 inputs
  const int32_t* hi = reinterpret_cast<const int32_t*>(b.hi.data());
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i lo_sum[ROWS][TILES], hi_sum[ROWS][TILES], w_sum[TILES];
  for (int t = 0; t < TILES; ++t) {
    w_sum[t] = _mm512_setzero_si512();
    for (int r = 0; r < ROWS; ++r) lo_sum[r][t] = hi_sum[r][t] = _mm512_setzero_si512();
  }
  for (int64_t j = 0; j < quads; ++j) {
    __m512i wq[TILES];
    for (int t = 0; t < TILES; ++t) {
      prefetch_ahead(w + ((tile0 + t) * quads + j) * 64);
      wq[t] = _mm512_loadu_si512(w + ((tile0 + t) * quads + j) * 64);
      w_sum[t] = _mm512_dpbusd_epi32(w_sum[t], ones, wq[t]);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512i l = _mm512_set1_epi32(lo[r * quads + j]), h = _mm512_set1_epi32(hi[r * quads + j]);
      for (int t = 0; t < TILES; ++t) {
        lo_sum[r][t] = _mm512_dpbusd_epi32(lo_sum[r][t], l, wq[t]);
        hi_sum[r][t] = _mm512_dpbusd_epi32(hi_sum[r][t], h, wq[t]);
      }
    }
  }
  __m512 acc[ROWS][TILES];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TILES; ++t) {
      const __m512i signed_hi = _mm512_sub_epi32(hi_sum[r][t], _mm512_slli_epi32(w_sum[t], 7));
      acc[r][t] = combine(signed_hi, lo_sum[r][t]);
    }
  store_rows<ROWS, TILES>(p, 0, tile0, acc, p.scales, row_scale);
}

template <int ROWS>
void vnni_rows(const Problem& p, const ByteRows& b, const float* row_scale) {
  const int64_t tiles = p.n / kTile, blocks = (tiles + 1) / 2;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      if (2 * blk + 1 < tiles) vnni_block<ROWS, 2>(p, b, row_scale, 2 * blk);
      else vnni_block<ROWS, 1>(p, b, row_scale, 2 * blk);
    }
  });
}

void run_int8_amx(const Problem& p) {
  const Int16Rows q = round_rows(p);
  const ByteRows b = split_bytes(q, p.m, p.k, p.m <= kVnniMaxRows);
  switch (p.m) {
    case 1: return vnni_rows<1>(p, b, q.scale.data());
    case 2: return vnni_rows<2>(p, b, q.scale.data());
    default: break;
  }
  const int64_t tiles = p.n / kTile, blocks = (tiles + 1) / 2;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t chunk = 0; chunk < p.m; chunk += kInt8ChunkRows) {  // x's bytes stay in L2 across blocks
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t tile0 = blk * 2;
        for (int64_t row0 = chunk; row0 < std::min(p.m, chunk + kInt8ChunkRows); row0 += kAmxRows) {
          const int valid = static_cast<int>(std::min<int64_t>(kAmxRows, p.m - row0));
          if (tile0 + 1 < tiles) amx_int8_block<2>(p, b, q.scale.data(), row0, valid, tile0);
          else amx_int8_block<1>(p, b, q.scale.data(), row0, valid, tile0);
        }
      }
    }
    _tile_release();
  });
}

}  // namespace

#endif  // AMX-INT8
