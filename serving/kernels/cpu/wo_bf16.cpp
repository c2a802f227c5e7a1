// Weight-only int8 / int4 linear for CPUs with AVX-512-BF16: y[M, N] = x[M, K] @ dequant(w)[N, K]^T.
//
// torch's CPU kernels for these formats (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) dequantize the
// weight again for every row of x, so past a few rows they fall behind a bf16 GEMM, and a dequantize-then-
// GEMM path writes the whole bf16 weight to memory and reads it back. Here the weight is read from memory
// once per call whatever M is. int16 rows (every call on Intel CPUs without AMX; elsewhere int8 under 24
// rows, int4 under 8): x is rounded to int16 per row and the codes widened to int16 (in registers, or for
// int4 from 8 rows once per 48 channels into an L2 panel), so vpdpwssd sums exact integer products with no
// per-weight float conversion (a float conversion per weight cost more than the bytes it saved). The bf16
// panel (AMD's many-row calls, AMX): blocks of 48 output channels are dequantized once into a bf16 panel
// that stays in L2 and every row of x runs over it with dpbf16 (fp32 accumulators, 8 rows x 48 channels
// in registers). A bf16 weight packed the same way (every bf16 projection of the baseline) runs in place.
// Within a path each row's result depends on that row alone; the path follows the call's row count.
// On CPUs with AMX the panel paths run on AMX-BF16 tiles (wo_bf16_amx.h) and int8 packed in quads on
// AMX-INT8 / VNNI at every row count (wo_bf16_amx_int8.h).
//
// Packed layouts (serving/kernels/cpu/wo_bf16.py builds them; K even, N a multiple of 16):
//   int8: [N/16, K/2, 16, 2] int8: one 32-byte load holds channels n..n+15 at inputs k, k+1; where
//         AMX-INT8 runs, [N/16, K/4, 16, 4] (quads). Per-channel fp32 scales are applied to the fp32
//         accumulators.
//   int4: [N/16, K/8, 32] 16-bit words, four codes (0..15) each, see int4_rows; scales and zeros are the
//         layer's own bf16 [K/g, N, 2]: w = (q - 8) * scale + zero, applied per group to exact sums.
//   bf16: [N/16, K/2, 16, 2] bf16: the int8 layout, read by dpbf16 in place.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "wo_bf16_amx.h"
#include "wo_bf16_amx_int8.h"
#include "wo_bf16_common.h"
#include "wo_bf16_few_rows.h"
#include "wo_bf16_int4_panel.h"

namespace {

// int8: dequantize tiles tile0 + t * second_tile(p), t < tiles, into panel[kp * tiles + t] (32 bf16 each: 16
// channels x 2 inputs): consecutive tiles, or a silu call's gate tile and its up tile.
void dequant_int8(const Problem& p, int64_t tile0, int tiles, __m512i* panel) {
  const int64_t pairs = p.k / 2;
  const int8_t* base = static_cast<const int8_t*>(p.weight);
  for (int t = 0; t < tiles; ++t) {
    const int8_t* src = base + (tile0 + t * second_tile(p)) * pairs * 32;
    for (int64_t kp = 0; kp < pairs; ++kp, src += 32) {
      __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
      __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
      panel[kp * tiles + t] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    }
  }
}

// Weights as bf16 pairs for dpbf16, 32 per zmm (16 channels x 2 inputs): vector (k-pair kp, tile t) at
// base[kp * kp_stride + t * tile_stride]. A dequantized panel interleaves its tiles (kp_stride = tiles,
// tile_stride = 1); a bf16 weight packed tile by tile is read in place (kp_stride = 1, tile_stride = K/2).
struct Panel {
  const __m512i* base;
  int64_t kp_stride, tile_stride;
};

template <int ROWS, int TILES>
void rows_over_panel(const Problem& p, int64_t row0, int64_t tile0, Panel panel) {
  __m512 acc[ROWS][TILES];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TILES; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t pairs = p.k / 2;
  const int32_t* x = reinterpret_cast<const int32_t*>(p.x + row0 * p.k);  // one int32 = inputs k, k+1
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512i w[TILES];
    for (int t = 0; t < TILES; ++t) w[t] = _mm512_loadu_si512(panel.base + kp * panel.kp_stride + t * panel.tile_stride);
    for (int r = 0; r < ROWS; ++r) {
      const __m512i xr = _mm512_set1_epi32(x[r * pairs + kp]);
      for (int t = 0; t < TILES; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)xr, (__m512bh)w[t]);
    }
  }
  store_rows<ROWS, TILES>(p, row0, tile0, acc, p.scales);
}

template <int TILES>
void all_rows(const Problem& p, int64_t row0, int64_t end, int64_t tile0, Panel panel) {
  for (; row0 + kRows <= end; row0 += kRows) rows_over_panel<kRows, TILES>(p, row0, tile0, panel);
  switch (end - row0) {
    case 7: rows_over_panel<7, TILES>(p, row0, tile0, panel); break;
    case 6: rows_over_panel<6, TILES>(p, row0, tile0, panel); break;
    case 5: rows_over_panel<5, TILES>(p, row0, tile0, panel); break;
    case 4: rows_over_panel<4, TILES>(p, row0, tile0, panel); break;
    case 3: rows_over_panel<3, TILES>(p, row0, tile0, panel); break;
    case 2: rows_over_panel<2, TILES>(p, row0, tile0, panel); break;
    case 1: rows_over_panel<1, TILES>(p, row0, tile0, panel); break;
    default: break;
  }
}


// Rows [begin, end) through AMX tiles where it runs (`tail`: the last rows zero-padded to 16), else with
// dpbf16; begin a multiple of 16. On AMX `between()` runs after every tile step (amx_block); elsewhere not at all.
template <class Between = NoWork>
void panel_rows(const Problem& p, int64_t tile0, int count, Panel panel, bool amx, const uint16_t* tail,
                int64_t begin, int64_t end, Between&& between = {}) {
#ifdef QUANTGATE_AMX
  const __m512i* w = panel.base;
  const int64_t kps = panel.kp_stride, ts = panel.tile_stride;
  if (amx && count == 3) return amx_rows_over<3>(p, tail, tile0, w, kps, ts, begin, end, between);
  if (amx && count == 2) return amx_rows_over<2>(p, tail, tile0, w, kps, ts, begin, end, between);
  if (amx) return amx_rows_over<1>(p, tail, tile0, w, kps, ts, begin, end, between);
#else
  (void)between;
#endif
  if (count == 3) all_rows<3>(p, begin, end, tile0, panel);
  else if (count == 2) all_rows<2>(p, begin, end, tile0, panel);
  else all_rows<1>(p, begin, end, tile0, panel);
}

// Whether AMX takes the call, and its zero-padded last rows; each thread configures its tiles for the
// call (`Tiles`) and releases them after.
struct AmxCall {
  static bool takes(const Problem& p) {
#ifdef QUANTGATE_AMX
    return amx_takes(p);
#else
    (void)p;
    return false;
#endif
  }
  explicit AmxCall(const Problem& p) : used(takes(p)) {
#ifdef QUANTGATE_AMX
    if (used) tail = amx_tail(p);
#endif
  }
  bool used;
  std::vector<uint16_t> tail;
};

struct Tiles {
  explicit Tiles(const AmxCall& call) : used(call.used) {
#ifdef QUANTGATE_AMX
    if (used) configure_tiles();
#endif
  }
  ~Tiles() {
#ifdef QUANTGATE_AMX
    if (used) _tile_release();
#endif
  }
  bool used;
};

constexpr int64_t kInt8AmxPanelRows = 24, kInt4AmxPanelRows = 8;  // where AMX takes the call: its panel from here

// Calls with K inputs take the bf16 panel from this many rows (the int16 rows below it).
int64_t panel_rows_from(bool int4, int64_t k) {
  Problem p{};
  p.k = k;
  if (AmxCall::takes(p)) return int4 ? kInt4AmxPanelRows : kInt8AmxPanelRows;
  return int16_rows_below(int4);
}

// Half the L2 of the core a thread runs on (sysconf; 1 MB where it cannot tell): what a chunk of x may take
// beside the panels and the output.
int64_t x_budget_bytes() {
  static const int64_t budget = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? static_cast<int64_t>(l2) / 2 : int64_t{1} << 20;
  }();
  return budget;
}

// Rows per chunk of an int4 call: all of them where x fits the budget (each block dequantized once), else
// kChunkRows where such a chunk fits it (a block dequantized again for every chunk, under the chunk's tile
// steps), else all of them again (K too wide for a chunk: re-reading x per block costs less than the words).
int64_t int4_chunk_rows(const Problem& p) {
  const int64_t budget = x_budget_bytes(), row_bytes = p.k * 2;
  if (p.m * row_bytes <= budget || kChunkRows * row_bytes > budget) return p.m;
  return kChunkRows;
}

#include "wo_bf16_int4_raw.h"  // int4 at decode batches without AMX: the raw codes' panel, scales after the dot products

// Below this many rows an int4 call without AMX takes the raw codes' panel (exact products), from it the rounded
// weight's (the int16 rows below panel_rows_from).
int64_t int4_exact_rows_below(int64_t k) {
  Problem p{};
  p.k = k;
  return AmxCall::takes(p) ? 0 : std::max(kRawRowsBelow, panel_rows_from(true, k));
}

// int4 for many rows where the panel wins: the panel path of int8, the panel holding bf16((q - 8) * scale + zero)
// (Int4Panel): its 8 x 48 register block reuses each weight load for 8 rows, where the per-group sums above need
// twice the accumulators. Two panels per thread: while item i's runs through the tiles, item i + 1's is
// dequantized between its tile steps (on AMX; elsewhere after them), a share of the words at each step. An item
// is one block over one chunk of rows, chunk by chunk as run_bf16 goes (int4_chunk_rows), so a long prefill's x
// stays in L2 across the blocks: each block over all 2048 rows re-read x per block, 0.68-0.84x bf16 at
// SmolLM2's shapes (docs/results/2026-12-06-engine-under-load.md).
void run_int4(const Problem& p) {
  if (p.m < panel_rows_from(true, p.k)) return run_small<true>(p);
  if (int4_raw_takes(p, AmxCall::takes(p))) return run_int4_raw(p);  // wo_bf16_int4_raw.h
  const Blocks blocks(p, kTilesPerBlock);
  const int64_t panel_size = p.k / 2 * kTilesPerBlock, chunk_rows = int4_chunk_rows(p);
  const int64_t chunks = (p.m + chunk_rows - 1) / chunk_rows;
  const AmxCall amx(p);
  at::parallel_for(0, blocks.count(), 1, [&](int64_t begin, int64_t end) {
    __m512i* panels = thread_panel(2 * panel_size);
    const Tiles tile_state(amx);
    const int64_t per_chunk = end - begin, items = chunks * per_chunk;
    const auto block = [&](int64_t i) { return begin + i % per_chunk; };
    Int4Panel next(p);
    next.start(blocks.first(block(0)), blocks.size(block(0)), panels);
    next.finish();
    for (int64_t i = 0; i < items; ++i) {
      const int64_t b = block(i), row0 = i / per_chunk * chunk_rows, row1 = std::min(p.m, row0 + chunk_rows);
      __m512i* panel = panels + i % 2 * panel_size;
      if (i + 1 < items)
        next.start(blocks.first(block(i + 1)), blocks.size(block(i + 1)), panels + (i + 1) % 2 * panel_size);
      const int64_t steps = (row1 - row0 + 15) / 16 * std::max<int64_t>(1, p.k / 32);
      const int64_t share = (next.left() + steps - 1) / steps;
      panel_rows(p, blocks.first(b), blocks.size(b), Panel{panel, blocks.size(b), 1}, amx.used, amx.tail.data(),
                 row0, row1, [&] { next.run(share); });
      next.finish();
    }
  });
}

// A silu call (p.silu) pairs gate tile b with up tile b + N/32 in each block's panel.
void run_int8(const Problem& p) {
  if (p.m < panel_rows_from(false, p.k)) return run_small<false>(p);
  const Blocks blocks(p, kTilesPerBlock);
  const AmxCall amx(p);
  at::parallel_for(0, blocks.count(), 1, [&](int64_t begin, int64_t end) {
    __m512i* panel = thread_panel(p.k / 2 * kTilesPerBlock);
    const Tiles tile_state(amx);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t tile0 = blocks.first(b);
      const int count = blocks.size(b);
      dequant_int8(p, tile0, count, panel);
      panel_rows(p, tile0, count, Panel{panel, count, 1}, amx.used, amx.tail.data(), 0, p.m);
    }
  });
}

// From kWideRows rows a bf16 call on AMX takes 2 channel tiles a block, x streamed past L1: the block's weight
// (K/2 x 32 pairs, 36 KB at K = 576) then stays in L1 for all of a chunk's rows, where 3 tiles (54 KB) were
// re-read from L2 for every 16 rows. 1.05-1.25x at 100-2,048 rows on SmolLM2's shapes, the same or slower
// below (docs/results/2026-12-07-engine-prefill.md); a row's sums are the same at every row count.
constexpr int64_t kWideRows = 96;

// A silu call (p.silu) pairs gate tile b with up tile b + N/32: 2 tiles a block at every row count.
void run_bf16(const Problem& call) {
  Problem p = call;
  const AmxCall amx(p);
  p.stream_x = amx.used && p.m >= kWideRows;
  const Blocks blocks(p, p.stream_x ? 2 : kTilesPerBlock);
  const int64_t pairs = p.k / 2, tile_stride = second_tile(p) * pairs;
  const __m512i* weight = static_cast<const __m512i*>(p.weight);
  at::parallel_for(0, blocks.count(), 1, [&](int64_t begin, int64_t end) {
    const Tiles tile_state(amx);
    for (int64_t row0 = 0; row0 < p.m; row0 += kChunkRows) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t tile0 = blocks.first(b);
        const int count = blocks.size(b);
        panel_rows(p, tile0, count, Panel{weight + tile0 * pairs, 1, tile_stride}, amx.used, amx.tail.data(),
                   row0, std::min(p.m, row0 + kChunkRows));
      }
    }
  });
}

// Whether an int8 weight of K inputs may be packed in quads for the AMX-INT8 path here.
bool amx_int8_ready(int64_t k) {
#ifdef QUANTGATE_AMX_INT8
  return k % 64 == 0 && k <= kAmxQuadsMaxK && amx_allowed();
#else
  (void)k;
  return false;
#endif
}

at::Tensor prepare(const at::Tensor& x, int64_t n, at::ScalarType out_dtype, Problem& p) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "woq linear: x must be a contiguous 2-D bfloat16 tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) % 2 == 0 && n % kTile == 0, "woq linear: needs an even K and N a multiple of 16, got K=",
              x.size(1), " N=", n);
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "woq linear: output must be fp32 or bf16");
  auto out = at::empty({x.size(0), n}, x.options().dtype(out_dtype));
  p.x = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  p.m = x.size(0), p.k = x.size(1), p.n = n;
  p.out = out.data_ptr(), p.out_bf16 = out_dtype == at::kBFloat16;
  return out;
}

// out [M, n_out] and p for an int8 call over `packed` (N = scales' length); whether it is in quads.
bool int8_problem(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n_out,
                  at::ScalarType out_dtype, Problem& p, at::Tensor& out) {
  out = prepare(x, n_out, out_dtype, p);
  p.n = scales.numel();
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.numel() == p.n * p.k,
              "woq_linear_int8: packed weight must be contiguous int8 with N*K elements");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), "woq_linear_int8: fp32 scales");
  p.weight = packed.data_ptr(), p.scales = scales.data_ptr<float>(), p.group_size = 0;
  const bool quads = packed.dim() == 4 && packed.size(3) == 4;
  TORCH_CHECK(!quads || amx_int8_ready(p.k), "woq_linear_int8: a weight packed in quads needs AMX-INT8 (the "
              "amx build) and K a multiple of 64 up to 65536; got K=", p.k);
  return quads;
}

at::Tensor woq_linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           at::ScalarType out_dtype) {
  Problem p{};
  at::Tensor out;
  const bool quads = int8_problem(x, packed, scales, scales.numel(), out_dtype, p, out);
  if (!p.m) return out;
#ifdef QUANTGATE_AMX_INT8
  if (quads) return run_int8_amx(p), out;
#endif
  run_int8(p);
  return out;
}

// out [M, n_out] and p for an int4 call of N = n channels.
at::Tensor int4_problem(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                        int64_t group_size, int64_t n, int64_t n_out, at::ScalarType out_dtype, Problem& p) {
  auto out = prepare(x, n_out, out_dtype, p);
  p.n = n;
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && p.k % group_size == 0,
              "woq_linear_int4: group size ", group_size, " must be a multiple of 8 dividing K=", p.k);
  TORCH_CHECK(packed.scalar_type() == at::kShort && packed.is_contiguous() && packed.numel() == p.n * p.k / 4,
              "woq_linear_int4: packed codes must be contiguous int16 with N*K/4 elements");
  TORCH_CHECK(scales_zeros.scalar_type() == at::kBFloat16 && scales_zeros.is_contiguous() &&
                  scales_zeros.numel() == p.n * (p.k / group_size) * 2,
              "woq_linear_int4: scales and zeros must be contiguous bf16 [K/g, N, 2]");
  p.weight = packed.data_ptr(), p.group_size = group_size;
  p.scale_zero = reinterpret_cast<const uint32_t*>(scales_zeros.data_ptr<at::BFloat16>());
  return out;
}

at::Tensor woq_linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                           int64_t group_size, int64_t n, at::ScalarType out_dtype) {
  Problem p{};
  auto out = int4_problem(x, packed, scales_zeros, group_size, n, n, out_dtype, p);
  if (p.m) run_int4(p);
  return out;
}

// out [M, n_out] and p for a bf16 call over `packed` (N = its tiles x 16).
at::Tensor bf16_problem(const at::Tensor& x, const at::Tensor& packed, int64_t n_out, at::ScalarType out_dtype,
                        Problem& p) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTile && packed.size(3) == 2,
              "woq_linear_bf16: packed weight must be [N/16, K/2, 16, 2], got ", packed.sizes());
  auto out = prepare(x, n_out, out_dtype, p);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.size(1) * 2 == p.k,
              "woq_linear_bf16: packed weight must be contiguous bf16 with K/2 = ", p.k / 2, " pairs");
  p.n = packed.size(0) * kTile, p.weight = packed.data_ptr();
  return out;
}

at::Tensor woq_linear_bf16(const at::Tensor& x, const at::Tensor& packed, at::ScalarType out_dtype) {
  Problem p{};
  auto out = bf16_problem(x, packed, packed.size(0) * kTile, out_dtype, p);
  if (p.m) run_bf16(p);
  return out;
}

}  // namespace

#include "wo_bf16_silu.h"  // the same calls with silu(gate) * up in their epilogue

#ifndef QG_NAMESPACE
#define QG_NAMESPACE quantgate_woq_amx
#endif
#define QG_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)  // expands QG_NAMESPACE before TORCH_LIBRARY pastes it
#define QG_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

QG_LIBRARY(QG_NAMESPACE, m) {
  m.def("woq_linear_bf16(Tensor x, Tensor packed, ScalarType out_dtype) -> Tensor");
  m.def("woq_linear_bf16_silu(Tensor x, Tensor packed, ScalarType out_dtype) -> Tensor");
  m.def("amx_int8_ready(int k) -> bool", &amx_int8_ready);
  m.def("panel_rows_from(bool int4, int k) -> int", &panel_rows_from);
  m.def("int4_exact_rows_below(int k) -> int", &int4_exact_rows_below);
  m.def("woq_linear_int8(Tensor x, Tensor packed, Tensor scales, ScalarType out_dtype) -> Tensor");
  m.def("woq_linear_int8_silu(Tensor x, Tensor packed, Tensor scales, ScalarType out_dtype) -> Tensor");
  m.def("woq_linear_int4_silu(Tensor x, Tensor packed, Tensor scales_zeros, int group_size, int n, "
        "ScalarType out_dtype) -> Tensor");
  m.def("woq_linear_int4(Tensor x, Tensor packed, Tensor scales_zeros, int group_size, int n, "
        "ScalarType out_dtype) -> Tensor");
}

QG_LIBRARY_IMPL(QG_NAMESPACE, CPU, m) {
  m.impl("woq_linear_int8", &woq_linear_int8);
  m.impl("woq_linear_int8_silu", &woq_linear_int8_silu);
  m.impl("woq_linear_int4_silu", &woq_linear_int4_silu);
  m.impl("woq_linear_bf16", &woq_linear_bf16);
  m.impl("woq_linear_bf16_silu", &woq_linear_bf16_silu);
  m.impl("woq_linear_int4", &woq_linear_int4);
}

#endif  // AVX-512-BF16: elsewhere nothing is registered and the layers keep torch's kernels
