// Weight-only linear over fp32 activations for every x86 CPU: y[M, N] = x[M, K] @ W[N, K]^T, W held as
// fp32, bf16, int8 (per-channel fp32 scales) or int4 (groups along K, bf16 scale and zero each).
//
// Written once against the vector layer (vec.h) and built once per instruction set (avx512, avx2,
// scalar: serving/kernels/cpu/isa.py), each build registering its ops under its own namespace
// (quantgate_wo_<isa>). The weight is read from memory once per call whatever M is: up to kDirectRows rows
// the codes are widened to fp32 in registers and every row multiplies them there; past that each tile of
// 16 output channels is widened once into an fp32 panel [K, 16] (L1/L2) and the rows run over it in
// passes of kRowsPerPass; from kGemmRows (big batches) blocks of tiles are widened into L2 and multiplied by
// torch's fp32 GEMM; from kWideRows (prefill) the weight is widened into one buffer for one GEMM over every
// thread. Never a bf16 matmul: on CPUs without native bf16 that is torch's scalar loop.
//
// Packed layouts ([N/16, ..., 16]: 16 consecutive output channels side by side per input; N % 16 == 0):
//   fp32 / bf16 / int8: [N/16, K, 16], K % 4 == 0
//   int4: [N/16, K/2, 16] bytes, byte (j, c) = q[c, 2j] | q[c, 2j + 1] << 4 (the plain codes, re-tiled);
//         scales and zeros are the layer's own bf16 [K/g, N, 2]: w = (q - 8) * scale + zero.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using qg::F16;

// How far ahead of the weight stream each thread asks for lines. A one-row call spends several cycles per
// cache line widening codes, and the hardware prefetchers of the CPUs measured do not run far enough ahead
// for that: without this a one-row call is bound by memory latency, not bandwidth
// (docs/results/2026-12-03-amx-xeon.md, "AVX2 kernels"). Into L2 (locality 2, prefetcht1), not L1: the
// lines in flight are then not bounded by L1's few fill buffers, and the 16-bit and 8-bit streams read
// faster (docs/results/2026-12-03-amx-xeon-night.md, "prefetch into L2").
constexpr int64_t kPrefetchBytes = 8192;

inline void prefetch_ahead(const void* p, int64_t bytes) {
  const char* ahead = static_cast<const char*>(p) + kPrefetchBytes;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(ahead + b, 0, 2);
}

// Each format streams tile t's weights as fp32 vectors, four consecutive inputs at a time (K % 4 == 0):
// fn(i, w) with w[u] the 16 channels' weights at input i + u.
template <class T, F16 (*Widen)(const T*)>
struct PlainTiles {
  const T* w;
  int64_t k;
  template <class Fn>
  void stream(int64_t t, Fn&& fn) const {
    const T* p = w + t * k * 16;
    for (int64_t i = 0; i < k; i += 4, p += 64) {
      prefetch_ahead(p, 64 * sizeof(T));
      const F16 v[4] = {Widen(p), Widen(p + 16), Widen(p + 32), Widen(p + 48)};
      fn(i, v);
    }
  }
};
using F32Tiles = PlainTiles<float, &F16::load>;
using Bf16Tiles = PlainTiles<uint16_t, &F16::from_bf16>;
using Int8Tiles = PlainTiles<int8_t, &F16::from_i8>;

struct Int4Tiles {
  const uint8_t* w;
  const uint16_t* scales_zeros;  // [K/g, N, 2] bf16
  int64_t k, n, group;           // group % 4 == 0
  const float* x_sums = nullptr;  // [M, K/g]: each row's inputs summed per group (few-row calls)

  // Tile t group by group: codes(i, q, scale, offset) with q[u] the 16 channels' raw codes (0..15) at input
  // i + u and the group's w = q * scale + offset, then group_done(g, scale, offset).
  template <class Codes, class GroupDone>
  void groups(int64_t t, Codes&& codes, GroupDone&& group_done) const {
    prefetch_scales(t + 1);
    const uint8_t* p = w + t * (k / 2) * 16;
    for (int64_t g = 0; g < k / group; ++g) {
      F16 scale, zero;
      F16::from_bf16_pairs(scales_zeros + (g * n + t * 16) * 2, scale, zero);
      const F16 offset = fma(scale, -8.0f, zero);  // (q - 8) * s + z = q * s + (z - 8 s)
      for (int64_t i = g * group; i < (g + 1) * group; i += 4, p += 32) {
        prefetch_ahead(p, 32);
        F16 q[4];
        F16::from_u4(p, q[0], q[1]);
        F16::from_u4(p + 16, q[2], q[3]);
        codes(i, q, scale, offset);
      }
      group_done(g, scale, offset);
    }
  }

  // A tile's scales are one line per group, a row of [K/g, N, 2] apart: asked for all at once, a tile
  // ahead, they arrive together instead of one miss per group.
  void prefetch_scales(int64_t t) const {
    if (t * 16 >= n) return;
    for (int64_t g = 0; g < k / group; ++g) __builtin_prefetch(scales_zeros + (g * n + t * 16) * 2);
  }

  template <class Fn>
  void stream(int64_t t, Fn&& fn) const {
    groups(
        t,
        [&](int64_t i, F16* q, const F16& scale, const F16& offset) {
          for (int u = 0; u < 4; ++u) q[u] = fma(q[u], scale, offset);
          fn(i, q);
        },
        [](int64_t, const F16&, const F16&) {});
  }
};

struct Out {
  float* y;
  int64_t ldy;
  const float* scales;  // per output channel, or nullptr
};

// Rows [row0, row0 + R) of tile t: every weight vector the stream yields, times each row's input. Few
// rows get several accumulator chains each (an FMA's latency would otherwise bound a one-row call).
template <int R, class Tiles>
void rows_of_tile(const Tiles& tiles, int64_t t, const float* x, int64_t k, int64_t row0, const Out& out) {
  constexpr int C = R == 1 ? 4 : (R <= 3 ? 2 : 1);
  F16 acc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = F16::zero();
  const float* xr = x + row0 * k;
  tiles.stream(t, [&](int64_t i, const F16* w) {
    for (int u = 0; u < 4; ++u) {
      // one load per weight vector for all R rows: GCC folded it into each row's FMA, and on AVX2 the 6 x 16
      // block then ran at the load ports' rate (~67 % of the FMA peak on an EPYC Zen 4), not the FMAs'
      F16 wu = w[u];
      if constexpr (R > 1) qg::pin(wu);
      for (int r = 0; r < R; ++r) acc[u % C][r] = fma(wu, xr[r * k + i + u], acc[u % C][r]);
    }
  });
  for (int c = 1; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[0][r] = fma(acc[c][r], 1.0f, acc[0][r]);
  const F16 scale = out.scales ? F16::load(out.scales + t * 16) : F16::bcast(1.0f);
  for (int r = 0; r < R; ++r) mul(acc[0][r], scale).store(out.y + (row0 + r) * out.ldy + t * 16);
}

// Int4, few rows: each group's codes times the inputs, scaled once per group, plus the group's offset times
// the inputs' sum (precomputed per row): sum_i (q_i s + o) x_i = s sum_i q_i x_i + o sum_i x_i. Half the
// vector work of dequantizing every weight first.
template <int R>
void rows_of_tile(const Int4Tiles& tiles, int64_t t, const float* x, int64_t k, int64_t row0, const Out& out) {
  constexpr int C = R == 1 ? 4 : (R <= 3 ? 2 : 1);
  const int64_t groups = k / tiles.group;
  F16 dot[C][R], acc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = F16::zero();
    for (int c = 0; c < C; ++c) dot[c][r] = F16::zero();
  }
  const float* xr = x + row0 * k;
  const float* sums = tiles.x_sums + row0 * groups;
  tiles.groups(
      t,
      [&](int64_t i, const F16* q, const F16&, const F16&) {
        for (int u = 0; u < 4; ++u)
          for (int r = 0; r < R; ++r) dot[u % C][r] = fma(q[u], xr[r * k + i + u], dot[u % C][r]);
      },
      [&](int64_t g, const F16& scale, const F16& offset) {
        for (int r = 0; r < R; ++r) {
          for (int c = 1; c < C; ++c) dot[0][r] = fma(dot[c][r], 1.0f, dot[0][r]), dot[c][r] = F16::zero();
          acc[r] = fma(offset, sums[r * groups + g], fma(dot[0][r], scale, acc[r]));
          dot[0][r] = F16::zero();
        }
      });
  for (int r = 0; r < R; ++r) acc[r].store(out.y + (row0 + r) * out.ldy + t * 16);
}

// Every pass after the first over an fp32 panel [K, 16] (an fp32 weight's own tile, or one widened into
// L1/L2), one input per iteration: its 16 weights loaded once into registers for every row. Through the
// stream's steps of four inputs GCC hoisted the next inputs' weights on AVX2 (16 registers) and spilled
// accumulators to the stack, each row's FMA chain then running through a store and a reload.
template <int R>
void rows_of_panel(const float* w, int64_t k, const float* x, int64_t ldx, int64_t row0, const Out& out) {
  F16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = F16::zero();
  const float* xr = x + row0 * ldx;
  for (int64_t i = 0; i < k; ++i) {
    F16 wi = F16::load(w + i * 16);
    qg::pin(wi);
    for (int r = 0; r < R; ++r) acc[r] = fma(wi, xr[r * ldx + i], acc[r]);
  }
  const F16 scale = out.scales ? F16::load(out.scales) : F16::bcast(1.0f);
  for (int r = 0; r < R; ++r) mul(acc[r], scale).store(out.y + (row0 + r) * out.ldy);
}

template <int R, class Tiles>
bool rows_if(int64_t left, const Tiles& tiles, int64_t t, const float* x, int64_t k, int64_t row0,
             const Out& out) {
  if (left != R) return false;
  rows_of_tile<R>(tiles, t, x, k, row0, out);
  return true;
}

// All rows [0, m) of tile t, kRowsPerPass at a time, then the rest in one pass.
template <class Tiles>
void all_rows(const Tiles& tiles, int64_t t, const float* x, int64_t k, int64_t m, const Out& out) {
  constexpr int P = F16::kRowsPerPass;
  int64_t row0 = 0;
  if constexpr (std::is_same_v<Tiles, F32Tiles> && F16::kPanelByInput) {
    if (m >= 2 * P) {  // the first pass streams the panel in (prefetching); the others find it in cache
      rows_of_tile<P>(tiles, t, x, k, 0, out);
      const Out tile_out{out.y + t * 16, out.ldy, out.scales ? out.scales + t * 16 : nullptr};
      for (row0 = P; row0 + P <= m; row0 += P) rows_of_panel<P>(tiles.w + t * k * 16, k, x, k, row0, tile_out);
    }
  }
  for (; row0 + P <= m; row0 += P) rows_of_tile<P>(tiles, t, x, k, row0, out);
  const int64_t left = m - row0;
  rows_if<1>(left, tiles, t, x, k, row0, out) || rows_if<2>(left, tiles, t, x, k, row0, out) ||
      rows_if<3>(left, tiles, t, x, k, row0, out) || rows_if<4>(left, tiles, t, x, k, row0, out) ||
      rows_if<5>(left, tiles, t, x, k, row0, out) || rows_if<6>(left, tiles, t, x, k, row0, out) ||
      rows_if<7>(left, tiles, t, x, k, row0, out) || rows_if<8>(left, tiles, t, x, k, row0, out) ||
      rows_if<9>(left, tiles, t, x, k, row0, out) || rows_if<10>(left, tiles, t, x, k, row0, out) ||
      rows_if<11>(left, tiles, t, x, k, row0, out);
}

// Few rows: straight from the packed weight. More: each tile widened once into an fp32 panel first.
template <class Tiles>
void run_tiles(const Tiles& tiles, bool widen, const float* x, int64_t m, int64_t k, int64_t n, const Out& out) {
  const int64_t count = n / 16;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    if (!widen || m <= F16::kDirectRows) {
      for (int64_t t = begin; t < end; ++t) all_rows(tiles, t, x, k, m, out);
      return;
    }
    std::vector<float> panel(static_cast<size_t>(k) * 16);
    const F32Tiles widened{panel.data(), k};
    for (int64_t t = begin; t < end; ++t) {
      tiles.stream(t, [&](int64_t i, const F16* w) {
        for (int u = 0; u < 4; ++u) w[u].store(panel.data() + (i + u) * 16);
      });
      const Out tile_out{out.y + t * 16, out.ldy, out.scales ? out.scales + t * 16 : nullptr};
      all_rows(widened, 0, x, k, m, tile_out);  // the panel is tile 0 of its own, written at column t * 16
    }
  });
}

// Widens tile t (times its channels' scales, if any) into 16 columns of an fp32 [K, ld] panel.
template <class Tiles>
void widen_tile(const Tiles& tiles, int64_t t, const float* scales, float* column, int64_t ld) {
  const F16 scale = scales ? F16::load(scales + t * 16) : F16::bcast(1.0f);
  tiles.stream(t, [&](int64_t i, const F16* w) {
    for (int u = 0; u < 4; ++u) mul(w[u], scale).store(column + (i + u) * ld);
  });
}

// Many rows (big decode batches): blocks of kGemmTiles tiles widened (and scaled) into an fp32 [K, 16 * tiles]
// panel in L2, each multiplied by torch's GEMM (MKL/oneDNN, at the CPU's best width: a compute-bound call
// gains nothing from our own micro-kernel) into its columns of y. The weight is still read once per call.
constexpr int64_t kGemmTiles = 8;

template <class Tiles>
void run_gemm(const Tiles& tiles, const at::Tensor& x, at::Tensor& y, const float* scales) {
  const int64_t k = x.size(1), count = y.size(1) / 16;
  const int64_t blocks = (count + kGemmTiles - 1) / kGemmTiles;
  const bool inference = y.is_inference();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode mode(inference);  // thread-local: the caller's, so y may be written in place
    std::vector<float> panel(static_cast<size_t>(k) * kGemmTiles * 16);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t t0 = b * kGemmTiles, tiles_here = std::min(kGemmTiles, count - t0), width = tiles_here * 16;
      for (int64_t t = t0; t < t0 + tiles_here; ++t) widen_tile(tiles, t, scales, panel.data() + (t - t0) * 16, width);
      at::Tensor out = y.narrow(1, t0 * 16, width);
      at::mm_out(out, x, at::from_blob(panel.data(), {k, width}, x.options()));
    }
  });
}

// Prefill (kWideRows rows and more): blocks of 128 columns, one GEMM per thread each, re-read all of x
// per block and fall further behind one whole GEMM the more rows there are
// (docs/results/2026-12-04-amx-xeon.md). Here the weight is widened into one fp32 [K, C] buffer (C columns
// at a time, at most kWideFloats), and each buffer is one GEMM over every thread. The buffer is kept per
// calling thread: a fresh one would be page-faulted in on every call.
constexpr int64_t kWideRows = 256;  // below it the blocks are as fast or faster (same page)
constexpr int64_t kWideFloats = int64_t{4} << 20;  // 16 MiB

// One per calling thread, shared by every weight format.
float* wide_buffer(int64_t floats) {
  static thread_local std::vector<float> buffer;
  if (buffer.size() < static_cast<size_t>(floats)) buffer.resize(static_cast<size_t>(floats));
  return buffer.data();
}

template <class Tiles>
void run_wide(const Tiles& tiles, const at::Tensor& x, at::Tensor& y, const float* scales) {
  const int64_t k = x.size(1), count = y.size(1) / 16;
  const int64_t chunk = std::max<int64_t>(1, std::min(count, kWideFloats / (k * 16)));  // tiles per GEMM
  float* panel = wide_buffer(k * chunk * 16);
  for (int64_t t0 = 0; t0 < count; t0 += chunk) {
    const int64_t tiles_here = std::min(chunk, count - t0), width = tiles_here * 16;
    at::parallel_for(0, tiles_here, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) widen_tile(tiles, t0 + t, scales, panel + t * 16, width);
    });
    at::Tensor out = y.narrow(1, t0 * 16, width);
    at::mm_out(out, x, at::from_blob(panel, {k, width}, x.options()));
  }
}

// From how many rows torch's GEMM takes over (run_gemm, run_wide): the defaults suit MKL on Intel CPUs.
// torch's fp32 GEMM is MKL's, which on AMD CPUs runs slower than our panel (EPYC Zen 4: 1.2-2.2x at 48-1024
// rows for avx512, 1.0-1.2x for avx2); wo_fp32.py moves these once, at load, per CPU.
struct TorchGemmRows {
  int64_t blocks = F16::kGemmRows;
  int64_t wide = kWideRows;
};
TorchGemmRows torch_gemm_rows;

// Returns the rows it replaces (so a test can put them back).
std::vector<int64_t> use_torch_gemm_from(int64_t blocks, int64_t wide) {
  TORCH_CHECK(blocks > F16::kDirectRows && wide > F16::kDirectRows, "use_torch_gemm_from: rows must exceed ",
              F16::kDirectRows);
  const TorchGemmRows before = torch_gemm_rows;
  torch_gemm_rows = {blocks, wide};
  return {before.blocks, before.wide};
}

template <class Tiles>
void run(const Tiles& tiles, bool widen, const at::Tensor& x, at::Tensor& y, const float* scales) {
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1);
  if (m >= torch_gemm_rows.wide) return run_wide(tiles, x, y, scales);
  if (m >= torch_gemm_rows.blocks) return run_gemm(tiles, x, y, scales);
  run_tiles(tiles, widen, x.data_ptr<float>(), m, k, n, {y.data_ptr<float>(), n, scales});
}

at::Tensor checked_input(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(k % 4 == 0, "wo_linear: K must be a multiple of 4, got ", k);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "wo_linear: x must be a contiguous [M, K] float32 tensor");
  TORCH_CHECK(x.size(1) == k, "wo_linear: x has ", x.size(1), " inputs, the weight ", k);
  return x;
}

at::Tensor output(const at::Tensor& x, int64_t n) { return at::empty({x.size(0), n}, x.options()); }

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 16 && w.scalar_type() == at::kFloat && w.is_contiguous());
  const int64_t k = w.size(1), n = w.size(0) * 16;
  checked_input(x, k);
  at::Tensor y = output(x, n);
  run(F32Tiles{w.data_ptr<float>(), k}, false, x, y, nullptr);
  return y;
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 16 && w.scalar_type() == at::kBFloat16 && w.is_contiguous());
  const int64_t k = w.size(1), n = w.size(0) * 16;
  checked_input(x, k);
  at::Tensor y = output(x, n);
  const auto* p = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  run(Bf16Tiles{p, k}, true, x, y, nullptr);
  return y;
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 16 && w.scalar_type() == at::kChar && w.is_contiguous());
  const int64_t k = w.size(1), n = w.size(0) * 16;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n,
              "wo_linear_int8: scales must be [N] float32");
  checked_input(x, k);
  at::Tensor y = output(x, n);
  run(Int8Tiles{w.data_ptr<int8_t>(), k}, true, x, y, scales.data_ptr<float>());
  return y;
}

// Each row's inputs summed per group of `group`: [M, K/g].
std::vector<float> group_sums(const at::Tensor& x, int64_t group) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / group;
  const float* xp = x.data_ptr<float>();
  std::vector<float> sums(static_cast<size_t>(m * groups));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float total = 0.0f;  // in a register: summing into the vector would be a store-load chain
      for (int64_t i = g * group; i < (g + 1) * group; ++i) total += xp[r * k + i];
      sums[r * groups + g] = total;
    }
  return sums;
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales_zeros, int64_t group) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 16 && w.scalar_type() == at::kByte && w.is_contiguous());
  const int64_t k = w.size(1) * 2, n = w.size(0) * 16;
  TORCH_CHECK(group > 0 && group % 4 == 0 && k % group == 0, "wo_linear_int4: group ", group, " does not fit K ", k);
  TORCH_CHECK(scales_zeros.scalar_type() == at::kBFloat16 && scales_zeros.is_contiguous() &&
                  scales_zeros.dim() == 3 && scales_zeros.size(0) == k / group && scales_zeros.size(1) == n &&
                  scales_zeros.size(2) == 2,
              "wo_linear_int4: scales_zeros must be [K/g, N, 2] bfloat16");
  checked_input(x, k);
  at::Tensor y = output(x, n);
  const auto* sz = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr<at::BFloat16>());
  Int4Tiles tiles{w.data_ptr<uint8_t>(), sz, k, n, group};
  std::vector<float> sums;
  if (x.size(0) <= F16::kDirectRows) {
    sums = group_sums(x, group);
    tiles.x_sums = sums.data();
  }
  run(tiles, true, x, y, nullptr);
  return y;
}

std::string isa_name() { return qg::kIsaName; }

}  // namespace

#ifndef QG_NAMESPACE
#define QG_NAMESPACE quantgate_wo_scalar
#endif
#define QG_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)  // expands QG_NAMESPACE before TORCH_LIBRARY pastes it

QG_LIBRARY(QG_NAMESPACE, m) {
  m.def("linear_f32(Tensor x, Tensor w) -> Tensor", &linear_f32);
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor", &linear_bf16);
  m.def("linear_int8(Tensor x, Tensor w, Tensor scales) -> Tensor", &linear_int8);
  m.def("linear_int4(Tensor x, Tensor w, Tensor scales_zeros, int group) -> Tensor", &linear_int4);
  m.def("isa() -> str", &isa_name);
  m.def("use_torch_gemm_from(int blocks, int wide) -> int[]", &use_torch_gemm_from);
}
