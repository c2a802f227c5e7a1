// The W8A8 products on AVX-512 VNNI (w8a8.cpp's `linear_vnni`): x's codes as unsigned bytes (q + 128) times
// the weight packed in quads ([N/16, K/4, 16, 4] int8, wo_bf16.pack_int8(w, 4)), VPDPBUSD summing 64 products
// an instruction into int32; 128 * sum_k w[n, k] (`compensation`, from the packing) takes the +128 back out.
//
// torch's int8 GEMM (oneDNN) packs the weight at every call: past a few rows that costs less than it gains, but at
// a decode batch (16-64 rows) over weights streamed from memory it ran 0.6-1.3x our bf16 kernel (EPYC Zen 4,
// SmolLM2's projections). Here the weight is packed once, at load, and read once per call: 8 rows x 3 tiles of
// int32 accumulators in registers, blocks of 48 output channels across the threads.
// Compiled for AVX-512 VNNI by target attribute, so the one build serves every path; called only where the CPU
// has it (w8a8.py checks, and so does the op).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

namespace vnni {

constexpr int kRows = 8, kTiles = 3, kTile = 16;

inline void store16(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
inline void store16(at::BFloat16* out, __m512 v) {  // round to nearest even, as at::BFloat16 (no NaN here)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(rounded));
}

// What a call reads: codes [M, K] u8, the packed weight, its compensation and scales [N], the rows' scales [M].
template <typename T>
struct Problem {
  const uint8_t* codes;
  const int8_t* packed;
  const int32_t* compensation;
  const float* scales;
  const float* row_scale;
  T* out;
  int64_t m, n, k;
};

// acc += u8 bytes of a x s8 bytes of b, 4 a lane. In asm, through a value: GCC 12 kept an array of intrinsic
// VPDPBUSD accumulators on the stack (and so did an asm on the array's elements), one load and store a product.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

template <int ROWS, int TILES, typename T>
void block(const Problem<T>& p, int64_t row0, int64_t tile0) {
  const int64_t quads = p.k / 4;
  __m512i acc[ROWS][TILES];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TILES; ++t) acc[r][t] = _mm512_setzero_si512();
  const int8_t* w = p.packed + tile0 * quads * 64;
  const uint8_t* x = p.codes + row0 * p.k;
  for (int64_t q = 0; q < quads; ++q) {
    __m512i wv[TILES];
    for (int t = 0; t < TILES; ++t) wv[t] = _mm512_loadu_si512(w + (t * quads + q) * 64);
    for (int r = 0; r < ROWS; ++r) {
      int32_t four;
      __builtin_memcpy(&four, x + r * p.k + 4 * q, 4);
      const __m512i xb = _mm512_set1_epi32(four);
      for (int t = 0; t < TILES; ++t) acc[r][t] = dpbusd(acc[r][t], xb, wv[t]);
    }
  }
  for (int t = 0; t < TILES; ++t) {
    const int64_t c0 = (tile0 + t) * kTile;
    const __m512i comp = _mm512_loadu_si512(p.compensation + c0);
    const __m512 scale = _mm512_loadu_ps(p.scales + c0);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][t], comp));
      const __m512 row = _mm512_set1_ps(p.row_scale[row0 + r]);
      store16(p.out + (row0 + r) * p.n + c0, _mm512_mul_ps(_mm512_mul_ps(sums, row), scale));
    }
  }
}

template <int TILES, typename T>
void all_rows(const Problem<T>& p, int64_t tile0) {
  int64_t row0 = 0;
  for (; row0 + kRows <= p.m; row0 += kRows) block<kRows, TILES>(p, row0, tile0);
  switch (p.m - row0) {
    case 7: block<7, TILES>(p, row0, tile0); break;
    case 6: block<6, TILES>(p, row0, tile0); break;
    case 5: block<5, TILES>(p, row0, tile0); break;
    case 4: block<4, TILES>(p, row0, tile0); break;
    case 3: block<3, TILES>(p, row0, tile0); break;
    case 2: block<2, TILES>(p, row0, tile0); break;
    case 1: block<1, TILES>(p, row0, tile0); break;
    default: break;
  }
}

// Blocks of kTiles tiles (the last may hold fewer) across the threads, every row over each.
template <typename T>
void run(const Problem<T>& p) {
  const int64_t tiles = p.n / kTile, blocks = (tiles + kTiles - 1) / kTiles;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t tile0 = b * kTiles, count = std::min<int64_t>(kTiles, tiles - tile0);
      if (count == 3) all_rows<3>(p, tile0);
      else if (count == 2) all_rows<2>(p, tile0);
      else all_rows<1>(p, tile0);
    }
  });
}

}  // namespace vnni

#pragma GCC pop_options
