// int8 weights in quads ([N/16, K/4, 16, 4]) on AMX-INT8, over x's byte planes as wo_bf16_vnni_int8.h splits
// them (woq.py packs quads where this runs: `int8_width`). More than 2 rows: TDPBUSD summing lo * w and TDPBSSD
// hi * w over 64 inputs a step (a B tile is 16 quads x 16 channels, read in place). 1-2 rows, where tiles padded
// to 16 rows cost more than they save: VPDPBUSD (wo_bf16_vnni_int8.h). The same exact sums either way.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "wo_bf16_amx.h"
#include "wo_bf16_common.h"
#include "wo_bf16_vnni_int8.h"

#define QUANTGATE_AMX_INT8 1

namespace {

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
    case 1: return vnni_rows<1>(p, b);
    case 2: return vnni_rows<2>(p, b);
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
