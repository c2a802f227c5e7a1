// Paged-attention decode for CPU: one query token per sequence, its keys and values read in place from
// the paged cache through the block table (no gathered copy of the context).
//
// Cache layout (serving/model/attention.py): per layer [kv_heads, num_blocks * block_size, head_dim], so slot
// `table[t / bs] * bs + t % bs` of head h is one contiguous row. Work items are (sequence, KV head): the
// query heads sharing a KV head read each K/V row once. Each item is one pass over its context with an
// online softmax (a running max and sum per query head, the V sums rescaled when the max rises): K and V
// of a block are read back to back, no score row of the whole context is written and re-read, and the
// blocks ahead are prefetched (a context's blocks are scattered over the cache). A build with AMX
// (the `amx` path) runs the bf16 loop's two products on tiles (paged_attention_amx.h). Scores and sums are fp32;
// int8 codes are scaled per token (the scale folds into the score for K and into the probability for V);
// fp8 e4m3 codes are decoded through a 256-entry table. A sliding-window layer (`window` > 0) attends to
// the last `window` tokens of each context: blocks before the window's first one are never read.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_attention_rows.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define QG_AVX512_BF16 1
#include "paged_attention_bf16.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define QG_AMX_DECODE 1
#include "paged_attention_amx.h"
#endif
#endif

namespace {

enum KvFormat : int64_t { kAuto = 0, kInt8 = 1, kFp8 = 2 };

struct Problem {
  int64_t num_seqs, heads, kv_heads, head_dim, slots, block_size, max_blocks;
  float scale;
  const int64_t* tables;   // [num_seqs, max_blocks]
  const int64_t* lengths;  // [num_seqs]
  const at::Half* k_scale; // [kv_heads, slots] or null
  const at::Half* v_scale;
  int64_t window;          // 0: the whole context
};

// The blocks a sequence attends to, from the one holding its window's first token (the whole context: 0).
struct Span {
  const int64_t* table;   // that block's entry in the sequence's block table
  int64_t first, length;  // attended tokens [first, length), counted from that block's first slot
};

inline Span span_of(const Problem& p, int64_t seq) {
  const int64_t length = p.lengths[seq];
  const int64_t start = p.window > 0 && length > p.window ? length - p.window : 0;
  const int64_t skipped = start / p.block_size;
  return {p.tables + seq * p.max_blocks + skipped, start - skipped * p.block_size, length - skipped * p.block_size};
}

// The running softmax of the `group` query heads over the context (the portable path).
struct Online {
  float* q;    // [group, dim] scaled queries
  float* acc;  // [group, dim] weighted V sums, relative to the running max
  float* m;    // [group] running max
  float* l;    // [group] running sum
  float* s;    // [group, kChunk] one chunk's scores, then its probabilities
  float* k;    // [kChunk, dim] widened K rows, then V rows (unused for fp32)
};

constexpr int64_t kChunk = 16;  // tokens per step: a block of 16, or part of a larger block
constexpr int64_t kAheadBlocks = 3;  // the portable loop's fetches into L2, this many blocks ahead

// Fold the chunk's scores s[g, 0..n) into each head's running max and sum; leaves probabilities in s.
inline void online_chunk(Online& o, int64_t group, int64_t dim, int64_t n) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = o.s + g * kChunk;
    float peak = s[0];
    for (int64_t i = 1; i < n; ++i) peak = std::max(peak, s[i]);
    if (peak > o.m[g]) {
      const float corr = o.m[g] == -std::numeric_limits<float>::max() ? 0.0f : std::exp(o.m[g] - peak);
      o.l[g] *= corr;
      float* acc = o.acc + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) acc[d] *= corr;
      o.m[g] = peak;
    }
    const float m = o.m[g];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp(s[i] - m);
      sum += s[i];
    }
    o.l[g] += sum;
  }
}

// acc[0, 16 V) += sum_i w[i] * rows[i][0, 16 V) (rows `stride` apart): the column sums held in registers across
// the chunk's rows (an axpy per row loads and stores the accumulator row for every token; a float array here
// stayed in memory, each token's sums waiting on the last one's stores).
template <int V>
inline void weighted_columns(const float* w, const float* rows, int64_t n, int64_t stride, float* acc) {
  F16 a[V];
  for (int j = 0; j < V; ++j) a[j] = F16::load(acc + 16 * j);
  for (int64_t i = 0; i < n; ++i) {
    const float wi = w[i];
    for (int j = 0; j < V; ++j) a[j] = fma(F16::load(rows + i * stride + 16 * j), wi, a[j]);
  }
  for (int j = 0; j < V; ++j) a[j].store(acc + 16 * j);
}

// 64 columns at a time (8 of AVX2's 16 registers), the rows read in order: a head of 128 takes two passes over
// the chunk's rows, the second from L1 (walking single columns over rows from DRAM cost ~25 %).
inline void weighted_rows(const float* w, const float* rows, int64_t n, int64_t dim, float* acc) {
  int64_t c = 0;
  for (; c + 64 <= dim; c += 64) weighted_columns<4>(w, rows + c, n, dim, acc + c);
  for (; c + 16 <= dim; c += 16) weighted_columns<1>(w, rows + c, n, dim, acc + c);
  for (; c < dim; ++c) {
    float a = acc[c];
    for (int64_t i = 0; i < n; ++i) a += w[i] * rows[i * dim + c];
    acc[c] = a;
  }
}

// Tokens [t, t + n) of one block, their K and V rows from `krows` / `vrows` (scales from `kscale` /
// `vscale`, or null): scores, the online softmax step, the V sums.
template <typename C>
void attend_chunk(const Problem& p, Online& o, const C* krows, const C* vrows, const at::Half* kscale,
                  const at::Half* vscale, int64_t n) {
  const int64_t group = p.heads / p.kv_heads, dim = p.head_dim;
  for (int64_t i = 0; i < n; ++i) {
    const float* k = row_of(krows + i * dim, o.k + i * dim, dim);
    const float ks = kscale ? static_cast<float>(kscale[i]) : 1.0f;
    for (int64_t g = 0; g < group; ++g) o.s[g * kChunk + i] = dot(o.q + g * dim, k, dim) * ks;
  }
  online_chunk(o, group, dim, n);
  if (vscale) {
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t i = 0; i < n; ++i) o.s[g * kChunk + i] *= static_cast<float>(vscale[i]);
    }
  }
  const float* v = reinterpret_cast<const float*>(vrows);
  if constexpr (!std::is_same_v<C, float>) {  // the K rows are done with: widen the V rows into their room
    for (int64_t i = 0; i < n; ++i) load_row(vrows + i * dim, o.k + i * dim, dim);
    v = o.k;
  }
  for (int64_t g = 0; g < group; ++g) weighted_rows(o.s + g * kChunk, v, n, dim, o.acc + g * dim);
}

// One (sequence, KV head), any formats: one pass over the context in chunks of at most kChunk tokens of
// one block, an online softmax, K and V of a chunk read back to back, the blocks ahead prefetched.
template <typename Q, typename C>
void attend_portable(const Problem& p, const Q* q, const C* k_cache, const C* v_cache, Q* out, int64_t seq,
                     int64_t kvh, const Span& span, std::vector<float>& buf) {
  const int64_t group = p.heads / p.kv_heads, dim = p.head_dim, bs = p.block_size;
  buf.resize(2 * group * dim + 2 * group + group * kChunk + kChunk * dim);
  Online o{buf.data(), nullptr, nullptr, nullptr, nullptr, nullptr};
  o.acc = o.q + group * dim, o.m = o.acc + group * dim, o.l = o.m + group, o.s = o.l + group;
  o.k = o.s + group * kChunk;
  const Q* qrow = q + (seq * p.heads + kvh * group) * dim;
  for (int64_t g = 0; g < group; ++g) {
    load_row(qrow + g * dim, o.q + g * dim, dim);
    for (int64_t d = 0; d < dim; ++d) o.q[g * dim + d] *= p.scale;
    o.m[g] = -std::numeric_limits<float>::max(), o.l[g] = 0.0f;
  }
  std::fill(o.acc, o.acc + group * dim, 0.0f);
  const int64_t head_base = kvh * p.slots;
  for (int64_t t = span.first; t < span.length;) {
    const int64_t block = t / bs, in_block = t % bs;
    const int64_t n = std::min({span.length - t, bs - in_block, kChunk});
    const int64_t slot = head_base + span.table[block] * bs + in_block;
    // The twin rows of blocks ahead, into L2, where the blocks are not laid out in order (a server's cache: blocks
    // freed and handed out again) and the hardware prefetcher stops at each block's end: the next block's (K and V
    // here wait on the chunk's softmax, so out-of-order reads stop at it) and kAheadBlocks blocks on. In order the
    // hardware prefetcher runs ahead alone, and fetching there too cost 1.3-1.4x (a b64 ctx-256 fp32 step's
    // attention on an EPYC Zen 4: 39-41 -> 28-31 ms without); scattered, a build without the fetches ran 0.60x
    // (paired; docs/results/2026-12-07-amd-epyc-zen4-fp32-evening.md).
    for (const int64_t ahead : {int64_t{1}, kAheadBlocks}) {
      if ((block + ahead) * bs >= span.length || span.table[block + ahead] == span.table[block] + ahead) continue;
      const int64_t rows = head_base + span.table[block + ahead] * bs + in_block;
      prefetch_lines<2>(k_cache + rows * dim, n * dim * static_cast<int64_t>(sizeof(C)));
      prefetch_lines<2>(v_cache + rows * dim, n * dim * static_cast<int64_t>(sizeof(C)));
    }
    attend_chunk<C>(p, o, k_cache + slot * dim, v_cache + slot * dim, p.k_scale ? p.k_scale + slot : nullptr,
                    p.v_scale ? p.v_scale + slot : nullptr, n);
    t += n;
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.0f / o.l[g];
    for (int64_t d = 0; d < dim; ++d) o.acc[g * dim + d] *= inv;
    store_row(o.acc + g * dim, out + (seq * p.heads + kvh * group) * dim + g * dim, dim);
  }
}

// Per thread: the portable loop's buffer, and the AMX loop's where the call runs on tiles (else null).
struct ThreadState {
  std::vector<float> buf;
#ifdef QG_AMX_DECODE
  AmxScratch* amx = nullptr;
#endif
};

// One (sequence, KV head): a bf16 cache in blocks of 16 through the AMX or AVX-512-BF16 loop where this build
// has it and the shape has an instance, everything else through the portable loop. `next` is the item this
// thread runs after it (-1: none), whose first blocks the bf16 loops fetch early.
template <typename Q, typename C>
void attend_one(const Problem& p, const Q* q, const C* k_cache, const C* v_cache, Q* out, int64_t seq,
                int64_t kvh, int64_t next, ThreadState& state) {
  if (p.lengths[seq] <= 0) return;
  const Span span = span_of(p, seq);
  const int64_t group = p.heads / p.kv_heads, dim = p.head_dim;
#ifdef QG_AVX512_BF16
  if constexpr (std::is_same_v<Q, at::BFloat16> && std::is_same_v<C, at::BFloat16>) {
    if (p.block_size == kBf16Block) {
      const auto bits = [](const at::BFloat16* x) { return reinterpret_cast<const uint16_t*>(x); };
      Bf16Item item{bits(k_cache), bits(v_cache), span.table, kvh * p.slots, span.first, span.length,
                    reinterpret_cast<const uint32_t*>(q + (seq * p.heads + kvh * group) * dim), p.scale,
                    reinterpret_cast<uint16_t*>(out + (seq * p.heads + kvh * group) * dim)};
      if (next >= 0 && p.lengths[next / p.kv_heads] > 0) {
        const Span after = span_of(p, next / p.kv_heads);
        item.next_table = after.table, item.next_head_base = (next % p.kv_heads) * p.slots;
        item.next_blocks = (after.length + kBf16Block - 1) / kBf16Block;
      }
#ifdef QG_AMX_DECODE
      if (state.amx) return attend_amx(item, group, dim, *state.amx);
#endif
      if (attend_bf16(item, group, dim)) return;
    }
  }
#endif
  attend_portable<Q, C>(p, q, k_cache, v_cache, out, seq, kvh, span, state.buf);
}

// Whether this call's bf16 items run on AMX tiles.
template <typename Q, typename C>
bool on_tiles(const Problem& p) {
#ifdef QG_AMX_DECODE
  if constexpr (std::is_same_v<Q, at::BFloat16> && std::is_same_v<C, at::BFloat16>) {
    return p.block_size == kBf16Block && amx_decode_fits(p.heads / p.kv_heads, p.head_dim);
  }
#endif
  return false;
}

// Work items (sequence, KV head) cut into `parts` contiguous runs of about equal cost (tokens attended
// plus a fixed cost per item): a batch mixes 16- and 512-token contexts, and an even split by count left
// one thread with most of the tokens.
std::vector<int64_t> balanced_cuts(const Problem& p, int64_t parts) {
  const int64_t items = p.num_seqs * p.kv_heads;
  std::vector<int64_t> cost(items + 1, 0);
  for (int64_t item = 0; item < items; ++item) {
    const Span span = span_of(p, item / p.kv_heads);
    cost[item + 1] = cost[item] + std::max<int64_t>(span.length - span.first, 0) + 32;
  }
  parts = std::max<int64_t>(1, std::min(parts, items));
  std::vector<int64_t> cuts{0};
  for (int64_t part = 1; part < parts; ++part) {
    const int64_t target = cost[items] * part / parts;
    cuts.push_back(std::lower_bound(cost.begin(), cost.end(), target) - cost.begin());
  }
  cuts.push_back(items);
  return cuts;
}

template <typename Q, typename C>
void run(const Problem& p, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         at::Tensor& out) {
  const Q* qp = q.data_ptr<Q>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  Q* op = out.data_ptr<Q>();
  const std::vector<int64_t> cuts = balanced_cuts(p, at::get_num_threads());
  const bool tiles = on_tiles<Q, C>(p);
  at::parallel_for(0, static_cast<int64_t>(cuts.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    ThreadState state;
#ifdef QG_AMX_DECODE
    if (tiles) {
      state.amx = &amx_scratch(static_cast<int>(p.heads / p.kv_heads));
      configure_decode_tiles(static_cast<int>(p.heads / p.kv_heads));
    }
#endif
    for (int64_t item = cuts[begin]; item < cuts[end]; ++item) {
      const int64_t next = item + 1 < cuts[end] ? item + 1 : -1;
      attend_one<Q, C>(p, qp, kp, vp, op, item / p.kv_heads, item % p.kv_heads, next, state);
    }
#ifdef QG_AMX_DECODE
    if (tiles) _tile_release();
#endif
  });
}

template <typename Q>
void dispatch_cache(const Problem& p, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    at::Tensor& out, int64_t kv_format) {
  if (kv_format == kInt8) return run<Q, int8_t>(p, q, k_cache, v_cache, out);
  if (kv_format == kFp8) return run<Q, uint8_t>(p, q, k_cache, v_cache, out);
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "paged_decode: cache dtype ", k_cache.scalar_type(),
              " differs from the query's ", q.scalar_type());
  run<Q, Q>(p, q, k_cache, v_cache, out);
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                        double scale, const c10::optional<at::Tensor>& k_scale,
                        const c10::optional<at::Tensor>& v_scale, int64_t kv_format, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "paged_decode: q [n, heads, dim], "
              "caches [kv_heads, slots, dim]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: "
              "q and caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode: block_tables and context_lens must be int64");
  TORCH_CHECK(window >= 0, "paged_decode: window must be >= 0 (0: the whole context)");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "paged_decode: heads not a multiple of kv_heads");
  TORCH_CHECK(q.size(2) == k_cache.size(2), "paged_decode: head_dim differs between q and the cache");
  const bool scaled = kv_format == kInt8;
  TORCH_CHECK(!scaled || (k_scale && v_scale), "paged_decode: int8 cache needs k_scale and v_scale");
  auto tables = block_tables.contiguous();
  auto lengths = context_lens.contiguous();
  c10::optional<at::Tensor> ks, vs;
  if (scaled) {
    ks = k_scale->contiguous();
    vs = v_scale->contiguous();
    TORCH_CHECK(ks->scalar_type() == at::kHalf && vs->scalar_type() == at::kHalf, "paged_decode: scales fp16");
  }
  Problem p{q.size(0), q.size(1), k_cache.size(0), q.size(2), k_cache.size(1), block_size,
            tables.size(1), static_cast<float>(scale), tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(),
            scaled ? ks->data_ptr<at::Half>() : nullptr, scaled ? vs->data_ptr<at::Half>() : nullptr, window};
  auto out = at::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_cache<float>(p, q, k_cache, v_cache, out, kv_format); break;
    case at::kBFloat16: dispatch_cache<at::BFloat16>(p, q, k_cache, v_cache, out, kv_format); break;
    case at::kHalf: dispatch_cache<at::Half>(p, q, k_cache, v_cache, out, kv_format); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported query dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

#ifndef QG_NAMESPACE
#define QG_NAMESPACE quantgate  // a per-ISA build names its own (decoder_ops.py)
#endif
#define QG_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)  // expands QG_NAMESPACE before TORCH_LIBRARY pastes it
#define QG_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

QG_LIBRARY(QG_NAMESPACE, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "int block_size, float scale, Tensor? k_scale, Tensor? v_scale, int kv_format, int window=0) -> Tensor");
}

QG_LIBRARY_IMPL(QG_NAMESPACE, CPU, m) { m.impl("paged_decode", &paged_decode); }
