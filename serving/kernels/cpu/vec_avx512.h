// F16 on AVX-512 (F, BW, VL, DQ): one zmm register. For CPUs with AVX-512 but no native bf16
// (Skylake-SP to Ice Lake, some cloud Xeons); where avx512_bf16 is present wo_bf16.cpp runs instead
// for bf16 activations, and this build serves fp32 ones.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace qg {

constexpr const char* kIsaName = "avx512";

struct F16 {
  __m512 v;
  static constexpr int kRowsPerPass = 12;  // 12 accumulators of 32 zmm, the rest for weights and broadcasts
  static constexpr int kDirectRows = 4;
  static constexpr bool kPanelByInput = false;  // the four-input stream keeps its accumulators in 32 registers; one input at a time ran 0.86-0.95x
  static constexpr int kGemmRows = 48;  // from here torch's GEMM over widened blocks: the panel keeps up with MKL up to here

  static F16 zero() { return {_mm512_setzero_ps()}; }
  static F16 bcast(float x) { return {_mm512_set1_ps(x)}; }
  static F16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static F16 from_i8(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  static void from_u4(const uint8_t* p, F16& even, F16& odd) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i mask = _mm512_set1_epi32(0x0F);
    even = {_mm512_cvtepi32_ps(_mm512_and_si512(b, mask))};
    odd = {_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))};
  }
  static F16 from_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  static void from_bf16_pairs(const uint16_t* p, F16& first, F16& second) {
    const __m512i a = _mm512_loadu_si512(p);
    first = {_mm512_castsi512_ps(_mm512_slli_epi32(a, 16))};
    second = {_mm512_castsi512_ps(_mm512_and_si512(a, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};

inline F16 fma(const F16& a, const F16& b, const F16& c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F16 fma(const F16& a, float b, const F16& c) { return {_mm512_fmadd_ps(a.v, _mm512_set1_ps(b), c.v)}; }
inline F16 mul(const F16& a, const F16& b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 add(const F16& a, const F16& b) { return {_mm512_add_ps(a.v, b.v)}; }
inline float sum(const F16& a) { return _mm512_reduce_add_ps(a.v); }

// vec_avx2.h's register hint: not needed with 32 registers (GCC keeps the weights in them), and pinning cost an
// 8B-shaped call 3-6 % at 64-512 rows on an EPYC Zen 4 (docs/results/2026-12-07-amd-epyc-zen4-fp32-evening.md).
inline void pin(F16&) {}

// e^x for x <= 0 (a score minus its row's max), to ~2 ulp: 2^(x log2 e) as 2^n times a degree-6 polynomial of
// the fraction (prefill_attention_fp32.cpp's softmax). Below 2^-126 it returns about 2^-126 x p, never a denormal.
inline F16 exp_nonpositive(const F16& x) {
  const __m512 y = _mm512_max_ps(_mm512_mul_ps(x.v, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);  // [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return {_mm512_scalef_ps(p, n)};
}

}  // namespace qg
