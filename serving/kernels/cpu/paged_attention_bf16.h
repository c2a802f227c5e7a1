// The AVX-512-BF16 inner loops of paged_attention.cpp for a bf16 cache in blocks of 16 tokens: scores
// of a query group against a transposed block, and the weighted V sum over pairs of token rows.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Blocks are scattered over the cache: ask for the next one while this one is read (the hardware
// prefetcher follows a block's rows, not the jump to the next block).
template <typename T>
inline void prefetch_block(const T* rows, int64_t elements) {
  const char* at = reinterpret_cast<const char*>(rows);
  for (int64_t off = 0; off < elements * static_cast<int64_t>(sizeof(T)); off += 64) _mm_prefetch(at + off, _MM_HINT_T0);
}

// 16x16 transpose of 32-bit lanes: r[i] lane j -> r[j] lane i.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// Scores of the `group` queries against one block of 16 bf16 rows (`k`, row stride `dim`): the block is
// transposed as bf16 pairs, so that lane t of a dot-product accumulator is token t (no horizontal sums).
// `qpairs[g * dim / 2 + j]` holds query g's bf16 pair j; scores land in out[g * stride + t].
inline void block_scores_bf16(const uint16_t* k, int64_t dim, const uint32_t* qpairs, int64_t group,
                              float* out, int64_t stride) {
  __m512 acc[8];
  for (int64_t g = 0; g < group; ++g) acc[g] = _mm512_setzero_ps();
  const int64_t pairs = dim / 2;
  for (int64_t c = 0; c < pairs; c += 16) {
    __m512i cols[16];
    for (int t = 0; t < 16; ++t) cols[t] = _mm512_loadu_si512(k + t * dim + 2 * c);
    transpose16(cols);
    for (int j = 0; j < 16; ++j) {
      const __m512bh kj = (__m512bh)cols[j];
      for (int64_t g = 0; g < group; ++g) {
        const __m512bh qj = (__m512bh)_mm512_set1_epi32(static_cast<int>(qpairs[g * pairs + c + j]));
        acc[g] = _mm512_dpbf16_ps(acc[g], kj, qj);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) _mm512_storeu_ps(out + g * stride, acc[g]);
}

// acc[g] += sum_t w[g][t] * v[t] over one pair of bf16 rows (v0 = token t, v1 = token t + 1), as dot
// products of bf16 pairs. `wpair[g]` holds (w[g][t], w[g][t + 1]) as bf16s. Accumulator lanes come out
// in unpack order (see store_values_bf16).
inline void pair_values_bf16(const uint16_t* v0, const uint16_t* v1, int64_t dim, const uint32_t* wpair,
                             int64_t group, __m512* acc) {
  const int64_t per_g = dim / 16;
  for (int64_t c = 0; c < dim / 32; ++c) {
    const __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
    const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
    for (int64_t g = 0; g < group; ++g) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(wpair[g]));
      acc[g * per_g + 2 * c] = _mm512_dpbf16_ps(acc[g * per_g + 2 * c], lo, w);
      acc[g * per_g + 2 * c + 1] = _mm512_dpbf16_ps(acc[g * per_g + 2 * c + 1], hi, w);
    }
  }
}

// Add the pair accumulators to out[g * dim + d] in dimension order: within each 32-wide chunk, the
// unpacked "lo" lanes hold d = 0-3, 8-11, 16-19, 24-27 and the "hi" lanes d = 4-7, 12-15, 20-23, 28-31.
inline void store_values_bf16(const __m512* acc, int64_t group, int64_t dim, float* out) {
  const int64_t per_g = dim / 16;
  float lanes[16];
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t v = 0; v < per_g; ++v) {
      _mm512_storeu_ps(lanes, acc[g * per_g + v]);
      const int64_t base = (v / 2) * 32 + (v % 2) * 4;
      for (int i = 0; i < 16; ++i) out[g * dim + base + (i / 4) * 8 + i % 4] += lanes[i];
    }
  }
}

// The V pass for bf16 rows in blocks of 16: pairs of tokens through pair_values_bf16, an odd last token
// in fp32. `probs` (unnormalized, fp32) are rounded to bf16 as the matmul path rounds them.
inline void context_values_bf16(const uint16_t* v_cache, const int64_t* table, int64_t head_base, int64_t dim,
                                const float* probs, int64_t stride, int64_t group, int64_t length, float* acc,
                                std::vector<uint16_t>& wbits) {
  wbits.resize(group * stride);
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t t = 0; t < stride; t += 16) {
      const __m512 x = _mm512_loadu_ps(probs + g * stride + t);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wbits.data() + g * stride + t), (__m256i)_mm512_cvtneps_pbh(x));
    }
  }
  __m512 vacc[64];
  for (int64_t i = 0; i < group * dim / 16; ++i) vacc[i] = _mm512_setzero_ps();
  uint32_t wpair[8];
  const int64_t pairs_end = length / 2 * 2;
  for (int64_t t = 0; t < pairs_end; t += 2) {
    const uint16_t* v0 = v_cache + (head_base + table[t / 16] * 16 + t % 16) * dim;
    if (t % 16 == 0 && t + 16 < length) prefetch_block(v_cache + (head_base + table[t / 16 + 1] * 16) * dim, 16 * dim);
    for (int64_t g = 0; g < group; ++g) wpair[g] = reinterpret_cast<const uint32_t*>(wbits.data() + g * stride)[t / 2];
    pair_values_bf16(v0, v0 + dim, dim, wpair, group, vacc);
  }
  std::fill(acc, acc + group * dim, 0.0f);
  store_values_bf16(vacc, group, dim, acc);
  if (length % 2) {
    const int64_t t = length - 1;
    const uint16_t* v = v_cache + (head_base + table[t / 16] * 16 + t % 16) * dim;
    for (int64_t g = 0; g < group; ++g) {
      uint32_t wide = static_cast<uint32_t>(wbits[g * stride + t]) << 16;
      float w;
      std::memcpy(&w, &wide, sizeof(w));
      for (int64_t d = 0; d < dim; ++d) {
        uint32_t vb = static_cast<uint32_t>(v[d]) << 16;
        float vf;
        std::memcpy(&vf, &vb, sizeof(vf));
        acc[g * dim + d] += w * vf;
      }
    }
  }
}

}  // namespace
