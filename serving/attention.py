"""Paged attention for unmodified transformers models.

The engine registers `paged_attention` in transformers' attention-function registry and switches the
model to it. Each forward pass runs over the step's tokens flattened into one row (prefill chunks and
decode tokens of many sequences together); the per-step `AttentionContext` says which tokens belong to
which sequence, where their keys/values go in the paged cache (slot mapping) and which blocks each
sequence reads (block tables). Because the model's own projections run, quantized Linear layers
(bitsandbytes, torchao, ours) work unchanged.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "quantgate_paged"


@dataclass
class PrefillChunk:
    start: int  # first row of this sequence's tokens in the flattened batch
    length: int  # tokens computed now
    context_len: int  # tokens in the sequence's KV after this step (cached prefix + this chunk)
    context_slots: torch.Tensor | None  # cache slots of the whole context; None when nothing was cached before


@dataclass
class DecodeGroup:
    """Single-token sequences of similar context length, padded only to the longest among them."""

    start: int  # first row; the group's rows are contiguous
    block_tables: torch.Tensor  # [B * max_blocks] flattened, padded with block 0
    pad: torch.Tensor  # [1, B, 1, max_blocks * block_size], True where a slot is past the context

    @property
    def num_seqs(self) -> int:
        return self.pad.shape[1]



@dataclass
class AttentionContext:
    # Per layer [kv_heads, num_blocks * block_size, head_dim]: head-major, so gathering a sequence's
    # blocks for one head yields contiguous [tokens, head_dim] rows that matmul reads without a copy.
    k_cache: list[torch.Tensor]
    v_cache: list[torch.Tensor]
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new token's K/V is written to
    prefills: list[PrefillChunk] = field(default_factory=list)  # their rows follow the decode rows
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # rows 0.. are decode tokens, by group


_local = threading.local()  # per thread: engines stepping on different threads each see their own step


def set_context(context: AttentionContext | None) -> None:
    _local.context = context


def get_context() -> AttentionContext:
    context = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError("paged attention called outside an engine step (no AttentionContext set)")
    return context


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, tokens, head_dim]
    key: torch.Tensor,  # [1, kv_heads, tokens, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    ctx = get_context()
    layer = module.layer_idx
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    q = query[0].transpose(0, 1)  # [tokens, heads, head_dim]
    k, v = key[0], value[0]  # [kv_heads, tokens, head_dim]
    k_cache.index_copy_(1, ctx.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(1, ctx.slot_mapping, v.to(v_cache.dtype))

    gqa = q.shape[1] != k.shape[0]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    outs = [_decode(q, k_cache, v_cache, ctx.block_size, g, scale) for g in ctx.decode_groups]
    for chunk in ctx.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        qs = q[rows].transpose(0, 1)  # [heads, len, dim]
        if chunk.context_slots is None:  # the whole context is in this chunk: plain causal attention
            ks, vs, mask, causal = k[:, rows], v[:, rows], None, True
        else:
            ks = k_cache.index_select(1, chunk.context_slots).to(q.dtype)
            vs = v_cache.index_select(1, chunk.context_slots).to(q.dtype)
            offset = chunk.context_len - chunk.length
            q_pos = torch.arange(chunk.length, device=q.device)[:, None] + offset
            mask, causal = q_pos >= torch.arange(chunk.context_len, device=q.device)[None, :], False
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=gqa
        )
        outs.append(o.transpose(0, 1))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.unsqueeze(0), None  # [1, tokens, heads, dim], viewed by the caller as [1, tokens, heads * dim]


def _decode(q, k_cache, v_cache, block_size: int, group: DecodeGroup, scale: float) -> torch.Tensor:
    """One query token per sequence against its paged context, as two batched matmuls per KV head.

    index_select copies whole blocks (contiguous rows of the head-major cache) into [kv, n, L, dim].
    The query heads sharing a KV head form the rows of one matmul (GQA without repeating K/V); a
    single-row SDPA per sequence was ~10x slower on CPU."""
    n, length = group.num_seqs, group.pad.shape[-1]
    kv_heads, head_dim = k_cache.shape[0], k_cache.shape[2]
    ks = _gather(k_cache, block_size, group.block_tables).view(kv_heads, n, length, head_dim).to(q.dtype)
    vs = _gather(v_cache, block_size, group.block_tables).view(kv_heads, n, length, head_dim).to(q.dtype)
    heads = q.shape[1]
    qg = q[group.start : group.start + n].view(n, kv_heads, heads // kv_heads, head_dim).transpose(0, 1)
    scores = torch.matmul(qg, ks.transpose(-1, -2)).float().mul_(scale)  # [kv, n, group, L]
    scores.masked_fill_(group.pad, float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(q.dtype), vs)  # [kv, n, group, dim]
    return out.transpose(0, 1).reshape(n, heads, head_dim)


def _gather(cache: torch.Tensor, block_size: int, block_tables: torch.Tensor) -> torch.Tensor:
    kv_heads, slots, head_dim = cache.shape
    return cache.view(kv_heads, slots // block_size, block_size * head_dim).index_select(1, block_tables)


def register() -> str:
    """Make `quantgate_paged` a valid `attn_implementation` for every transformers model."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    return ATTN_IMPLEMENTATION
