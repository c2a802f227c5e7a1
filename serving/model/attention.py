"""Paged attention for unmodified transformers models.

The engine registers `paged_attention` in transformers' attention-function registry and switches the
model to it. Each forward pass runs over the step's tokens flattened into one row (prefill chunks and
decode tokens of many sequences together); the per-step `AttentionContext` says which tokens belong to
which sequence, where their keys/values go in the paged cache (slot mapping) and which blocks each
sequence reads (block tables). Because the model's own projections run, quantized Linear layers
(bitsandbytes, torchao, ours) work unchanged.

The cache may hold K/V in 8 bits (`kv_format`): int8 codes with a float16 scale per token and KV head
(absmax / 127), or fp8 e4m3 codes (stored as uint8 bits, no scale). Codes are written in the step that
computes K/V; attention reads only the slots it gathers, folding int8 scales into the scores (K) and the
probabilities (V) rather than dequantizing. A quantized cache also quantizes the step's own K/V before
attending to them, so a token's attention sees the same values whether its context was computed in this
step or read from the cache (chunked prefill, prefix hits and recompute after preemption agree).

Sliding-window layers (Gemma 3's local layers, Mistral, Qwen2 with `use_sliding_window`) attend as
transformers' masks do (`sliding_window_overlay`): the query at position i sees the keys at positions j
with i - window < j <= i, its own and the window - 1 before it. Decode reads only the blocks holding
those; every block of the context stays allocated (full layers, prefix caching).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "quantgate_paged"
KV_FORMATS = ("auto", "int8", "fp8")  # auto: the model's dtype
INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_DTYPE = torch.float16
SCALE_MIN = 2.0**-24  # smallest float16 (subnormal): an all-zero row still gets a nonzero scale


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
    context_lens: torch.Tensor | None = None  # [B] on the CPU; None: read from `pad`
    _windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.pad.shape[1]

    def windowed(self, window: int | None, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables and mask for a layer attending within `window` tokens (None: the whole context):
        blocks before every member's window are dropped, slots before a member's window masked."""
        if not window:
            return self.block_tables, self.pad
        if window not in self._windowed:
            lengths = self.context_lens
            if lengths is None:
                lengths = self.pad.shape[-1] - self.pad[0, :, 0].sum(-1).cpu()
            skip = max(0, int(lengths.min()) - window) // block_size  # blocks no member's window reaches
            tables = self.block_tables.view(self.num_seqs, -1)[:, skip:].reshape(-1)
            pad = self.pad[..., skip * block_size :]
            slots = torch.arange(pad.shape[-1], device=pad.device) + skip * block_size
            starts = (lengths.to(pad.device) - window)[None, :, None, None]
            self._windowed[window] = tables, pad | (slots < starts)
        return self._windowed[window]



@dataclass
class DecodeBatch:
    """Every decode row at once for the compiled kernel (serving/kernels/cpu): it reads blocks in place."""

    block_tables: torch.Tensor  # [n, max_blocks] int64, padded with block 0
    context_lens: torch.Tensor  # [n] int64: tokens each sequence attends to (its new one included)
    kernel: Callable[..., torch.Tensor]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


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
    decode_batch: DecodeBatch | None = None  # instead of decode_groups where the kernel runs
    kv_format: str = "auto"
    k_scale: list[torch.Tensor] | None = None  # int8: per layer [kv_heads, num_blocks * block_size]
    v_scale: list[torch.Tensor] | None = None
    paged: Any = None  # a serving.kernels.cuda.step.PagedStep: the step runs through the Triton kernels instead
    prefill_kernel: Callable[..., torch.Tensor] | None = None  # fresh prompts (prefill_attention*.cpp)
    prefill_dtype: torch.dtype | None = None  # the dtype prefill_kernel takes


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
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))  # what HF's own kernels read
    out = attend(get_context(), module.layer_idx, query[0].transpose(0, 1), key[0], value[0], scaling,
                 window=window)
    return out.unsqueeze(0), None  # [1, tokens, heads, dim], viewed by the caller as [1, tokens, heads * dim]


def attend(ctx: AttentionContext, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scaling: float | None, stored: bool = False, window: int | None = None) -> torch.Tensor:
    """One layer's attention for the step's tokens: q [tokens, heads, dim], key and value [kv_heads, tokens,
    dim]; stores K/V in the cache (unless the caller has: `stored`) and returns [tokens, heads, dim].
    A sliding-window layer passes its `window`: each token then sees only the last `window` positions."""
    if ctx.paged is not None:
        from serving.kernels.cuda.attention import attend as triton_attend

        return triton_attend(ctx.paged, ctx.k_cache[layer], ctx.v_cache[layer], ctx.block_size, ctx.slot_mapping,
                             q, key, value, scaling if scaling is not None else q.shape[-1] ** -0.5, stored, window)
    # [kv_heads, tokens, head_dim], as the cache will return them
    k, v = (key, value) if stored else _write(ctx, layer, key, value)

    gqa = q.shape[1] != k.shape[0]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    outs = [_decode(q, ctx, layer, g, scale, window) for g in ctx.decode_groups]
    if ctx.decode_batch is not None:
        outs.append(_decode_in_place(q, ctx, layer, ctx.decode_batch, scale, window))
    for chunk in ctx.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        qs = q[rows].transpose(0, 1)  # [heads, len, dim]
        ks, vs, mask = _prefill_context(ctx, layer, chunk, k, v, window)
        if mask is None and ctx.prefill_kernel is not None and q.dtype == ctx.prefill_dtype:
            outs.append(ctx.prefill_kernel(q[rows], ks, vs, scale))
            continue
        # 4-D inputs: torch's fused CPU (flash) kernel; 3-D ones fall back to its unfused math path
        # (docs/results/design-figures.md)
        o = F.scaled_dot_product_attention(
            qs[None], ks[None], vs[None], attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=gqa
        )
        outs.append(o[0].transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _prefill_context(ctx: AttentionContext, layer: int, chunk: PrefillChunk, k: torch.Tensor, v: torch.Tensor,
                     window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The K/V a prefill chunk attends to and their mask (None: plain causal over the chunk). Under a
    window, cached positions no token of the chunk sees are not read."""
    start = chunk.context_len - chunk.length  # position of the chunk's first token
    if chunk.context_slots is None:  # the whole context is in this chunk
        rows = slice(chunk.start, chunk.start + chunk.length)
        if not window or chunk.length <= window:
            return k[:, rows], v[:, rows], None
        ks, vs, first = k[:, rows], v[:, rows], 0
    else:
        first = max(0, start - window + 1) if window else 0
        ks, vs = _read(ctx, layer, chunk.context_slots[first:], k.dtype)
    q_pos = torch.arange(start, chunk.context_len, device=k.device)[:, None]
    k_pos = torch.arange(first, chunk.context_len, device=k.device)[None, :]
    mask = q_pos >= k_pos
    return ks, vs, mask & (k_pos > q_pos - window) if window else mask


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., dim] -> int8 codes and a float16 absmax scale per row. The scale is rounded up to float16 and
    the codes divide by the rounded value, so no code clips and every error is within half a step."""
    exact = (x.abs().amax(-1).float() / INT8_MAX).clamp_min_(SCALE_MIN)
    scale = exact.to(SCALE_DTYPE)
    scale = torch.where(scale.float() < exact, torch.nextafter(scale, scale.new_tensor(float("inf"))), scale)
    codes = (x.float() / scale.float()[..., None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def encode_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def decode_fp8(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return bits.view(torch.float8_e4m3fn).to(dtype)


def _write(ctx: AttentionContext, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the step's K/V in their slots; return them as attention will read them back."""
    slots, dtype = ctx.slot_mapping, k.dtype
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    if ctx.kv_format == "auto":
        k_cache.index_copy_(1, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(1, slots, v.to(v_cache.dtype))
        return k, v
    if ctx.kv_format == "fp8":
        kb, vb = encode_fp8(k), encode_fp8(v)
        k_cache.index_copy_(1, slots, kb)
        v_cache.index_copy_(1, slots, vb)
        return decode_fp8(kb, dtype), decode_fp8(vb, dtype)
    out = []
    for x, cache, scales in ((k, k_cache, ctx.k_scale[layer]), (v, v_cache, ctx.v_scale[layer])):
        codes, scale = quantize_int8(x)
        cache.index_copy_(1, slots, codes)
        scales.index_copy_(1, slots, scale)
        out.append(codes.to(dtype) * scale.to(dtype)[..., None])
    return out[0], out[1]


def _read(ctx: AttentionContext, layer: int, slots: torch.Tensor, dtype: torch.dtype):
    """A prefill chunk's cached context, dequantized: only the slots it attends to."""
    ks, vs = ctx.k_cache[layer].index_select(1, slots), ctx.v_cache[layer].index_select(1, slots)
    if ctx.kv_format == "auto":
        return ks.to(dtype), vs.to(dtype)
    if ctx.kv_format == "fp8":
        return decode_fp8(ks, dtype), decode_fp8(vs, dtype)
    k_s = ctx.k_scale[layer].index_select(1, slots).to(dtype)[..., None]
    v_s = ctx.v_scale[layer].index_select(1, slots).to(dtype)[..., None]
    return ks.to(dtype) * k_s, vs.to(dtype) * v_s


def _decode(q, ctx: AttentionContext, layer: int, group: DecodeGroup, scale: float,
            window: int | None = None) -> torch.Tensor:
    """One query token per sequence against its paged context, as two batched matmuls per KV head.

    index_select copies whole blocks (contiguous rows of the head-major cache) into [kv, n, L, dim].
    The query heads sharing a KV head form the rows of one matmul (GQA without repeating K/V); a
    single-row SDPA per sequence pays a call per sequence and head group instead. int8 scales multiply the
    scores and the probabilities ([kv, n, 1, L]), so the codes only change dtype."""
    k_cache, v_cache, bs = ctx.k_cache[layer], ctx.v_cache[layer], ctx.block_size
    tables, pad = group.windowed(window, bs)
    n, length = group.num_seqs, pad.shape[-1]
    kv_heads, head_dim = k_cache.shape[0], k_cache.shape[2]
    ks = _gather(k_cache, bs, tables).view(kv_heads, n, length, head_dim)
    vs = _gather(v_cache, bs, tables).view(kv_heads, n, length, head_dim)
    if ctx.kv_format == "fp8":
        ks, vs = decode_fp8(ks, q.dtype), decode_fp8(vs, q.dtype)
    else:
        ks, vs = ks.to(q.dtype), vs.to(q.dtype)
    heads = q.shape[1]
    qg = q[group.start : group.start + n].view(n, kv_heads, heads // kv_heads, head_dim).transpose(0, 1)
    scores = torch.matmul(qg, ks.transpose(-1, -2)).float().mul_(scale)  # [kv, n, group, L]
    if ctx.kv_format == "int8":
        scores.mul_(_gather(ctx.k_scale[layer], bs, tables).view(kv_heads, n, 1, length))
    scores.masked_fill_(pad, float("-inf"))
    probs = scores.softmax(-1)
    if ctx.kv_format == "int8":
        probs.mul_(_gather(ctx.v_scale[layer], bs, tables).view(kv_heads, n, 1, length))
    out = torch.matmul(probs.to(q.dtype), vs)  # [kv, n, group, dim]
    return out.transpose(0, 1).reshape(n, heads, head_dim)


KERNEL_FORMATS = {"auto": 0, "int8": 1, "fp8": 2}


def _decode_in_place(q, ctx: AttentionContext, layer: int, batch: DecodeBatch, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """The decode rows through the compiled kernel: K/V rows read through the block table, no copies."""
    scales = (ctx.k_scale[layer], ctx.v_scale[layer]) if ctx.kv_format == "int8" else (None, None)
    k_cache = ctx.k_cache[layer]
    rows = q[: batch.num_seqs]
    rows = rows.to(k_cache.dtype) if ctx.kv_format == "auto" else rows  # a cache kept in another float type
    out = batch.kernel(rows.contiguous(), k_cache, ctx.v_cache[layer], batch.block_tables, batch.context_lens,
                       ctx.block_size, scale, *scales, KERNEL_FORMATS[ctx.kv_format], window or 0)
    return out.to(q.dtype)


def _gather(cache: torch.Tensor, block_size: int, block_tables: torch.Tensor) -> torch.Tensor:
    """Whole blocks of a [kv_heads, slots, head_dim] cache or a [kv_heads, slots] scale tensor."""
    kv_heads, slots = cache.shape[:2]
    row = block_size * (cache.shape[2] if cache.dim() == 3 else 1)
    return cache.view(kv_heads, slots // block_size, row).index_select(1, block_tables)


def register() -> str:
    """Make `quantgate_paged` a valid `attn_implementation` for every transformers model."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    return ATTN_IMPLEMENTATION
