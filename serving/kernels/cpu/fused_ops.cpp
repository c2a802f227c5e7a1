// The small per-layer ops of a Llama-family decoder, each one pass over its rows instead of the 7-12 torch
// ops (and their temporaries) the model's Python forward makes of it: RMSNorm, residual add + RMSNorm, and
// rotary embedding of q and k in place (`rotary_store` also writes K and V to their cache slots); and the
// greedy pick of each sampled row (`greedy_pick`, serving/model/sampler.py), and the MLP's silu(gate) * up in bf16.
//
// Each op rounds where the model's forward rounds, so results match it: in bfloat16 the residual sum, the
// normalized row and its product with the weight are each rounded to bf16 (HF's RMSNorm computes in fp32,
// casts back, then multiplies by the bf16 weight); rotary rounds q*cos, rotate_half(q)*sin and their sum.
// fp32 has no intermediate rounding; only the variance's summation order differs from torch's.
// Built without -ffast-math (serving.kernels.cpu.PRECISE_CFLAGS) so no product is fused into an FMA.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "silu_table.h"

namespace {

inline float widen(float x) { return x; }

inline float widen(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// fp32 -> the storage type, round to nearest even (as torch's casts do; NaN payloads aside).
template <typename T>
inline T narrow(float x);

template <>
inline float narrow<float>(float x) { return x; }

template <>
inline at::BFloat16 narrow<at::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  at::BFloat16 out;
  out.x = static_cast<uint16_t>(bits >> 16);
  return out;
}

constexpr int64_t kGrainRows = 16;

// out = weight * T(x * rsqrt(mean(x^2) + eps)) for one row of already-widened values.
template <typename T>
void norm_row(const float* x, const T* weight, T* out, int64_t dim, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < dim; ++d) sum += x[d] * x[d];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
  for (int64_t d = 0; d < dim; ++d) out[d] = narrow<T>(widen(weight[d]) * widen(narrow<T>(x[d] * inv)));
}

template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      if (residual != nullptr) {  // residual += x, rounded as the model's add rounds, then normalized
        T* res = residual + r * dim;
        for (int64_t d = 0; d < dim; ++d) {
          res[d] = narrow<T>(widen(res[d]) + widen(xr[d]));
          row[d] = widen(res[d]);
        }
      } else {
        for (int64_t d = 0; d < dim; ++d) row[d] = widen(xr[d]);
      }
      norm_row(row.data(), weight, out + r * dim, dim, eps);
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rows must be a contiguous [tokens, hidden] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be [hidden], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and rows must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
}

template <typename T>
void dispatch_norm(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, at::Tensor& out,
                   double eps) {
  rms_norm_rows<T>(x.data_ptr<T>(), residual ? residual->data_ptr<T>() : nullptr, weight.data_ptr<T>(),
                   out.data_ptr<T>(), x.size(0), x.size(1), static_cast<float>(eps));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) dispatch_norm<float>(x, nullptr, weight, out, eps);
  else dispatch_norm<at::BFloat16>(x, nullptr, weight, out, eps);
  return out;
}

// residual += x; returns rms_norm(residual).
at::Tensor add_rms_norm(at::Tensor residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
              residual.scalar_type() == x.scalar_type(), "residual must match the rows");
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) dispatch_norm<float>(x, &residual, weight, out, eps);
  else dispatch_norm<at::BFloat16>(x, &residual, weight, out, eps);
  return out;
}

// HF's apply_rotary_pos_emb on one head's row: x * cos + rotate_half(x) * sin, rotate_half = cat(-x2, x1).
template <typename T>
void rotate_row(T* x, const T* cos, const T* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = widen(x[i]), x2 = widen(x[i + half]);
    const float lo = widen(narrow<T>(x1 * widen(cos[i]))) + widen(narrow<T>(-x2 * widen(sin[i])));
    const float hi = widen(narrow<T>(x2 * widen(cos[i + half]))) +
                     widen(narrow<T>(x1 * widen(sin[i + half])));
    x[i] = narrow<T>(lo);
    x[i + half] = narrow<T>(hi);
  }
}

template <typename T>
void rotary_rows(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim) {
  const int64_t rows = q.size(0), q_heads = q.size(1) / head_dim, k_heads = k.size(1) / head_dim;
  const int64_t q_stride = q.stride(0), k_stride = k.stride(0);  // q and k may be column slices of one qkv row
  T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>();
  const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *c = cp + r * head_dim, *s = sp + r * head_dim;
      for (int64_t h = 0; h < q_heads; ++h) rotate_row(qp + r * q_stride + h * head_dim, c, s, head_dim / 2);
      for (int64_t h = 0; h < k_heads; ++h) rotate_row(kp + r * k_stride + h * head_dim, c, s, head_dim / 2);
    }
  });
}

void rotary(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim) {
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "head_dim must be even");
  for (const at::Tensor& t : {q, k, cos, sin}) {
    TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.size(0) == q.size(0),
                "q, k, cos and sin must be [tokens, ...] tensors with contiguous rows");
    TORCH_CHECK(t.scalar_type() == q.scalar_type(), "q, k, cos and sin must share a dtype");
  }
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "cos and sin must be contiguous");
  TORCH_CHECK(q.size(1) % head_dim == 0 && k.size(1) % head_dim == 0 && cos.size(1) == head_dim &&
              sin.size(1) == head_dim, "q and k rows must be whole heads; cos and sin one head wide");
  if (q.scalar_type() == at::kFloat) rotary_rows<float>(q, k, cos, sin, head_dim);
  else if (q.scalar_type() == at::kBFloat16) rotary_rows<at::BFloat16>(q, k, cos, sin, head_dim);
  else TORCH_CHECK(false, "float32 or bfloat16 only");
}

// rotary, then each token's K and V rows written to their cache slots ([kv_heads, slots, head_dim] caches of
// the rows' dtype): what attention's index_copy_ of K and V did, in the same pass.
void rotary_store(at::Tensor q, at::Tensor k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t head_dim, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots) {
  rotary(q, k, cos, sin, head_dim);
  const int64_t rows = k.size(0), kv_heads = k.size(1) / head_dim;
  TORCH_CHECK(v.dim() == 2 && v.stride(1) == 1 && v.size(0) == rows && v.size(1) == k.size(1) &&
              v.scalar_type() == k.scalar_type(), "v must be shaped and typed as k");
  for (const at::Tensor& cache : {k_cache, v_cache}) {
    TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && cache.size(0) == kv_heads && cache.size(2) == head_dim &&
                cache.scalar_type() == k.scalar_type(), "caches must be contiguous [kv_heads, slots, head_dim] of k's dtype");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == rows,
              "one int64 slot per token");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(1), bytes = head_dim * k.element_size();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(slot[r] >= 0 && slot[r] < num_slots, "slot out of range");
  const char *kp = static_cast<const char*>(k.data_ptr()), *vp = static_cast<const char*>(v.data_ptr());
  char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_row = k.stride(0) * k.element_size(), v_row = v.stride(0) * v.element_size();
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t dst = (h * num_slots + slot[r]) * bytes;
        std::memcpy(kc + dst, kp + r * k_row + h * bytes, bytes);
        std::memcpy(vc + dst, vp + r * v_row + h * bytes, bytes);
      }
    }
  });
}

// Greedy decoding's pick per row: the index of the row's largest value (the first of ties, as torch's max
// gives it) or -1 where a value is NaN or infinite (that sequence gets no token). Logits read in their own
// dtype, one pass for the max and the check, a second over the same (cached) row for the index: torch's
// max + amin over a bf16 [64, 49152] block took ~1.9 ms on 2 cores, and more with an fp32 copy first.
template <typename T>
int64_t greedy_row(const T* x, int64_t n) {
  float peak = -INFINITY;
  int bad = 0;
#pragma omp simd reduction(max : peak) reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) {
    const float v = widen(x[i]);
    peak = v > peak ? v : peak;
    bad |= !(v - v == 0.0f);  // NaN and +-inf alike: x - x is NaN for both
  }
  if (bad || n == 0) return -1;
  for (int64_t i = 0; i < n; ++i) {
    if (widen(x[i]) == peak) return i;
  }
  return -1;
}

at::Tensor greedy_pick(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2, "greedy_pick: logits [rows, vocab]");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* picked = out.data_ptr<int64_t>();
  const auto run = [&](auto* data) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) picked[r] = greedy_row(data + r * n, n);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(x.data_ptr<float>()); break;
    case at::kBFloat16: run(x.data_ptr<at::BFloat16>()); break;
    default: TORCH_CHECK(false, "greedy_pick: float32 or bfloat16 logits, got ", x.scalar_type());
  }
  return out;
}

// silu(gate) * up over bf16 rows, to the bit what `F.silu(gate) * up` gives (silu rounded to bf16 by the table,
// the product rounded again) in one pass, where torch makes two ops and a temporary (1.4-1.8 ms a layer at
// 2,048 x 1,536 on 2 threads). fp32 models keep torch's ops.
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes(), "silu_mul: gate and up [rows, n] alike, got ",
              gate.sizes(), " and ", up.sizes());
  TORCH_CHECK(gate.scalar_type() == at::kBFloat16 && up.scalar_type() == at::kBFloat16, "silu_mul: bfloat16 rows");
  TORCH_CHECK(gate.stride(1) == 1 && up.stride(1) == 1, "silu_mul: each row contiguous");
  const int64_t rows = gate.size(0), n = gate.size(1), gs = gate.stride(0), us = up.stride(0);
  auto out = at::empty({rows, n}, gate.options());
  const uint16_t* table = silu_table().data();
  const uint16_t* g = reinterpret_cast<const uint16_t*>(gate.data_ptr<at::BFloat16>());
  const at::BFloat16* u = up.data_ptr<at::BFloat16>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* gr = g + r * gs;
      const at::BFloat16* ur = u + r * us;
      at::BFloat16* orow = o + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        at::BFloat16 silu;
        silu.x = table[gr[i]];
        orow[i] = narrow<at::BFloat16>(widen(silu) * widen(ur[i]));
      }
    }
  });
  return out;
}

}  // namespace

#ifndef QG_NAMESPACE
#define QG_NAMESPACE quantgate_ops  // a per-ISA build names its own (decoder_ops.py)
#endif
#define QG_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)  // expands QG_NAMESPACE before TORCH_LIBRARY pastes it
#define QG_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

QG_LIBRARY(QG_NAMESPACE, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, int head_dim) -> ()");
  m.def("rotary_store(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, Tensor sin, int head_dim, "
        "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slots) -> ()");
  m.def("greedy_pick(Tensor logits) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
}

QG_LIBRARY_IMPL(QG_NAMESPACE, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("rotary_store", &rotary_store);
  m.impl("greedy_pick", &greedy_pick);
  m.impl("silu_mul", &silu_mul);
}
