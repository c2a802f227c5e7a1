// Rows of the paged cache as the portable decode loop (paged_attention.cpp) reads and writes them: any
// format widened to fp32 (fp8 e4m3 through a 256-entry table), dot products, rows stored back.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "vec.h"

namespace {

using qg::F16;

float fp8_e4m3_to_float(uint8_t bits) {
  const int sign = bits >> 7, exp = (bits >> 3) & 0xF, man = bits & 0x7;
  float value;
  if (exp == 0xF && man == 0x7) {
    value = std::numeric_limits<float>::quiet_NaN();
  } else if (exp == 0) {
    value = std::ldexp(static_cast<float>(man) / 8.0f, -6);
  } else {
    value = std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
  }
  return sign ? -value : value;
}

struct Fp8Table {
  float values[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) values[i] = fp8_e4m3_to_float(static_cast<uint8_t>(i));
  }
};

const Fp8Table& fp8_table() {
  static const Fp8Table table;
  return table;
}

// Widen one row of `dim` elements to fp32.
inline void load_row(const float* src, float* dst, int64_t dim) { std::memcpy(dst, src, dim * sizeof(float)); }

inline void load_row(const at::BFloat16* src, float* dst, int64_t dim) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) {
    uint32_t wide = static_cast<uint32_t>(bits[d]) << 16;
    float f;
    std::memcpy(&f, &wide, sizeof(f));
    dst[d] = f;
  }
}

inline void load_row(const at::Half* src, float* dst, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]);
}

inline void load_row(const int8_t* src, float* dst, int64_t dim) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]);
}

inline void load_row(const uint8_t* src, float* dst, int64_t dim) {  // fp8 e4m3 bits
  const float* table = fp8_table().values;
  for (int64_t d = 0; d < dim; ++d) dst[d] = table[src[d]];
}

// Two chains of 16-lane products and one horizontal sum: the compiler's own reduction ran one chain of FMAs, each
// score waiting on all of them in turn.
inline float dot(const float* a, const float* b, int64_t dim) {
  int64_t d = 0;
  float acc = 0.0f;
  if (dim >= 32) {
    F16 x = mul(F16::load(a), F16::load(b)), y = mul(F16::load(a + 16), F16::load(b + 16));
    for (d = 32; d + 32 <= dim; d += 32) {
      x = fma(F16::load(a + d), F16::load(b + d), x);
      y = fma(F16::load(a + d + 16), F16::load(b + d + 16), y);
    }
    acc = sum(add(x, y));
  }
  for (; d < dim; ++d) acc += a[d] * b[d];
  return acc;
}

inline void store_row(const float* src, float* dst, int64_t dim) { std::memcpy(dst, src, dim * sizeof(float)); }

template <typename T>
inline void store_row(const float* src, T* dst, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(src[d]);
}

// A cache row as fp32: an fp32 cache is read in place, any other format widened into `buf`.
template <typename C>
inline const float* row_of(const C* src, float* buf, int64_t dim) {
  if constexpr (std::is_same_v<C, float>) {
    return src;
  } else {
    load_row(src, buf, dim);
    return buf;
  }
}

// Every line of [at, at + bytes): LOCALITY 3 into L1 (prefetcht0), 2 into L2 (prefetcht1: lines in flight there
// are not bounded by L1's few fill buffers). always_inline: GCC deleted these fetches as calls without effect when
// called through a lambda or a member function.
template <int LOCALITY>
__attribute__((always_inline)) inline void prefetch_lines(const void* at, int64_t bytes) {
  const char* p = static_cast<const char*>(at);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, LOCALITY);
}

}  // namespace
