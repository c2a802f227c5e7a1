// Causal attention of one prefill chunk in fp32, for every x86 CPU: written once against the vector layer
// (vec.h) and built once per instruction set (avx512, avx2, scalar), as wo_fp32.cpp is. The bf16 paths have
// their own (prefill_attention.cpp); this one serves the fp32 paths, where torch's flash kernel took a tenth of
// a 2,048-token prefill step of the default model (EPYC Zen 4, AVX2): it computes every score of its 512-key
// blocks, masked or not, at ~60 GFLOP/s.
//
// The chunk is its own whole context (a fresh prompt: no cached prefix, no window cut, a plain causal mask).
// Each item, one query head x kRowsPerPass query rows, takes its score rows whole: S = Q K^T over the keys its
// rows see (K packed once per KV head as [key block][dim][16 keys], shared by a GQA group's query heads), a
// softmax per row in fp32, O = P V with V read in place 16 dims at a time, O / sum. Both products are the
// register block of wo_fp32.cpp: R rows times a 16-wide panel, each panel vector loaded once for every row.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "vec.h"

namespace {

using qg::F16;
constexpr int R = F16::kRowsPerPass;
constexpr int64_t kKeyBlock = 16;
// Up to here (one KV head's V, 512 KiB) each item's P V reads V from L2. Past it, from L3 once per 16 dims:
// 2,048 tokens of Llama 3 8B's heads (128 dims) ran 0.90-0.97x torch's kernel (EPYC Zen 4), SmolLM2's (64)
// 1.11-1.15x; torch's flash kernel serves the longer chunks.
constexpr int64_t kMaxValueFloats = 2048 * 64;

struct Shapes {
  int64_t len, heads, kv_heads, dim, key_blocks;
};

// K of each KV head as [key block][dim][16 keys]; keys past len are zero.
void pack_k(const at::Tensor& k, const Shapes& s, float* kp) {
  const float* kd = k.data_ptr<float>();
  const int64_t kh = k.stride(0), kr = k.stride(1);
  at::parallel_for(0, s.kv_heads * s.key_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / s.key_blocks, key0 = i % s.key_blocks * kKeyBlock;
      float* out = kp + i * kKeyBlock * s.dim;
      for (int64_t j = 0; j < kKeyBlock; ++j) {
        const float* row = kd + h * kh + (key0 + j) * kr;
        const bool real = key0 + j < s.len;
        for (int64_t d = 0; d < s.dim; ++d) out[d * kKeyBlock + j] = real ? row[d] : 0.0f;
      }
    }
  });
}

// R rows of `inputs` values each (row r at x + r * ldx) times a panel [inputs, 16] (rows `ldw` floats apart):
// y[r][0, 16) = sum_i x[r][i] * w[i][0, 16).
void rows_times_panel(const float* w, int64_t ldw, int64_t inputs, const float* x, int64_t ldx, float* y,
                      int64_t ldy) {
  F16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = F16::zero();
  for (int64_t i = 0; i < inputs; ++i) {
    F16 wi = F16::load(w + i * ldw);
    qg::pin(wi);
    for (int r = 0; r < R; ++r) acc[r] = fma(wi, x[r * ldx + i], acc[r]);
  }
  for (int r = 0; r < R; ++r) acc[r].store(y + r * ldy);
}

// Row r (of `rows`) sees keys [0, first + r]: its scores become exp(scale * (s - max)), zero past them.
// Returns each row's sum in sums[r] (1 for padding rows, whose P row is all zero).
void softmax_rows(float* scores, int64_t stride, int64_t keys, int64_t first, int64_t rows, float scale,
                  float* sums) {
  for (int r = 0; r < R; ++r) {
    float* s = scores + r * stride;
    const int64_t seen = r < rows ? first + r + 1 : 0;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < seen; ++j) mx = std::max(mx, s[j]);
    const F16 vscale = F16::bcast(scale), shift = F16::bcast(-mx * scale);
    F16 total = F16::zero();
    int64_t j = 0;
    for (; j + 16 <= seen; j += 16) {
      const F16 e = qg::exp_nonpositive(fma(F16::load(s + j), vscale, shift));
      e.store(s + j);
      total = add(total, e);
    }
    float sum = qg::sum(total);
    for (; j < seen; ++j) sum += s[j] = std::exp(s[j] * scale - mx * scale);
    std::fill(s + seen, s + keys, 0.0f);
    sums[r] = seen ? sum : 1.0f;
  }
}

struct ItemBuffers {
  std::vector<float> scores, o, q;
  explicit ItemBuffers(const Shapes& s)
      : scores(R * s.key_blocks * kKeyBlock), o(R * s.dim), q(R * s.dim) {}
};

// One item: query head `head`, rows [row0, row0 + R) of the chunk (fewer at its end).
void item(const float* qd, int64_t q_row, const Shapes& s, const float* kp, const float* vd, int64_t v_head,
          int64_t v_row, int64_t head, int64_t row0, float scale, ItemBuffers& buf, float* out) {
  const int64_t d = s.dim, rows = std::min<int64_t>(R, s.len - row0), kv = head / (s.heads / s.kv_heads);
  const float* q = qd + row0 * q_row + head * d;
  int64_t ldq = q_row;
  if (rows < R) {  // the chunk's last rows, zero-padded: both products take R
    std::fill(buf.q.begin(), buf.q.end(), 0.0f);
    for (int64_t r = 0; r < rows; ++r) std::copy(q + r * q_row, q + r * q_row + d, buf.q.data() + r * d);
    q = buf.q.data(), ldq = d;
  }
  const int64_t keys = row0 + rows, blocks = (keys + kKeyBlock - 1) / kKeyBlock, ldp = s.key_blocks * kKeyBlock;
  const float* kh = kp + kv * s.key_blocks * kKeyBlock * d;
  for (int64_t b = 0; b < blocks; ++b)
    rows_times_panel(kh + b * kKeyBlock * d, kKeyBlock, d, q, ldq, buf.scores.data() + b * kKeyBlock, ldp);
  float sums[R];
  softmax_rows(buf.scores.data(), ldp, keys, row0, rows, scale, sums);
  const float* vh = vd + kv * v_head;
  for (int64_t c = 0; c < d; c += 16)
    rows_times_panel(vh + c, v_row, keys, buf.scores.data(), ldp, buf.o.data() + c, d);
  for (int64_t r = 0; r < rows; ++r) {
    const F16 inv = F16::bcast(1.0f / sums[r]);
    float* dst = out + ((row0 + r) * s.heads + head) * d;
    for (int64_t c = 0; c < d; c += 16) mul(F16::load(buf.o.data() + r * d + c), inv).store(dst + c);
  }
}

// q [len, heads, dim] (rows strided, heads side by side, dims contiguous), k and v [kv_heads, len, dim] (dims
// contiguous); returns [len, heads, dim] contiguous.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: q [len, heads, dim], k/v [kv_heads, len, dim]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "prefill_attention_fp32: float32 q, k, v");
  const Shapes s{q.size(0), q.size(1), k.size(0), q.size(2), (q.size(0) + kKeyBlock - 1) / kKeyBlock};
  TORCH_CHECK(s.dim % 16 == 0 && s.dim > 0, "prefill_attention_fp32: head_dim a multiple of 16, got ", s.dim);
  TORCH_CHECK(s.kv_heads > 0 && s.heads % s.kv_heads == 0, "prefill_attention: heads a multiple of kv_heads");
  TORCH_CHECK(k.size(1) == s.len && v.size(1) == s.len && k.size(2) == s.dim && v.size(2) == s.dim &&
                  v.size(0) == s.kv_heads, "prefill_attention: k and v must be [kv_heads, len, dim] of q's len and dim");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == s.dim && k.stride(2) == 1 && v.stride(2) == 1,
              "prefill_attention: dims contiguous, q's heads side by side");
  if (s.len * s.dim > kMaxValueFloats) {  // V of a KV head past L2: torch's kernel reads it in blocks
    const at::Tensor o = at::scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0),
                                                          v.unsqueeze(0), {}, 0.0, true, scale, s.heads != s.kv_heads);
    return o.squeeze(0).transpose(0, 1).contiguous();
  }
  auto out = at::empty({s.len, s.heads, s.dim}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (s.len == 0) return out;
  std::vector<float> kp(s.kv_heads * s.key_blocks * kKeyBlock * s.dim);
  pack_k(k, s, kp.data());
  const int64_t blocks = (s.len + R - 1) / R;
  const float* qd = q.data_ptr<float>();
  const float* vd = v.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, s.heads * blocks, 1, [&](int64_t begin, int64_t end) {
    ItemBuffers buf(s);
    for (int64_t i = begin; i < end; ++i)
      item(qd, q.stride(0), s, kp.data(), vd, v.stride(0), v.stride(1), i / blocks, i % blocks * R,
           static_cast<float>(scale), buf, dst);
  });
  return out;
}

std::string isa_name() { return qg::kIsaName; }

}  // namespace

#ifndef QG_NAMESPACE
#define QG_NAMESPACE quantgate_prefill_fp32_scalar
#endif
#define QG_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)  // expands QG_NAMESPACE before TORCH_LIBRARY pastes it

QG_LIBRARY(QG_NAMESPACE, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor", &prefill_attention);
  m.def("isa() -> str", &isa_name);
}
