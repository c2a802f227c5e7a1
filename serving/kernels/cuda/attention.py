"""One layer's paged attention for a step through the Triton kernels (what serving/model/attention.py's `attend`
hands over to when the step carries a `PagedStep`)."""

from __future__ import annotations

import torch

from serving.kernels.cuda.decode import paged_decode
from serving.kernels.cuda.prefill import paged_prefill
from serving.kernels.cuda.step import PagedStep
from serving.kernels.cuda.store import store_kv


def attend(step: PagedStep, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int,
           slot_mapping: torch.Tensor, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scale: float, stored: bool = False, window: int | None = None) -> torch.Tensor:
    """q [tokens, heads, dim], key and value [kv_heads, tokens, dim]: stores K/V in their slots (unless the
    caller has: `stored`), then decode rows and prefill chunks read the cache -> [tokens, heads, dim]."""
    if not stored:
        store_kv(key, value, k_cache, v_cache, slot_mapping)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    n = step.num_decodes
    if n:
        paged_decode(q[:n], k_cache, v_cache, step.decode_tables, step.decode_lens, block_size, scale, window,
                     out=out[:n])
    if step.num_prefills:
        paged_prefill(q, k_cache, v_cache, step.prefill_tables, step.prefill_starts, step.prefill_lens,
                      step.prefill_context_lens, step.max_prefill_len, block_size, scale, window, out=out)
    return out
