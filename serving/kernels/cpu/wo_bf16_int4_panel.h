// int4 codes dequantized into the bf16 panel of wo_bf16.cpp's panel paths, word by word, so the work can be
// handed out in slices: on AMX the next block's panel is dequantized a few words between each tile step of the
// current block (Int4Panel::run as amx_rows_over's `between`), and the vector units and the tile unit work at
// once instead of in turn. A word is 64 bytes of one channel tile's codes: 8 inputs x 16 channels, 4 panel vectors.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "wo_bf16_common.h"

namespace {

// The panel holds bf16((q - 8) * scale + zero) (the weight rounded once to bf16, as a dequantize-then-GEMM
// would): vector (k-pair kp, tile t) at panel[kp * tiles + t], the pairs dpbf16 and AMX-BF16 read.
class Int4Panel {
 public:
  explicit Int4Panel(const Problem& p) : p_(p), table_(int4_value_table()) {
    alignas(64) int16_t order[32];  // cvtne2ps_pbh(hi, lo) gives [lo0..lo15, hi0..hi15]; dpbf16 wants pairs
    for (int i = 0; i < 16; ++i) order[2 * i] = static_cast<int16_t>(i), order[2 * i + 1] = static_cast<int16_t>(16 + i);
    interleave_ = _mm512_load_si512(order);
  }

  // Begin the panel of channel tiles [tile0, tile0 + tiles) in `panel` (a silu call's: gate tile tile0 and its up
  // tile); nothing is dequantized yet.
  void start(int64_t tile0, int tiles, __m512i* panel) {
    tile0_ = tile0, tiles_ = tiles, panel_ = panel, qd_ = 0, t_ = 0, group_end_ = 0, stride_ = second_tile(p_);
    left_ = tiles * (p_.k / 8);
    prefetch_scales(p_, tile0, tiles);
  }

  // Dequantize the next `words` words (input-major: the block's tiles advance together). The loop runs on
  // copies of the members: a panel store (__m512i may alias anything) would otherwise make the compiler reload
  // each of them after every store.
  void run(int64_t words) {
    words = std::min(words, left_);
    left_ -= words;
    const __m512i table = table_, interleave = interleave_;
    const int tiles = tiles_;
    int64_t qd = qd_;
    int t = t_;
    for (; words > 0; --words) {
      if (t == 0 && qd == group_end_) qd_ = qd, load_group();
      word(qd, t, table, interleave, scale_[t], zero_[t]);
      if (++t == tiles) t = 0, ++qd;
    }
    qd_ = qd, t_ = t;
  }

  void finish() { run(left_); }
  int64_t left() const { return left_; }

 private:
  void load_group() {  // the scales and zeros of the group input-quad qd_ lies in, for each tile
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const int64_t g = qd_ * 8 / p_.group_size;
    group_end_ = qd_ + p_.group_size / 8;
    prefetch_scales_ahead(p_, tile0_, tiles_, g);
    for (int t = 0; t < tiles_; ++t) {
      const __m512i pair = _mm512_loadu_si512(p_.scale_zero + g * p_.n + (tile0_ + t * stride_) * kTile);
      scale_[t] = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
      zero_[t] = _mm512_castsi512_ps(_mm512_and_si512(pair, high));
    }
  }

  void word(int64_t qd, int t, __m512i table, __m512i interleave, __m512 scale, __m512 zero) const {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const uint16_t* at = static_cast<const uint16_t*>(p_.weight) + ((tile0_ + t * stride_) * (p_.k / 8) + qd) * 32;
    prefetch_ahead(at);
    const __m512i codes = _mm512_loadu_si512(at);
    __m512i out[4];
    for (int i = 0; i < 4; ++i) {
      const __m512i q = _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4 * i), table);
      const __m512 lo = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(q, 16)), scale, zero);
      const __m512 hi = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(q, high)), scale, zero);
      out[i] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    __m512i* panel = panel_ + qd * 4 * tiles_ + t;
    for (int i = 0; i < 4; ++i) _mm512_store_si512(panel + i * tiles_, out[i]);
  }

  const Problem& p_;
  __m512i table_, interleave_;
  __m512 scale_[kTilesPerBlock], zero_[kTilesPerBlock];
  int64_t tile0_ = 0, qd_ = 0, left_ = 0, group_end_ = 0;  // group_end_: the input-quad the next group starts at
  int64_t stride_ = 1;  // tiles from one panel tile's channels to the next's (a silu call's: gate to up)
  int tiles_ = 0, t_ = 0;
  __m512i* panel_ = nullptr;
};

}  // namespace
