"""Paged decode attention: one query token per sequence against its context, read through the block table.

One program per (sequence, KV head): the query heads sharing that KV head are the rows of one tile, so each
K/V row is loaded once for the whole group (GQA without repeating K/V). Keys are visited in tiles of
BLOCK_N positions whose slots come from the block table (a tile may span blocks, so any block size works),
with an online softmax in float32. A sequence of length 0 (a padding row of a captured batch) yields zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serving.kernels.cuda.interpreter import dot_operand, interpreted, round_to

BLOCK_N = 32  # key positions per tile
MIN_DOT = 16  # tl.dot's smallest tile side on GPUs


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, length_ptr, out_ptr,
                   q_row_stride, q_head_stride, out_row_stride, out_head_stride,
                   cache_head_stride, cache_slot_stride, table_stride, scale, window,
                   GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                   INTERPRETED: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    length = tl.load(length_ptr + seq)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + h
    hd_mask = (h < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * q_row_stride + heads[:, None] * q_head_stride + d[None, :], mask=hd_mask, other=0.0)
    dtype = q.dtype
    q = dot_operand(q, dtype, INTERPRETED)
    k_base = k_cache_ptr + kv_head * cache_head_stride
    v_base = v_cache_ptr + kv_head * cache_head_stride
    first = tl.where(window > 0, tl.maximum(length - window, 0), 0)  # the oldest position the token sees
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(first // BLOCK_N * BLOCK_N, length, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = (pos < length) & (pos >= first)
        block = tl.load(table_ptr + seq * table_stride + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_base + slot[:, None] * cache_slot_stride + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(dot_operand(k, dtype, INTERPRETED)), input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * cache_slot_stride + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(dot_operand(p, dtype, INTERPRETED), dot_operand(v, dtype, INTERPRETED),
                                             input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + seq * out_row_stride + heads[:, None] * out_head_stride + d[None, :],
             round_to(out, out_ptr.dtype.element_ty, INTERPRETED), mask=hd_mask)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 stays float32 on GPUs (tl.dot would take tf32); half types ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, scale: float, window: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, heads, head_dim] (one token per sequence), caches [kv_heads, slots, head_dim], block_tables
    [n, max_blocks], context_lens [n] (the new token included) -> [n, heads, head_dim] (into `out` if given)."""
    n, heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    out = torch.empty_like(q) if out is None else out
    if n == 0:
        return out
    group = heads // kv_heads
    _decode_kernel[(n, kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0), scale, window or 0,
        GROUP=group, BLOCK_H=max(MIN_DOT, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
        PRECISION=dot_precision(q.dtype), INTERPRETED=interpreted(q),
    )
    return out
