// W8A8 linear: y[M, N] = (x[M, K] / smooth) @ w[N, K]^T with int8 weights (one scale per output channel) and
// int8 activations (one scale per row, chosen at each call from the row's largest magnitude).
//
// At the batches a server runs (16+ rows) a weight-only GEMM on a CPU is compute-bound: its int8 or int4
// weights are widened to bf16 or int16 and multiplied at the bf16 rate. With int8 on both sides the products
// run on VPDPBUSD / AMX-INT8 (64 per instruction, twice VDPBF16PS's). Two ops, each one call per projection
// (what a decode step's plan, decode_step.cpp, calls): `linear_vnni` (and `linear_vnni_bf16`, wo_bf16's calling
// convention) over the weight packed once in quads, on our VNNI loop (w8a8_vnni.h); `linear` elsewhere, through
// torch's int8 GEMM (oneDNN, `at::_int_mm`, reading the [N, K] weight in place as its transpose). Both share the
// rows' quantization (times the layer's SmoothQuant 1 / smooth, folded into one pass); `linear` adds the
// epilogue _int_mm lacks (int32 sums times the row's and the channel's scales, in the rows' dtype).
//
// Rounding is to nearest even, as torch.round: the tests rebuild every code and sum exactly in Python.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "w8a8_vnni.h"

#include <algorithm>
#include <utility>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: (v + m) - m rounds |v| < 2^22 to nearest even
constexpr int64_t kSerialBelow = 1 << 16;   // elements a call's own passes handle on one thread (no wake-up)

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

#if defined(__AVX2__)
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const at::BFloat16* x) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline void store8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline void store8(at::BFloat16* out, __m256 v) {  // round to nearest even, as at::BFloat16 does (no NaN here)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
}
#endif

// Row r of x times inv_smooth into `scaled`; returns the row's scale (largest magnitude / 127).
template <typename T>
float scaled_row(const T* x, const float* inv_smooth, int64_t k, float* scaled) {
  float peak = 0.0f;
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 peaks = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) {
    const __m256 v = _mm256_mul_ps(load8(x + i), _mm256_loadu_ps(inv_smooth + i));
    _mm256_storeu_ps(scaled + i, v);
    peaks = _mm256_max_ps(peaks, _mm256_andnot_ps(sign, v));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, peaks);
  for (float lane : lanes) peak = std::max(peak, lane);
#endif
  for (; i < k; ++i) {
    scaled[i] = to_float(x[i]) * inv_smooth[i];
    peak = std::max(peak, std::fabs(scaled[i]));
  }
  return peak / 127.0f;
}

// The row's codes, or with `flip` as unsigned bytes q + 128 (the top bit flipped: VPDPBUSD's unsigned operand).
void codes_of(const float* scaled, float inv, int64_t k, bool flip, int8_t* out) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 scale = _mm256_set1_ps(inv);
  // cvtps rounds to nearest even (the default MXCSR mode); |scaled * inv| <= 127 by the row's scale, so the
  // saturating packs never clamp
  for (; i + 16 <= k; i += 16) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(scaled + i), scale));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(scaled + i + 8), scale));
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // 16 int16 in order
    const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm_xor_si128(bytes, _mm_set1_epi8(flip ? -128 : 0)));
  }
#endif
  for (; i < k; ++i) {
    const float v = std::min(127.0f, std::max(-127.0f, (scaled[i] * inv + kRoundMagic) - kRoundMagic));
    out[i] = static_cast<int8_t>(static_cast<int32_t>(v) ^ (flip ? 0x80 : 0));
  }
}

template <typename T>
void quantize_rows(const T* x, const float* inv_smooth, int64_t m, int64_t k, bool flip, int8_t* codes,
                   float* row_scale) {
  at::parallel_for(0, m, std::max<int64_t>(1, kSerialBelow / k), [&](int64_t begin, int64_t end) {
    std::vector<float> scaled(static_cast<size_t>(k));
    for (int64_t r = begin; r < end; ++r) {
      const float scale = scaled_row(x + r * k, inv_smooth, k, scaled.data());
      codes_of(scaled.data(), scale > 0.0f ? 1.0f / scale : 0.0f, k, flip, codes + r * k);
      row_scale[r] = scale;
    }
  });
}

template <typename T>
void scale_sums(const int32_t* sums, const float* row_scale, const float* scales, int64_t m, int64_t n, T* out) {
  at::parallel_for(0, m, std::max<int64_t>(1, kSerialBelow / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* row_sums = sums + r * n;
      T* row_out = out + r * n;
      int64_t c = 0;
#if defined(__AVX2__)
      const __m256 row = _mm256_set1_ps(row_scale[r]);
      for (; c + 8 <= n; c += 8) {
        const __m256 sum = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_sums + c)));
        store8(row_out + c, _mm256_mul_ps(_mm256_mul_ps(sum, row), _mm256_loadu_ps(scales + c)));
      }
#endif
      for (; c < n; ++c) row_out[c] = static_cast<T>(static_cast<float>(row_sums[c]) * row_scale[r] * scales[c]);
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& scales, const at::Tensor& inv_smooth, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "w8a8_linear: x must be contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "w8a8_linear: x must be fp32 or bf16");
  TORCH_CHECK(scales.numel() == n && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "w8a8_linear: scales must be fp32 [N]");
  TORCH_CHECK(inv_smooth.numel() == x.size(1) && inv_smooth.scalar_type() == at::kFloat && inv_smooth.is_contiguous(),
              "w8a8_linear: inv_smooth must be fp32 [K]");
}

// The rows' codes [M, K] (unsigned with `flip`) and scales [M].
std::pair<at::Tensor, at::Tensor> quantized(const at::Tensor& x, const at::Tensor& inv_smooth, bool flip) {
  const int64_t m = x.size(0), k = x.size(1);
  auto codes = at::empty({m, k}, x.options().dtype(at::kChar));
  auto row_scale = at::empty({m}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat)
    quantize_rows(x.data_ptr<float>(), inv_smooth.data_ptr<float>(), m, k, flip, codes.data_ptr<int8_t>(),
                  row_scale.data_ptr<float>());
  else
    quantize_rows(x.data_ptr<at::BFloat16>(), inv_smooth.data_ptr<float>(), m, k, flip, codes.data_ptr<int8_t>(),
                  row_scale.data_ptr<float>());
  return {codes, row_scale};
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const at::Tensor& inv_smooth) {
  const int64_t m = x.size(0), n = weight.size(0);
  check_rows(x, scales, inv_smooth, n);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1) && weight.scalar_type() == at::kChar &&
              weight.is_contiguous(), "w8a8_linear: weight must be contiguous int8 [N, K=", x.size(1), "]");
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const auto [codes, row_scale] = quantized(x, inv_smooth, false);
  const auto sums = at::_int_mm(codes, weight.t()).contiguous();
  if (x.scalar_type() == at::kFloat)
    scale_sums(sums.data_ptr<int32_t>(), row_scale.data_ptr<float>(), scales.data_ptr<float>(), m, n, out.data_ptr<float>());
  else
    scale_sums(sums.data_ptr<int32_t>(), row_scale.data_ptr<float>(), scales.data_ptr<float>(), m, n,
               out.data_ptr<at::BFloat16>());
  return out;
}

bool vnni_ready() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}

template <typename T>
void run_vnni(const at::Tensor& codes, const at::Tensor& packed, const at::Tensor& compensation,
              const at::Tensor& scales, const at::Tensor& row_scale, at::Tensor& out) {
  const vnni::Problem<T> p{reinterpret_cast<const uint8_t*>(codes.data_ptr<int8_t>()), packed.data_ptr<int8_t>(),
                           compensation.data_ptr<int32_t>(), scales.data_ptr<float>(), row_scale.data_ptr<float>(),
                           out.data_ptr<T>(), out.size(0), out.size(1), codes.size(1)};
  vnni::run(p);
}

// The products on VPDPBUSD over the weight packed in quads (w8a8_vnni.h); compensation = 128 * sum_k w[n, k].
// The result in `out_dtype` (fp32 or bf16), whatever the rows' own.
at::Tensor vnni_linear_into(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& compensation,
                            const at::Tensor& scales, const at::Tensor& inv_smooth, at::ScalarType out_dtype) {
  TORCH_CHECK(vnni_ready(), "w8a8_linear_vnni: this CPU has no AVX-512 VNNI");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "w8a8_linear_vnni: out_dtype must be fp32 or bf16");
  const int64_t m = x.size(0), n = packed.size(0) * vnni::kTile;
  check_rows(x, scales, inv_smooth, n);
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 4 == x.size(1) && packed.size(2) == vnni::kTile &&
              packed.size(3) == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "w8a8_linear_vnni: packed must be contiguous int8 [N/16, K/4, 16, 4] with K=", x.size(1));
  TORCH_CHECK(compensation.numel() == n && compensation.scalar_type() == at::kInt && compensation.is_contiguous(),
              "w8a8_linear_vnni: compensation must be int32 [N]");
  auto out = at::empty({m, n}, x.options().dtype(out_dtype));
  if (m == 0) return out;
  const auto [codes, row_scale] = quantized(x, inv_smooth, true);
  if (out_dtype == at::kFloat) run_vnni<float>(codes, packed, compensation, scales, row_scale, out);
  else run_vnni<at::BFloat16>(codes, packed, compensation, scales, row_scale, out);
  return out;
}

at::Tensor w8a8_linear_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& compensation,
                            const at::Tensor& scales, const at::Tensor& inv_smooth) {
  return vnni_linear_into(x, packed, compensation, scales, inv_smooth, x.scalar_type());
}

// wo_bf16's calling convention (bf16 rows, the out dtype last): what a bf16 engine's projections and its decode
// plan call, so the rows reach the op as they are held and leave in the engine's dtype.
at::Tensor w8a8_linear_vnni_bf16(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& compensation,
                                 const at::Tensor& scales, const at::Tensor& inv_smooth, at::ScalarType out_dtype) {
  return vnni_linear_into(x, packed, compensation, scales, inv_smooth, out_dtype);
}

}  // namespace

TORCH_LIBRARY(quantgate_w8a8, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor scales, Tensor inv_smooth) -> Tensor");
  m.def("linear_vnni(Tensor x, Tensor packed, Tensor compensation, Tensor scales, Tensor inv_smooth) -> Tensor");
  m.def("linear_vnni_bf16(Tensor x, Tensor packed, Tensor compensation, Tensor scales, Tensor inv_smooth, "
        "ScalarType out_dtype) -> Tensor");
  m.def("vnni_ready() -> bool", &vnni_ready);
}

TORCH_LIBRARY_IMPL(quantgate_w8a8, CPU, m) {
  m.impl("linear", &w8a8_linear);
  m.impl("linear_vnni", &w8a8_linear_vnni);
  m.impl("linear_vnni_bf16", &w8a8_linear_vnni_bf16);
}
