"""The step's keys and values written to their cache slots: one program per (token, KV head)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                  key_head_stride, key_token_stride, value_head_stride, value_token_stride,
                  cache_head_stride, cache_slot_stride,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < tl.where(slot >= 0, HEAD_DIM, 0)  # slot -1: a padding row of a captured batch
    k = tl.load(key_ptr + head * key_head_stride + token * key_token_stride + d, mask=mask)
    v = tl.load(value_ptr + head * value_head_stride + token * value_token_stride + d, mask=mask)
    cache_offset = head * cache_head_stride + slot * cache_slot_stride + d
    tl.store(k_cache_ptr + cache_offset, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offset, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key and value [kv_heads, tokens, head_dim] (any token and head strides) into caches
    [kv_heads, slots, head_dim] at `slot_mapping` [tokens]."""
    kv_heads, tokens, head_dim = key.shape
    if tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _store_kernel[(tokens, kv_heads)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
    )
