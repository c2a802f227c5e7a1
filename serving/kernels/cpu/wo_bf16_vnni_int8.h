// int8 weights in quads ([N/16, K/4, 16, 4]) on VPDPBUSD (AVX-512-VNNI): exact integer sums, no per-weight
// widening or float conversion. Each row of x is rounded to int16 (absmax / 32767 steps, round_rows' ops) and
// split into bytes, x16 = 256 * hi + lo (lo unsigned); hi is taken unsigned (hi + 128) and 128 * sum(w) taken
// off again. Two VPDPBUSD a row per 64 products, what a bf16 weight's two VDPBF16PS cost, over half the weight
// bytes. The AMX build (wo_bf16_amx_int8.h) runs calls of 1-2 rows here and the rest on tiles over the same
// quads; every other build with VNNI (the `avx512bf16` path: AMD Zen 4, Intel without AMX) runs every call
// here (run_int8_vnni), rows in blocks of 4 over a block's column sums taken once. Both sums are exact in
// int32 (|lo * w| <= 255 * 127, K up to 65 536) and combined alike, so a row's result is the same on every
// path and at every batch size.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "wo_bf16_common.h"

#define QUANTGATE_VNNI_INT8 1

namespace {

constexpr int64_t kBytePadRows = 16;  // x's byte planes padded to whole AMX tiles (16 rows)
constexpr int64_t kAmxQuadsMaxK = 65536;  // lo * w sums stay exact in int32 up to here

constexpr int64_t kVnniMaxRows = 2;  // up to here VPDPBUSD, above AMX tiles (quantgate bench woq)
constexpr int64_t kInt8ChunkRows = 512;  // rows of x's bytes (2 planes) kept in L2 while blocks pass
constexpr int64_t kSplitGrainRows = 64;  // rows of x per thread when they are rounded and split

// x's bytes, 16-row padded: lo unsigned, hi signed for TDPBSSD (the VPDPBUSD path reads it as uint8 hi + 128).
struct ByteRows {
  std::unique_ptr<uint8_t[]> lo;  // [rows padded to 16, K]
  std::unique_ptr<int8_t[]> hi;
  std::vector<float> scale;  // [M]: x ~ scale * (256 * hi + lo)
};

// Rows [r0, r1) of x rounded to int16 as round_rows does (absmax / 32767 steps, the same ops, so the same
// values) and written straight into the byte planes: no int16 copy of x, one pass per row after its absmax.
// K is a multiple of 64 here. `biased`: hi stored as hi + 128 (its top bit flipped), an unsigned byte.
void split_rows(const Problem& p, ByteRows& b, int64_t r0, int64_t r1, bool biased) {
  const __m128i flips = _mm_set1_epi8(biased ? static_cast<char>(0x80) : 0);
  const __m512i top = _mm512_set1_epi32(32767), bottom = _mm512_set1_epi32(-32767);
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* x = p.x + r * p.k;
    __m512 peak = _mm512_setzero_ps();
    for (int64_t k = 0; k < p.k; k += 16)
      peak = _mm512_max_ps(peak, _mm512_abs_ps(bf16_to_ps(x + k)));
    const float absmax = _mm512_reduce_max_ps(peak);
    const __m512 inv = _mm512_set1_ps(absmax > 0.0f ? 32767.0f / absmax : 1.0f);
    b.scale[r] = absmax > 0.0f ? absmax / 32767.0f : 1.0f;
    for (int64_t k = 0; k < p.k; k += 16) {
      const __m512i steps = _mm512_max_epi32(bottom, _mm512_min_epi32(top, _mm512_cvtps_epi32(_mm512_mul_ps(bf16_to_ps(x + k), inv))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(b.lo.get() + r * p.k + k), _mm512_cvtepi32_epi8(steps));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(b.hi.get() + r * p.k + k),
                       _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_srai_epi32(steps, 8)), flips));
    }
  }
}

// Many rows: split across the threads (a 512-row prefill chunk's rounding is ~1/10 of its products).
ByteRows split_bytes(const Problem& p, bool biased) {
  const int64_t padded = (p.m + kBytePadRows - 1) / kBytePadRows * kBytePadRows;
  ByteRows b{std::unique_ptr<uint8_t[]>(new uint8_t[padded * p.k]), std::unique_ptr<int8_t[]>(new int8_t[padded * p.k]),
             std::vector<float>(p.m)};
  std::memset(b.lo.get() + p.m * p.k, 0, (padded - p.m) * p.k);  // padding rows: zero (hi's bias unread there)
  std::memset(b.hi.get() + p.m * p.k, 0, (padded - p.m) * p.k);
  at::parallel_for(0, p.m, kSplitGrainRows, [&](int64_t r0, int64_t r1) { split_rows(p, b, r0, r1, biased); });
  return b;
}

// 256 * hi + lo in fp32, rounded the same way on both paths.
inline __m512 combine(__m512i hi, __m512i lo) {
  return _mm512_fmadd_round_ps(_mm512_cvt_roundepi32_ps(hi, kRound), _mm512_set1_ps(256.0f),
                               _mm512_cvt_roundepi32_ps(lo, kRound), kRound);
}

// Each channel's sum of its weights over K, for TILES channel tiles: what (hi + 128) * w adds, 128 times over.
template <int TILES>
void column_sums(const Problem& p, int64_t tile0, __m512i (&sums)[TILES]) {
  const int64_t quads = p.k / 4;
  const int8_t* w = static_cast<const int8_t*>(p.weight);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int t = 0; t < TILES; ++t) {
    const int8_t* tile = w + (tile0 + t * second_tile(p)) * quads * 64;
    sums[t] = _mm512_setzero_si512();
    for (int64_t j = 0; j < quads; ++j) sums[t] = _mm512_dpbusd_epi32(sums[t], ones, _mm512_loadu_si512(tile + j * 64));
  }
}

// acc += u8 bytes of a x s8 bytes of b, 4 a lane. In place, in asm: GCC 12 keeps an array of intrinsic
// VPDPBUSD accumulators by copying every one each step (and spills two), a 0.76x kernel at 64 rows.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// ROWS rows from row0 x TILES channel tiles with VPDPBUSD: lo * w and (hi + 128) * w, less 128 * sum(w): the
// block's column sums `given` where SUMMED (its row blocks share them), else summed here alongside.
template <int ROWS, int TILES, bool SUMMED = false>
void vnni_block(const Problem& p, const ByteRows& b, int64_t row0, int64_t tile0, const __m512i* given = nullptr) {
  const int64_t quads = p.k / 4;
  const int8_t* w[TILES];
  for (int t = 0; t < TILES; ++t) w[t] = static_cast<const int8_t*>(p.weight) + (tile0 + t * second_tile(p)) * quads * 64;
  const int32_t* lo = reinterpret_cast<const int32_t*>(b.lo.get()) + row0 * quads;  // one int32: 4 inputs' bytes
  const int32_t* hi = reinterpret_cast<const int32_t*>(b.hi.get()) + row0 * quads;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i lo_sum[ROWS][TILES], hi_sum[ROWS][TILES], w_sum[TILES];
  for (int t = 0; t < TILES; ++t) {
    w_sum[t] = _mm512_setzero_si512();
    for (int r = 0; r < ROWS; ++r) lo_sum[r][t] = hi_sum[r][t] = _mm512_setzero_si512();
  }
  for (int64_t j = 0; j < quads; ++j) {
    __m512i wq[TILES];
    for (int t = 0; t < TILES; ++t) {
      if (!SUMMED) prefetch_ahead(w[t] + j * 64);  // else column_sums has just read them
      wq[t] = _mm512_loadu_si512(w[t] + j * 64);
      if (!SUMMED) w_sum[t] = dpbusd(w_sum[t], ones, wq[t]);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512i l = _mm512_set1_epi32(lo[r * quads + j]), h = _mm512_set1_epi32(hi[r * quads + j]);
      for (int t = 0; t < TILES; ++t) {
        lo_sum[r][t] = dpbusd(lo_sum[r][t], l, wq[t]);
        hi_sum[r][t] = dpbusd(hi_sum[r][t], h, wq[t]);
      }
    }
  }
  __m512 acc[ROWS][TILES];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TILES; ++t) {
      const __m512i sums = SUMMED ? given[t] : w_sum[t];
      acc[r][t] = combine(_mm512_sub_epi32(hi_sum[r][t], _mm512_slli_epi32(sums, 7)), lo_sum[r][t]);
    }
  store_rows<ROWS, TILES>(p, row0, tile0, acc, p.scales, b.scale.data());
}

// Blocks of 2 channel tiles (a silu call's: a gate tile and its up tile).
inline int64_t int8_blocks(const Problem& p) { return p.silu ? p.n / kTile / 2 : (p.n / kTile + 1) / 2; }

// A call of ROWS (1-2) rows: the weight streams once, its sums taken on the way.
template <int ROWS>
void vnni_rows(const Problem& p, const ByteRows& b) {
  const int64_t tiles = p.n / kTile, blocks = int8_blocks(p);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      if (p.silu) vnni_block<ROWS, 2>(p, b, 0, blk);
      else if (2 * blk + 1 < tiles) vnni_block<ROWS, 2>(p, b, 0, 2 * blk);
      else vnni_block<ROWS, 1>(p, b, 0, 2 * blk);
    }
  });
}

constexpr int kVnniBlockRows = 6;  // 6 rows x 2 tiles x (lo, hi): 24 accumulators

// Rows [row0, row1) over one block of TILES channel tiles starting at tile0, 4 rows at a time.
template <int TILES>
void vnni_row_blocks(const Problem& p, const ByteRows& b, int64_t tile0, int64_t row0, int64_t row1) {
  __m512i sums[TILES];
  column_sums<TILES>(p, tile0, sums);
  int64_t r = row0;
  for (; r + kVnniBlockRows <= row1; r += kVnniBlockRows) vnni_block<kVnniBlockRows, TILES, true>(p, b, r, tile0, sums);
  switch (row1 - r) {
    case 5: return vnni_block<5, TILES, true>(p, b, r, tile0, sums);
    case 4: return vnni_block<4, TILES, true>(p, b, r, tile0, sums);
    case 3: return vnni_block<3, TILES, true>(p, b, r, tile0, sums);
    case 2: return vnni_block<2, TILES, true>(p, b, r, tile0, sums);
    case 1: return vnni_block<1, TILES, true>(p, b, r, tile0, sums);
    default: return;
  }
}

// Every row count without AMX: chunks of kInt8ChunkRows rows (their bytes stay in L2), each over the thread's
// blocks, whose weights stay in L1 / L2 across the chunk's row blocks.
[[maybe_unused]] void run_int8_vnni(const Problem& p) {
  const ByteRows b = split_bytes(p, true);
  if (p.m == 1) return vnni_rows<1>(p, b);
  if (p.m == 2) return vnni_rows<2>(p, b);
  const int64_t tiles = p.n / kTile;
  at::parallel_for(0, int8_blocks(p), 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = 0; chunk < p.m; chunk += kInt8ChunkRows) {
      const int64_t chunk_end = std::min(p.m, chunk + kInt8ChunkRows);
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t tile0 = p.silu ? blk : 2 * blk;
        if (p.silu || tile0 + 1 < tiles) vnni_row_blocks<2>(p, b, tile0, chunk, chunk_end);
        else vnni_row_blocks<1>(p, b, tile0, chunk, chunk_end);
      }
    }
  });
}

}  // namespace

#endif  // AVX-512-VNNI
