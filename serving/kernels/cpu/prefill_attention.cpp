// Causal attention of one prefill chunk: bf16 q, k, v in, fp32 scores and sums, bf16 out. Built for the `amx`
// path (both products on AMX tiles) and the `avx512bf16` path (VDPBF16PS), prefill_attention_products.h.
//
// torch's CPU flash kernel runs a 136-token, 9-head prefill at ~100 GFLOP/s and a 512-token one at ~220
// (bf16, 2 threads, the AMX Xeon): a fifth of a 2,048-token step of the default model (a sixth on an AMD
// EPYC Zen 4). Here the chunk is its own whole context (the engine's fresh prompts: no cached prefix, no window
// cut, a plain causal mask), so each item, one query head x 16 query rows, takes its score rows whole:
// S = Q K^T, a softmax per row over the keys it sees (max, exp, sum in fp32; the probabilities rounded to bf16
// as torch's kernel rounds them for its second product), O = P V, O / sum to bf16. K and V are packed once per
// KV head into the layouts both products read (K: dim pairs x 16 keys; V: key pairs x 16 dims), shared by the
// query heads of a GQA group. Scores of keys past a row's position are never read; key blocks past the
// item's last row are never computed.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__)
#include "prefill_attention_products.h"
#include "vec.h"  // exp_nonpositive: e^x of a score minus its row's max; the probabilities then rounded to bf16

namespace {

struct Shapes {
  int64_t len, heads, kv_heads, dim, key_blocks, key_pairs;
};

inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// K of each KV head as [key block][dim pair][16 keys][2]: a key block's dims c*32.. are one B tile, 64 B rows.
// V as [key pair][dim][2]: 32 keys x 16 dims are one B tile, rows D * 4 bytes apart. Keys past len are zero.
void pack_kv(const at::Tensor& k, const at::Tensor& v, const Shapes& s, uint16_t* kp, uint16_t* vp) {
  const auto* kd = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vd = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const int64_t kr = k.stride(1), vr = v.stride(1), d = s.dim;
  // V's two rows of a key pair interleaved, 32 dims at a time: a0 b0 a1 b1 ... (a word per dim)
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const __m512i key_rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(static_cast<int>(kr / 2)));
  at::parallel_for(0, s.kv_heads * s.key_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / s.key_blocks, b = i % s.key_blocks, key0 = b * kKeyBlock;
      // K: pair p of 16 keys gathered into one row of the tile (kr is even: dims contiguous, rows of D)
      const __mmask16 keys = first_lanes(s.len - key0);
      const auto* rows = reinterpret_cast<const int*>(kd + h * k.stride(0) + key0 * kr);
      auto* out = reinterpret_cast<int*>(kp + (h * s.key_blocks + b) * kKeyBlock * d);
      for (int64_t pair = 0; pair < d / 2; ++pair)
        _mm512_storeu_si512(out + pair * kKeyBlock,
                            _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), keys, key_rows, rows + pair, 4));
      // V: this block's 8 key pairs
      for (int64_t pair = key0 / 2; pair < (key0 + kKeyBlock) / 2 && pair < s.key_pairs; ++pair) {
        const int64_t a = 2 * pair, bkey = a + 1;
        const uint16_t* ra = vd + h * v.stride(0) + a * vr;
        uint16_t* dst = vp + (h * s.key_pairs + pair) * d * 2;
        for (int64_t x = 0; x < d; x += 32) {
          const __m512i va = a < s.len ? _mm512_loadu_si512(ra + x) : _mm512_setzero_si512();
          const __m512i vb = bkey < s.len ? _mm512_loadu_si512(ra + vr + x) : _mm512_setzero_si512();
          _mm512_storeu_si512(dst + 2 * x, _mm512_permutex2var_epi16(va, lo, vb));
          _mm512_storeu_si512(dst + 2 * x + 32, _mm512_permutex2var_epi16(va, hi, vb));
        }
      }
    }
  });
}

// Rows [0, rows) of one item's scores (fp32, `stride` floats a row) to bf16 probabilities: row r sees keys
// <= first + r, the rest of its P row (up to `padded` keys) is zero. Returns each row's sum of the fp32 values.
void softmax_rows(const float* scores, int64_t stride, uint16_t* p, int64_t padded, int64_t first, int rows,
                  float scale, float* sums) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int r = 0; r < kRowsPerItem; ++r) {
    const float* s = scores + r * stride;
    uint16_t* out = p + r * padded;
    const int64_t seen = r < rows ? first + r + 1 : 0;
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < seen; j += 16)
      vmax = _mm512_mask_max_ps(vmax, first_lanes(seen - j), vmax, _mm512_maskz_loadu_ps(first_lanes(seen - j), s + j));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < padded; j += 16) {
      const __mmask16 m = j < seen ? first_lanes(seen - j) : 0;
      const __m512 shifted = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), mx), vscale);
      const __m512 e = _mm512_maskz_mov_ps(m, qg::exp_nonpositive(qg::F16{shifted}).v);
      vsum = _mm512_add_ps(vsum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    sums[r] = _mm512_reduce_add_ps(vsum);
  }
}

struct ItemBuffers {
  std::vector<float> scores, o;
  std::vector<uint16_t> p, q;
  ItemBuffers(const Shapes& s)
      : scores(kRowsPerItem * s.key_blocks * kKeyBlock), o(kRowsPerItem * s.dim),
        p(kRowsPerItem * s.key_pairs * 2), q(kRowsPerItem * s.dim) {}
};

// One item: query head `head`, rows [row0, row0 + 16) of the chunk.
void item(const at::Tensor& q, const Shapes& s, const uint16_t* kp, const uint16_t* vp, int64_t head, int64_t row0,
          float scale, ItemBuffers& buf, uint16_t* out) {
  const int64_t d = s.dim, rows = std::min(kRowsPerItem, s.len - row0), group = s.heads / s.kv_heads;
  const int64_t kv = head / group;
  int64_t q_stride = q.stride(0);
  const uint16_t* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()) + row0 * q_stride + head * d;
  if (rows < kRowsPerItem) {  // the chunk's last rows, zero-padded: both products read 16
    std::fill(buf.q.begin(), buf.q.end(), 0);
    for (int64_t r = 0; r < rows; ++r) std::copy(qd + r * q_stride, qd + r * q_stride + d, buf.q.data() + r * d);
    qd = buf.q.data(), q_stride = d;
  }
  const int64_t keys = row0 + rows, blocks = (keys + kKeyBlock - 1) / kKeyBlock;
  const int64_t padded = (keys + kKeyChunk - 1) / kKeyChunk * kKeyChunk;
  const int64_t s_stride = s.key_blocks * kKeyBlock;
  const uint16_t* kh = kp + kv * s.key_blocks * kKeyBlock * d;
  item_scores(qd, q_stride, kh, blocks, d, buf.scores.data(), s_stride);
  alignas(64) float sums[kRowsPerItem];
  softmax_rows(buf.scores.data(), s_stride, buf.p.data(), padded, row0, static_cast<int>(rows), scale, sums);
  item_values(buf.p.data(), padded, vp + kv * s.key_pairs * d * 2, d, row0 + 1, static_cast<int>(rows), buf.o.data());
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / sums[r]);
    uint16_t* dst = out + ((row0 + r) * s.heads + head) * d;
    for (int64_t x = 0; x < d; x += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + x),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(buf.o.data() + r * d + x), inv)));
  }
}

// q [len, heads, dim] (rows and heads strided, dims contiguous), k and v [kv_heads, len, dim] (dims
// contiguous); returns [len, heads, dim] contiguous.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: q [len, heads, dim], k/v [kv_heads, len, dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "prefill_attention: bf16 q, k, v");
  const Shapes s{q.size(0), q.size(1), k.size(0), q.size(2), (q.size(0) + kKeyBlock - 1) / kKeyBlock,
                 (q.size(0) + kKeyChunk - 1) / kKeyChunk * kKeyChunk / 2};
  TORCH_CHECK(s.dim % kDimChunk == 0 && s.dim <= 256, "prefill_attention: head_dim a multiple of 32 up to 256, got ", s.dim);
  TORCH_CHECK(s.kv_heads > 0 && s.heads % s.kv_heads == 0, "prefill_attention: heads a multiple of kv_heads");
  TORCH_CHECK(k.size(1) == s.len && v.size(1) == s.len && k.size(2) == s.dim && v.size(2) == s.dim &&
                  v.size(0) == s.kv_heads, "prefill_attention: k and v must be [kv_heads, len, dim] of q's len and dim");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == s.dim && k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) % 2 == 0,
              "prefill_attention: dims contiguous, q's heads side by side, K's rows an even number of values apart");
  TORCH_CHECK(products_ready(), "prefill_attention: this process may not use AMX tiles");
  auto out = at::empty({s.len, s.heads, s.dim}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (s.len == 0) return out;
  std::vector<uint16_t> kp(s.kv_heads * s.key_blocks * kKeyBlock * s.dim), vp(s.kv_heads * s.key_pairs * 2 * s.dim);
  pack_kv(k, v, s, kp.data(), vp.data());
  const int64_t blocks = (s.len + kRowsPerItem - 1) / kRowsPerItem;
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, s.heads * blocks, 1, [&](int64_t begin, int64_t end) {
    products_begin();
    ItemBuffers buf(s);
    for (int64_t i = begin; i < end; ++i)
      item(q, s, kp.data(), vp.data(), i / blocks, i % blocks * kRowsPerItem, static_cast<float>(scale), buf, dst);
    products_end();
  });
  return out;
}

}  // namespace

#ifndef QG_NAMESPACE
#define QG_NAMESPACE quantgate_prefill  // the avx512bf16 build names its own (decoder_ops.py)
#endif
#define QG_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)  // expands QG_NAMESPACE before TORCH_LIBRARY pastes it
#define QG_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

QG_LIBRARY(QG_NAMESPACE, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("ready() -> bool", &products_ready);
}

QG_LIBRARY_IMPL(QG_NAMESPACE, CPU, m) { m.impl("prefill_attention", &prefill_attention); }

#endif  // AVX-512-BF16: elsewhere nothing is registered and prefills keep torch's flash kernel
