"""Prefill attention over the paged cache: every prompt chunk of the step in one launch, causal, reading its
cached context (prefix-cache hits, earlier chunks) and its own K/V (stored first) through the block table.

One program per (chunk, tile of BLOCK_M query rows, query head). Query row i of a chunk of `length` tokens
whose sequence holds `context_len` tokens after this step sits at position context_len - length + i and sees
key positions j <= it (and j > it - window on sliding-window layers). Online softmax in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serving.kernels.cuda.decode import MIN_DOT, dot_precision
from serving.kernels.cuda.interpreter import dot_operand, interpreted, round_to

BLOCK_M = 16  # query rows per program
BLOCK_N = 32  # key positions per tile


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, start_ptr, length_ptr, context_ptr, out_ptr,
                    q_row_stride, q_head_stride, out_row_stride, out_head_stride,
                    cache_head_stride, cache_slot_stride, table_stride, scale, window,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    length = tl.load(length_ptr + chunk)
    if tile * BLOCK_M < length:
        row0 = tl.load(start_ptr + chunk)
        context_len = tl.load(context_ptr + chunk)
        i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        q_pos = context_len - length + i
        rows = (row0 + i).to(tl.int64)
        qd_mask = (i < length)[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + rows[:, None] * q_row_stride + head * q_head_stride + d[None, :], mask=qd_mask,
                    other=0.0)
        dtype = q.dtype
        q = dot_operand(q, dtype, INTERPRETED)
        kv_head = head // GROUP
        k_base = k_cache_ptr + kv_head * cache_head_stride
        v_base = v_cache_ptr + kv_head * cache_head_stride
        pos_lo = context_len - length + tile * BLOCK_M  # the tile's first query position
        first = tl.where(window > 0, tl.maximum(pos_lo - window + 1, 0), 0)
        last = tl.minimum(pos_lo + BLOCK_M, context_len)  # keys after the tile's last query are never seen
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(first // BLOCK_N * BLOCK_N, last, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            valid = pos < last
            block = tl.load(table_ptr + chunk * table_stride + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(k_base + slot[:, None] * cache_slot_stride + d[None, :], mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(dot_operand(k, dtype, INTERPRETED)), input_precision=PRECISION) * scale
            seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            seen = seen & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
            scores = tl.where(seen, scores, float("-inf"))
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
        tl.store(out_ptr + rows[:, None] * out_row_stride + head * out_head_stride + d[None, :],
                 round_to(out, out_ptr.dtype.element_ty, INTERPRETED), mask=qd_mask)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  starts: torch.Tensor, lengths: torch.Tensor, context_lens: torch.Tensor, max_length: int,
                  block_size: int, scale: float, window: int | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """q [tokens, heads, head_dim] of the whole step; chunk c's rows are starts[c] .. starts[c] + lengths[c]
    and its sequence holds context_lens[c] tokens (block_tables[c]) once this step's K/V are stored.
    `max_length` (a host int: the longest chunk) sizes the grid. Writes those rows of `out` [tokens, heads,
    head_dim] (a new tensor if None) and returns it."""
    heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q) if out is None else out
    chunks = lengths.shape[0]
    if chunks == 0 or max_length == 0:
        return out
    group = heads // k_cache.shape[0]
    _prefill_kernel[(chunks, triton.cdiv(max_length, BLOCK_M), heads)](
        q, k_cache, v_cache, block_tables, starts, lengths, context_lens, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0), scale, window or 0,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PRECISION=dot_precision(q.dtype),
        INTERPRETED=interpreted(q),
    )
    return out
