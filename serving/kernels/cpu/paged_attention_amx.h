// The decode loop of paged_attention_bf16.h with its two products on AMX tiles (a bf16 cache in blocks of
// 16, head_dim a multiple of 32 up to 256, up to 16 query heads a KV head).
//
// With one 512-bit FMA port (the AMX Xeon), the dpbf16 loop spends most of a block in VDPBF16PS (192 a block
// for the default model's 3 heads of 64 dims, 0.82 ns each) and in the transposes that put K's keys in lanes.
// Here a block's scores are one tile product a 32 dims: K's rows loaded in place from the cache as the A tile
// (16 keys x 32 dims) against the group's queries, packed once per item as the B tile (dim pairs x heads);
// the next block's scores are issued before this block's softmax, so the tile unit runs while the vector
// units work. The values are one tile product a 16 dims: the probabilities (heads x 16 keys) against the
// block's V rows interleaved in key pairs. The online softmax between them is the dpbf16 loop's own, over
// the score columns gathered into one vector a head. A b64 step's attention (3 KV heads of 64 dims, 256
// tokens each, 30 layers): 19.2 -> 17.1 ms with blocks in order (22 GB/s of KV read; a plain read streams
// 24.8), 26.5 -> 24.5 ms scattered (random 2 KB reads top out at 19.6 GB/s here).
#pragma once

#include <cstring>
#include <memory>

#include "amx_tiles.h"

namespace {

constexpr int kAmxMaxGroup = 16, kAmxMaxDim = 256;

// Tiles: 0 the block's scores (16 keys x 16 heads, fp32), 1 K rows, 2 the queries' B tile, 3 a 16-dim slice
// of the block's values (heads x 16 dims, fp32), 4 V's key pairs for that slice, 5 the probabilities.
inline void configure_decode_tiles(int group) {
  TileConfig config;
  const int rows[6] = {16, 16, 16, group, 8, group}, colsb[6] = {64, 64, 64, 64, 64, 32};
  for (int t = 0; t < 6; ++t) config.rows[t] = static_cast<uint8_t>(rows[t]), config.colsb[t] = static_cast<uint16_t>(colsb[t]);
  load_tile_config(config);
}

inline bool amx_decode_fits(int64_t group, int64_t dim) {
  return group <= kAmxMaxGroup && dim % 32 == 0 && dim <= kAmxMaxDim && amx_allowed();
}

// One thread's buffers, kept from call to call (a fresh 42 KB a call cost a 1-sequence call 10 %); the query
// tiles' columns past the group stay zero.
struct alignas(64) AmxScratch {
  alignas(64) uint32_t queries[kAmxMaxDim / 32][16][16] = {};  // [dim chunk][dim pair][head]
  alignas(64) float scores[2][16][16];                         // [key][head] of this block and the next
  alignas(64) uint32_t values[kAmxMaxDim / 16][8][16];         // [16-dim slice][key pair][dim, unpack order]
  alignas(64) float sums[kAmxMaxGroup * kAmxMaxDim];           // [head][dim, unpack order] of one block
  alignas(64) float acc[kAmxMaxGroup * kAmxMaxDim];
  alignas(64) uint32_t probs[kAmxMaxGroup * 8];                // [head][key pair] bf16 pairs
  int group = 0;  // the group whose columns the queries were last written for
};

// This thread's buffers for a call of `group` query heads a KV head.
inline AmxScratch& amx_scratch(int group) {
  static thread_local std::unique_ptr<AmxScratch> scratch;
  if (!scratch) scratch = std::make_unique<AmxScratch>();
  if (scratch->group > group) std::memset(scratch->queries, 0, sizeof scratch->queries);
  scratch->group = group;
  return *scratch;
}

// Block b's V rows as the B tiles of its 16-dim slices (value_pairs: the dpbf16 loop's pairs and order).
template <int DIM>
inline void pack_values(const uint16_t* v, int rows, AmxScratch& sc) {
  for (int i = 0; i < 8; ++i) {
    for (int c = 0; c < DIM / 32; ++c) {
      __m512i lo, hi;
      value_pairs<DIM>(v, rows, i, c, lo, hi);
      _mm512_store_si512(sc.values[2 * c][i], lo);
      _mm512_store_si512(sc.values[2 * c + 1][i], hi);
    }
  }
}

template <int DIM>
void attend_amx_blocks(const Bf16Item& it, int G, AmxScratch& sc) {
  constexpr int kPairs = DIM / 2;
  for (int c = 0; c < DIM / 32; ++c)
    for (int r = 0; r < 16; ++r)
      for (int g = 0; g < G; ++g) sc.queries[c][r][g] = it.qpairs[g * kPairs + 16 * c + r];
  std::fill(sc.acc, sc.acc + G * DIM, 0.0f);
  float m[kAmxMaxGroup], l[kAmxMaxGroup];
  for (int g = 0; g < G; ++g) m[g] = -FLT_MAX, l[g] = 0.0f;
  const __m512i columns = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(16));
  const BlockWalk<DIM> walk(it);
  const auto scores = [&](int64_t b) {
    const uint16_t* k = walk.k(b);
    tiles_read(k, sc.queries);
    _tile_zero(0);
    for (int c = 0; c < DIM / 32; ++c) {
      _tile_loadd(1, k + 32 * c, DIM * 2);
      _tile_loadd(2, sc.queries[c], 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, sc.scores[b & 1], 64);
  };
  scores(0);
  for (int64_t b = 0; b < walk.blocks; ++b) {
    walk.before(b);
    tiles_read(sc.scores, sc.scores);
    __m512 s[kAmxMaxGroup];
    for (int g = 0; g < G; ++g) s[g] = _mm512_i32gather_ps(columns, &sc.scores[b & 1][0][g], 4);
    if (b + 1 < walk.blocks) scores(b + 1);
    online_step<DIM>(G, s, block_mask(b, it.first, it.length), it.scale, m, l, sc.acc, sc.probs);
    walk.after_scores(b);
    pack_values<DIM>(walk.v(b), walk.rows(b), sc);
    tiles_read(sc.values, sc.probs);
    _tile_loadd(5, sc.probs, 32);
    for (int j = 0; j < DIM / 16; ++j) {
      _tile_zero(3);
      _tile_loadd(4, sc.values[j], 64);
      _tile_dpbf16ps(3, 5, 4);
      _tile_stored(3, sc.sums + 16 * j, DIM * 4);
    }
    tiles_read(sc.sums, sc.sums);
    for (int i = 0; i < G * DIM; i += 16)
      _mm512_store_ps(sc.acc + i, _mm512_add_ps(_mm512_load_ps(sc.acc + i), _mm512_load_ps(sc.sums + i)));
  }
  finish_bf16<DIM>(G, sc.acc, l, it.out);
}

// One (sequence, KV head) on tiles configured by configure_decode_tiles(group).
inline void attend_amx(const Bf16Item& it, int64_t group, int64_t dim, AmxScratch& sc) {
  const int G = static_cast<int>(group);
  switch (dim) {
    case 32: return attend_amx_blocks<32>(it, G, sc);
    case 64: return attend_amx_blocks<64>(it, G, sc);
    case 96: return attend_amx_blocks<96>(it, G, sc);
    case 128: return attend_amx_blocks<128>(it, G, sc);
    case 160: return attend_amx_blocks<160>(it, G, sc);
    case 192: return attend_amx_blocks<192>(it, G, sc);
    case 224: return attend_amx_blocks<224>(it, G, sc);
    default: return attend_amx_blocks<256>(it, G, sc);
  }
}

}  // namespace
