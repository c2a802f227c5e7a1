// The AVX-512-BF16 decode loop of paged_attention.cpp for a bf16 cache in blocks of 16 tokens. One pass
// over a (sequence, KV head)'s context, block by block: the group's scores against the block's K (the
// block transposed as bf16 pairs, so lane t of a score vector is token t), an online softmax (a running
// max and sum per query head, the accumulators rescaled when the max rises), then the weighted V sum of
// the same block. K and V of a block are read back to back, the scores never leave registers, and the
// blocks ahead are prefetched (they are scattered over the cache: the hardware prefetcher follows a block's
// rows, not the jump to the next block): the next two into L1, the sixth ahead into L2, across the end of
// one item into the next. Group and head_dim are template parameters so the score accumulators live in
// registers. paged_attention_amx.h runs the same walk with the two products on AMX tiles.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>

namespace {

// Blocks ahead fetched into L1 (1, 2 and 4 alike on the AMX Xeon), and into L2: with scattered blocks (a
// cache after churn) the L2 fetch six ahead took a b64 step's attention from 30.3 to 26.4 ms (the L1 fetches
// alone leave too few lines in flight); with blocks in order 20.0 -> 19.6 ms.
constexpr int64_t kNearBlocks = 2, kFarBlocks = 6;

constexpr int kBf16Block = 16;

struct Bf16Item {
  const uint16_t* k;        // the layer's cache [kv_heads, slots, dim]
  const uint16_t* v;
  const int64_t* table;     // the span's first block entry
  int64_t head_base;        // kv head * slots
  int64_t first, length;    // attended tokens [first, length), from the span's first block
  const uint32_t* qpairs;   // the group's query rows as bf16 pairs [group][dim / 2]
  float scale;
  uint16_t* out;            // [group][dim] bf16
  const int64_t* next_table = nullptr;  // the thread's next item, whose first blocks are fetched early
  int64_t next_head_base = 0, next_blocks = 0;
};

// always_inline: GCC 12 deleted these fetches, called from a member function, as calls without effect.
#define QG_INLINE __attribute__((always_inline)) inline

// Where an item's blocks lie, and their fetches ahead of the walk.
template <int DIM>
struct BlockWalk {
  static constexpr int64_t kBlockBytes = kBf16Block * DIM * 2;
  const Bf16Item& it;
  int64_t blocks;

  QG_INLINE explicit BlockWalk(const Bf16Item& item) : it(item), blocks((item.length + kBf16Block - 1) / kBf16Block) {
    for (int64_t b = 0; b < std::min(kNearBlocks, blocks); ++b) near(b);
    for (int64_t b = kNearBlocks; b < kFarBlocks; ++b) far(b);
  }
  QG_INLINE const uint16_t* k(int64_t b) const { return it.k + (it.head_base + it.table[b] * kBf16Block) * DIM; }
  QG_INLINE const uint16_t* v(int64_t b) const { return it.v + (it.head_base + it.table[b] * kBf16Block) * DIM; }
  QG_INLINE void near(int64_t b) const {
    prefetch_lines<3>(k(b), kBlockBytes);
    prefetch_lines<3>(v(b), kBlockBytes);
  }
  QG_INLINE void far(int64_t b) const {  // block b of this item, or past its end the next item's
    if (b < blocks) {
      prefetch_lines<2>(k(b), kBlockBytes);
      prefetch_lines<2>(v(b), kBlockBytes);
    } else if (b - blocks < it.next_blocks) {
      const int64_t at = (it.next_head_base + it.next_table[b - blocks] * kBf16Block) * DIM;
      prefetch_lines<2>(it.k + at, kBlockBytes);
      prefetch_lines<2>(it.v + at, kBlockBytes);
    }
  }
  // At block b's start: its successors' K (V follows once the scores are out, see after_scores).
  QG_INLINE void before(int64_t b) const {
    if (b + kNearBlocks < blocks) prefetch_lines<3>(k(b + kNearBlocks), kBlockBytes);
    far(b + kFarBlocks);
  }
  QG_INLINE void after_scores(int64_t b) const {
    if (b + kNearBlocks < blocks) prefetch_lines<3>(v(b + kNearBlocks), kBlockBytes);
  }
  QG_INLINE int rows(int64_t b) const { return static_cast<int>(std::min<int64_t>(it.length - b * kBf16Block, kBf16Block)); }
};

// 16x16 transpose of 32-bit lanes: r[i] lane j -> r[j] lane i.
__attribute__((always_inline)) inline void transpose16(__m512i* r) {
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

// exp(x) on 16 lanes: Cephes' expf (range reduction by ln 2 in two parts, degree-6 polynomial, ~1 ulp);
// inputs are clamped to [-87, 88], so a masked-out lane's -FLT_MAX gives ~1e-38, zeroed by the caller.
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Scores of the G queries against one block of 16 bf16 K rows: s[g] lane t = q_g . k_t. For a small group,
// two accumulator sets (even and odd pair columns) halve the dependency chain of the dot products.
template <int G, int DIM>
inline void block_scores(const uint16_t* k, const uint32_t* qpairs, __m512* s) {
  constexpr int kPairs = DIM / 2;
  __m512 even[G], odd[G];
  for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm512_setzero_ps();
  for (int c = 0; c < kPairs; c += 16) {
    __m512i cols[16];
    for (int t = 0; t < 16; ++t) cols[t] = _mm512_loadu_si512(k + t * DIM + 2 * c);
    transpose16(cols);
    for (int j = 0; j < 16; j += 2) {
      for (int g = 0; g < G; ++g) {
        const __m512i q0 = _mm512_set1_epi32(static_cast<int>(qpairs[g * kPairs + c + j]));
        const __m512i q1 = _mm512_set1_epi32(static_cast<int>(qpairs[g * kPairs + c + j + 1]));
        even[g] = _mm512_dpbf16_ps(even[g], (__m512bh)cols[j], (__m512bh)q0);
        if constexpr (G <= 4) {
          odd[g] = _mm512_dpbf16_ps(odd[g], (__m512bh)cols[j + 1], (__m512bh)q1);
        } else {  // enough chains already; a second set would not fit the 32 registers beside the block
          even[g] = _mm512_dpbf16_ps(even[g], (__m512bh)cols[j + 1], (__m512bh)q1);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) s[g] = _mm512_add_ps(even[g], odd[g]);
}

// The online softmax step for one block: lanes outside `valid` drop out; each head's max and sum move on,
// its accumulators are rescaled when the max rises, and its 16 probabilities (relative to the running max,
// rounded to bf16 as the matmul path rounds them) land in w[g * 8 + i] as pairs (token 2i, 2i + 1).
template <int DIM>
inline void online_step(int G, const __m512* s, __mmask16 valid, float scale, float* m, float* l, float* acc,
                        uint32_t* w) {
  for (int g = 0; g < G; ++g) {
    const __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-FLT_MAX), valid, s[g], _mm512_set1_ps(scale));
    const float peak = _mm512_reduce_max_ps(x);
    if (peak > m[g]) {
      const float corr = m[g] == -FLT_MAX ? 0.0f : std::exp(m[g] - peak);  // the first block: nothing to keep
      l[g] *= corr;
      for (int d = 0; d < DIM; d += 16) {
        _mm512_store_ps(acc + g * DIM + d, _mm512_mul_ps(_mm512_load_ps(acc + g * DIM + d), _mm512_set1_ps(corr)));
      }
      m[g] = peak;
    }
    const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(x, _mm512_set1_ps(m[g]))));
    l[g] += _mm512_reduce_add_ps(p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + g * 8), (__m256i)_mm512_cvtneps_pbh(p));
  }
}

// V rows 2i and 2i + 1 of a block, 32 dims from 32c, interleaved as bf16 pairs (lo: dims 0-3, 8-11, 16-19,
// 24-27 of the chunk; hi: 4-7, 12-15, 20-23, 28-31); a row at or past `rows` reads as zeros, never the slot's
// contents (slots past the context may hold anything).
template <int DIM>
QG_INLINE void value_pairs(const uint16_t* v, int rows, int i, int c, __m512i& lo, __m512i& hi) {
  const __m512i a = 2 * i < rows ? _mm512_loadu_si512(v + 2 * i * DIM + 32 * c) : _mm512_setzero_si512();
  const __m512i b = 2 * i + 1 < rows ? _mm512_loadu_si512(v + (2 * i + 1) * DIM + 32 * c) : _mm512_setzero_si512();
  lo = _mm512_unpacklo_epi16(a, b);
  hi = _mm512_unpackhi_epi16(a, b);
}

// acc[g] += sum_t w[g][t] v[t] over one block's first `rows` V rows: the rows are interleaved as bf16
// pairs once (a missing partner row of an odd count is zero, never read: slots past the context may hold
// anything), then each head runs its dot products over them. Accumulator lanes come out in unpack order:
// within each 32-wide chunk, "lo" holds d = 0-3, 8-11, 16-19, 24-27 and "hi" d = 4-7, 12-15, 20-23, 28-31.
template <int G, int DIM>
inline void block_values(const uint16_t* v, int rows, const uint32_t* w, float* acc) {
  constexpr int kVecs = DIM / 16;  // accumulators per head: lo and hi of each 32-wide chunk
  __m512i pairs[8][kVecs];
  const int npairs = (rows + 1) / 2;
  for (int i = 0; i < npairs; ++i)
    for (int c = 0; c < DIM / 32; ++c) value_pairs<DIM>(v, rows, i, c, pairs[i][2 * c], pairs[i][2 * c + 1]);
  for (int g = 0; g < G; ++g) {
    __m512 r0[kVecs], r1[kVecs];  // even and odd pairs: two chains per accumulator
    for (int j = 0; j < kVecs; ++j) {
      r0[j] = _mm512_load_ps(acc + g * DIM + 16 * j);
      r1[j] = _mm512_setzero_ps();
    }
    int i = 0;
    for (; i + 1 < npairs; i += 2) {
      const __m512bh w0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[g * 8 + i]));
      const __m512bh w1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[g * 8 + i + 1]));
      for (int j = 0; j < kVecs; ++j) {
        r0[j] = _mm512_dpbf16_ps(r0[j], (__m512bh)pairs[i][j], w0);
        r1[j] = _mm512_dpbf16_ps(r1[j], (__m512bh)pairs[i + 1][j], w1);
      }
    }
    if (i < npairs) {
      const __m512bh w0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[g * 8 + i]));
      for (int j = 0; j < kVecs; ++j) r0[j] = _mm512_dpbf16_ps(r0[j], (__m512bh)pairs[i][j], w0);
    }
    for (int j = 0; j < kVecs; ++j) _mm512_store_ps(acc + g * DIM + 16 * j, _mm512_add_ps(r0[j], r1[j]));
  }
}

// out[g] = acc[g] / l[g] as bf16, the accumulators' unpack order put back into dimension order.
template <int DIM>
inline void finish_bf16(int G, const float* acc, const float* l, uint16_t* out) {
  alignas(64) float row[DIM];
  for (int g = 0; g < G; ++g) {
    const float inv = 1.0f / l[g];
    for (int j = 0; j < DIM / 16; ++j) {
      const int base = (j / 2) * 32 + (j % 2) * 4;
      for (int i = 0; i < 16; ++i) row[base + (i / 4) * 8 + i % 4] = acc[g * DIM + 16 * j + i] * inv;
    }
    for (int d = 0; d < DIM; d += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_load_ps(row + d));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * DIM + d), (__m256i)h);
    }
  }
}

// The lanes of block b that hold attended tokens [first, length).
inline __mmask16 block_mask(int64_t b, int64_t first, int64_t length) {
  const int64_t lo = std::max<int64_t>(first - b * kBf16Block, 0);
  const int64_t hi = std::min<int64_t>(length - b * kBf16Block, kBf16Block);
  return static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

template <int G, int DIM>
void attend_bf16_blocks(const Bf16Item& it) {
  alignas(64) float acc[G * DIM] = {};
  float m[G], l[G];
  uint32_t w[G * 8];
  for (int g = 0; g < G; ++g) m[g] = -FLT_MAX, l[g] = 0.0f;
  const BlockWalk<DIM> walk(it);
  for (int64_t b = 0; b < walk.blocks; ++b) {
    walk.before(b);
    __m512 s[G];
    block_scores<G, DIM>(walk.k(b), it.qpairs, s);
    online_step<DIM>(G, s, block_mask(b, it.first, it.length), it.scale, m, l, acc, w);
    walk.after_scores(b);
    block_values<G, DIM>(walk.v(b), walk.rows(b), w, acc);
  }
  finish_bf16<DIM>(G, acc, l, it.out);
}

template <int DIM>
bool attend_bf16_dim(const Bf16Item& it, int64_t group) {
  switch (group) {
    case 1: attend_bf16_blocks<1, DIM>(it); return true;
    case 2: attend_bf16_blocks<2, DIM>(it); return true;
    case 3: attend_bf16_blocks<3, DIM>(it); return true;
    case 4: attend_bf16_blocks<4, DIM>(it); return true;
    case 5: attend_bf16_blocks<5, DIM>(it); return true;
    case 6: attend_bf16_blocks<6, DIM>(it); return true;
    case 7: attend_bf16_blocks<7, DIM>(it); return true;
    case 8: attend_bf16_blocks<8, DIM>(it); return true;
    default: return false;
  }
}

// One (sequence, KV head) through the fused loop; false where the shape has no instance (the caller's
// portable loop serves it): head_dim 32, 64, 96, 128 or 256, up to 8 query heads per KV head.
inline bool attend_bf16(const Bf16Item& it, int64_t group, int64_t dim) {
  switch (dim) {
    case 32: return attend_bf16_dim<32>(it, group);
    case 64: return attend_bf16_dim<64>(it, group);
    case 96: return attend_bf16_dim<96>(it, group);
    case 128: return attend_bf16_dim<128>(it, group);
    case 256: return attend_bf16_dim<256>(it, group);
    default: return false;
  }
}

}  // namespace
