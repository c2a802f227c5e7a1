// F16 in portable C++: the reference every SIMD header must agree with, and the path on CPUs with
// neither AVX2 nor AVX-512 (built without any -m flag; the compiler may still use the base ISA's SSE2).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace qg {

constexpr const char* kIsaName = "scalar";

struct F16 {
  float v[16];
  static constexpr int kRowsPerPass = 4;
  static constexpr int kDirectRows = 4;
  static constexpr bool kPanelByInput = false;
  static constexpr int kGemmRows = 8;  // from here torch's GEMM over widened blocks: MKL beats a portable loop from a few rows

  static F16 zero() { return bcast(0.0f); }
  static F16 bcast(float x) {
    F16 r;
    for (float& e : r.v) e = x;
    return r;
  }
  static F16 load(const float* p) {
    F16 r;
    std::memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static F16 from_i8(const int8_t* p) {
    F16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  static void from_u4(const uint8_t* p, F16& even, F16& odd) {
    for (int i = 0; i < 16; ++i) {
      even.v[i] = static_cast<float>(p[i] & 0x0F);
      odd.v[i] = static_cast<float>(p[i] >> 4);
    }
  }
  static float widen(uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  static F16 from_bf16(const uint16_t* p) {
    F16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = widen(static_cast<uint32_t>(p[i]) << 16);
    return r;
  }
  static void from_bf16_pairs(const uint16_t* p, F16& first, F16& second) {
    for (int i = 0; i < 16; ++i) {
      first.v[i] = widen(static_cast<uint32_t>(p[2 * i]) << 16);
      second.v[i] = widen(static_cast<uint32_t>(p[2 * i + 1]) << 16);
    }
  }
  void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
};

inline F16 fma(const F16& a, const F16& b, const F16& c) {
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
  return r;
}
inline F16 fma(const F16& a, float b, const F16& c) {
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b + c.v[i];
  return r;
}
inline F16 mul(const F16& a, const F16& b) {
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i];
  return r;
}

inline F16 add(const F16& a, const F16& b) {
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] + b.v[i];
  return r;
}
inline float sum(const F16& a) {
  float s = 0.0f;
  for (float e : a.v) s += e;
  return s;
}

inline void pin(F16&) {}  // the SIMD headers' register hint: nothing to hold here

// e^x for x <= 0, lane by lane (the SIMD headers' polynomial agrees to ~2 ulp).
inline F16 exp_nonpositive(const F16& x) {
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = std::exp(x.v[i]);
  return r;
}

}  // namespace qg
