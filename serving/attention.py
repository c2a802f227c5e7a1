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
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size], True where attended

    @property
    def num_seqs(self) -> int:
        return self.mask.shape[0]


@dataclass
class AttentionContext:
    k_cache: list[torch.Tensor]  # per layer [num_blocks * block_size, kv_heads, head_dim]
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
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    k_cache.index_copy_(0, ctx.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, ctx.slot_mapping, v.to(v_cache.dtype))

    gqa = q.shape[1] != k.shape[1]
    outs = [_decode(q, k_cache, v_cache, ctx.block_size, g, scaling, gqa) for g in ctx.decode_groups]
    for chunk in ctx.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        qs = q[rows].transpose(0, 1)  # [heads, len, dim]
        if chunk.context_slots is None:  # the whole context is in this chunk: plain causal attention
            ks, vs, mask, causal = k[rows].transpose(0, 1), v[rows].transpose(0, 1), None, True
        else:
            ks = k_cache.index_select(0, chunk.context_slots).transpose(0, 1).to(q.dtype)
            vs = v_cache.index_select(0, chunk.context_slots).transpose(0, 1).to(q.dtype)
            offset = chunk.context_len - chunk.length
            q_pos = torch.arange(chunk.length, device=q.device)[:, None] + offset
            mask, causal = q_pos >= torch.arange(chunk.context_len, device=q.device)[None, :], False
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=gqa
        )
        outs.append(o.transpose(0, 1))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.unsqueeze(0), None  # [1, tokens, heads, dim], viewed by the caller as [1, tokens, heads * dim]


def _decode(q, k_cache, v_cache, block_size: int, group: DecodeGroup, scaling, gqa: bool) -> torch.Tensor:
    """One query token per sequence against its paged context. index_select copies whole blocks
    (contiguous rows of the cache), several times faster on CPU than advanced indexing."""
    n, length = group.num_seqs, group.mask.shape[-1]
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    blocks_k = k_cache.view(-1, block_size, kv_heads, head_dim).index_select(0, group.block_tables)
    blocks_v = v_cache.view(-1, block_size, kv_heads, head_dim).index_select(0, group.block_tables)
    ks = blocks_k.view(n, length, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    vs = blocks_v.view(n, length, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    qd = q[group.start : group.start + n].unsqueeze(2)  # [n, heads, 1, dim]
    o = F.scaled_dot_product_attention(qd, ks, vs, attn_mask=group.mask, scale=scaling, enable_gqa=gqa)
    return o.squeeze(2)  # [n, heads, dim]


def register() -> str:
    """Make `quantgate_paged` a valid `attn_implementation` for every transformers model."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    return ATTN_IMPLEMENTATION
