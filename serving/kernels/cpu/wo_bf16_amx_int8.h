// int8 weights in quads ([N/16, K/4, 16, 4]), where the CPU has AMX-INT8 (woq.py
// packs them so there: `int8_width`): the int16 few-row path's exact integer sums without its per-weight
// widening. Each row of x is rounded to int16 as there (split_rows: round_rows' ops) and split into bytes,
// x16 = 256 * hi + lo (lo unsigned). More than 2 rows: AMX tiles, TDPBUSD summing lo * w and TDPBSSD hi * w over 64
// inputs a step (a B tile is 16 quads x 16 channels, read in place). 1-2 rows, where tiles padded to
// 16 rows cost more than they save: VPDPBUSD over the same quads, hi taken unsigned (hi + 128) and
// 128 * sum(w) taken off again. Both sums are exact in int32 (|lo * w| <= 255 * 127, K up to 65 536) and
// combined alike, so a row's result is the same on either path, at any batch size.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "wo_bf16_amx.h"
#include "wo_bf16_common.h"

#define QUANTGATE_AMX_INT8 1

namespace {

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
  const int64_t padded = (p.m + kAmxRows - 1) / kAmxRows * kAmxRows;
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

// One block's tile sums as they leave the tiles. Their conversion into y (Int8Epilogue) is left to the next
// block's tile steps: the vector units convert while the tile unit multiplies, where a block converting its own
// sums left the tile unit idle (at K = 576 a 16 x 32 block's products take ~300 cycles, its conversion ~100).
struct Int8Sums {
  alignas(64) int32_t lo[2][kAmxRows][kTile];
  alignas(64) int32_t hi[2][kAmxRows][kTile];
  int64_t row0 = 0, tile0 = 0;
  int valid = 0, tiles = 0;
};

class Int8Epilogue {
 public:
  Int8Epilogue(const Problem& p, const float* row_scale) : p_(p), row_scale_(row_scale) {}

  void start(const Int8Sums* sums) { sums_ = sums, next_ = 0; }
  int left() const { return sums_ ? sums_->valid - next_ : 0; }
  void finish() { run(left()); }

  void run(int rows) {  // the next `rows` rows of the pending block into y
    for (const int end = std::min(next_ + rows, sums_ ? sums_->valid : 0); next_ < end; ++next_) {
      if (sums_->tiles == 2) row<2>(next_);
      else row<1>(next_);
    }
  }

 private:
  template <int TILES>
  void row(int r) {
    __m512 acc[1][TILES];
    for (int t = 0; t < TILES; ++t)
      acc[0][t] = combine(_mm512_load_si512(sums_->hi[t][r]), _mm512_load_si512(sums_->lo[t][r]));
    store_rows<1, TILES>(p_, sums_->row0 + r, sums_->tile0, acc, p_.scales, row_scale_);
  }

  const Problem& p_;
  const float* row_scale_;
  const Int8Sums* sums_ = nullptr;
  int next_ = 0;
};

// Rows [row0, row0 + 16) of the byte planes x channel tiles [tile0, tile0 + TILES) into `out` (the first `valid`
// rows count), `between()` after each tile step. Tiles 0-1: lo sums, 2-3: hi sums, 4-5: x's bytes, 6-7: the weight.
template <int TILES, class Between>
void amx_int8_block(const Problem& p, const ByteRows& b, int64_t row0, int valid, int64_t tile0, Int8Sums& out,
                    Between&& between) {
  const int64_t quads = p.k / 4;
  const int8_t* w = static_cast<const int8_t*>(p.weight);
  tiles_read(b.lo.get(), b.hi.get());
  _tile_zero(0);
  _tile_zero(2);
  if (TILES > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t q0 = 0; q0 < quads; q0 += kAmxRows) {
    _tile_loadd(4, b.lo.get() + row0 * p.k + q0 * 4, p.k);
    _tile_loadd(5, b.hi.get() + row0 * p.k + q0 * 4, p.k);
    _tile_loadd(6, w + (tile0 * quads + q0) * 64, 64);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbssd(2, 5, 6);
    if (TILES > 1) {
      _tile_loadd(7, w + ((tile0 + second_tile(p)) * quads + q0) * 64, 64);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbssd(3, 5, 7);
    }
    between();
  }
  _tile_stored(0, out.lo[0], 64);
  _tile_stored(2, out.hi[0], 64);
  if (TILES > 1) {
    _tile_stored(1, out.lo[1], 64);
    _tile_stored(3, out.hi[1], 64);
  }
  out.row0 = row0, out.tile0 = tile0, out.valid = valid, out.tiles = TILES;
}

// ROWS rows x TILES channel tiles with VPDPBUSD: lo * w and (hi + 128) * w, and sum(w) to take 128 of.
template <int ROWS, int TILES>
void vnni_block(const Problem& p, const ByteRows& b, const float* row_scale, int64_t tile0) {
  const int64_t quads = p.k / 4;
  const int8_t* w = static_cast<const int8_t*>(p.weight);
  const int32_t* lo = reinterpret_cast<const int32_t*>(b.lo.get());  // one int32: x's bytes at 4 inputs
  const int32_t* hi = reinterpret_cast<const int32_t*>(b.hi.get());
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i lo_sum[ROWS][TILES], hi_sum[ROWS][TILES], w_sum[TILES];
  for (int t = 0; t < TILES; ++t) {
    w_sum[t] = _mm512_setzero_si512();
    for (int r = 0; r < ROWS; ++r) lo_sum[r][t] = hi_sum[r][t] = _mm512_setzero_si512();
  }
  for (int64_t j = 0; j < quads; ++j) {
    __m512i wq[TILES];
    for (int t = 0; t < TILES; ++t) {
      const int64_t tile = tile0 + t * second_tile(p);
      prefetch_ahead(w + (tile * quads + j) * 64);
      wq[t] = _mm512_loadu_si512(w + (tile * quads + j) * 64);
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

// Blocks of 2 channel tiles (a silu call's: a gate tile and its up tile).
inline int64_t int8_blocks(const Problem& p) { return p.silu ? p.n / kTile / 2 : (p.n / kTile + 1) / 2; }

template <int ROWS>
void vnni_rows(const Problem& p, const ByteRows& b, const float* row_scale) {
  const int64_t tiles = p.n / kTile, blocks = int8_blocks(p);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      if (p.silu) vnni_block<ROWS, 2>(p, b, row_scale, blk);
      else if (2 * blk + 1 < tiles) vnni_block<ROWS, 2>(p, b, row_scale, 2 * blk);
      else vnni_block<ROWS, 1>(p, b, row_scale, 2 * blk);
    }
  });
}

// Blocks of 16 rows x 32 channels one after the other, each converting the previous one's sums between its
// tile steps (Int8Epilogue): the same sums and the same conversion as one block at a time, in another order.
void amx_int8_blocks(const Problem& p, const ByteRows& b, int64_t begin, int64_t end) {
  const int64_t tiles = p.n / kTile, steps = p.k / 4 / kAmxRows;
  Int8Sums sums[2];
  Int8Epilogue pending(p, b.scale.data());
  int64_t count = 0;
  for (int64_t chunk = 0; chunk < p.m; chunk += kInt8ChunkRows) {  // x's bytes stay in L2 across blocks
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t tile0 = p.silu ? blk : blk * 2;
      for (int64_t row0 = chunk; row0 < std::min(p.m, chunk + kInt8ChunkRows); row0 += kAmxRows) {
        const int valid = static_cast<int>(std::min<int64_t>(kAmxRows, p.m - row0));
        Int8Sums& out = sums[count++ % 2];
        const int share = static_cast<int>((pending.left() + steps - 1) / steps);
        const auto convert = [&] { pending.run(share); };
        if (p.silu || tile0 + 1 < tiles) amx_int8_block<2>(p, b, row0, valid, tile0, out, convert);
        else amx_int8_block<1>(p, b, row0, valid, tile0, out, convert);
        pending.finish();
        pending.start(&out);
      }
    }
  }
  pending.finish();
}

void run_int8_amx(const Problem& p) {
  const ByteRows b = split_bytes(p, p.m <= kVnniMaxRows);
  switch (p.m) {
    case 1: return vnni_rows<1>(p, b, b.scale.data());
    case 2: return vnni_rows<2>(p, b, b.scale.data());
    default: break;
  }
  at::parallel_for(0, int8_blocks(p), 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    amx_int8_blocks(p, b, begin, end);
    _tile_release();
  });
}

}  // namespace

#endif  // AMX-INT8
