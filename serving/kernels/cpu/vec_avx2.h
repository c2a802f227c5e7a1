// F16 on AVX2 + FMA + F16C: two ymm registers. Nothing here needs AVX-512, and the build passes
// -mavx2 -mfma -mf16c only, so this path runs on every x86 CPU since Haswell / Zen 1.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace qg {

constexpr const char* kIsaName = "avx2";

struct F16 {
  __m256 lo, hi;
  static constexpr int kRowsPerPass = 6;  // 12 accumulators + 2 weight registers + 1 broadcast of 16 ymm
  static constexpr int kDirectRows = 4;   // calls up to here dequantize in registers; more rows: an fp32 panel
  static constexpr bool kPanelByInput = true;  // later passes over a cached fp32 panel one input at a time (wo_fp32.cpp, rows_of_panel)
  static constexpr int kGemmRows = 24;  // from here torch's GEMM over widened blocks: its panel micro-kernel reaches ~half of MKL once compute-bound

  static F16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static F16 bcast(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
  static F16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static __m128i low8(const void* p) { return _mm_loadl_epi64(static_cast<const __m128i*>(p)); }
  static F16 from_i8(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(low8(p))), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(low8(p + 8)))};
  }
  // 16 bytes of two codes each: the low nibbles (inputs 2j) and the high ones (inputs 2j + 1). Each half
  // widened straight from memory to 8 x 32 bits, then split there (no 128-bit shuffles).
  static void from_u4(const uint8_t* p, F16& even, F16& odd) {
    const __m256i a = _mm256_cvtepu8_epi32(low8(p)), b = _mm256_cvtepu8_epi32(low8(p + 8));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    even = {_mm256_cvtepi32_ps(_mm256_and_si256(a, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(b, mask))};
    odd = {_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
  }
  static F16 from_bf16(const uint16_t* p) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16))};
  }
  // 16 (bf16 scale, bf16 zero) pairs, as int4's [K/g, N, 2] holds them
  static void from_bf16_pairs(const uint16_t* p, F16& first, F16& second) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    first = {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
    second = {_mm256_castsi256_ps(_mm256_and_si256(a, high)), _mm256_castsi256_ps(_mm256_and_si256(b, high))};
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
};

inline F16 fma(const F16& a, const F16& b, const F16& c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16 fma(const F16& a, float b, const F16& c) {
  const __m256 v = _mm256_set1_ps(b);
  return {_mm256_fmadd_ps(a.lo, v, c.lo), _mm256_fmadd_ps(a.hi, v, c.hi)};
}
inline F16 mul(const F16& a, const F16& b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 add(const F16& a, const F16& b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline float sum(const F16& a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// Makes v a register here: a value the compiler may reload, it would otherwise fold into every FMA using it.
inline void pin(F16& v) { asm volatile("" : "+x"(v.lo), "+x"(v.hi)); }

// e^x for x <= 0 (a score minus its row's max), to ~2 ulp: 2^(x log2 e) as 2^n times a degree-6 polynomial of
// the fraction (prefill_attention_fp32.cpp's softmax). Below 2^-126 it returns about 2^-126 x p, never a denormal.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 y = _mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(y, n);  // [-0.5, 0.5]
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
inline F16 exp_nonpositive(const F16& x) { return {exp_nonpositive(x.lo), exp_nonpositive(x.hi)}; }

}  // namespace qg
