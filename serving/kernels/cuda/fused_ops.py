"""The decoder's small ops as Triton kernels, one launch each (torch_ops.py takes ~8 kernels per norm and
~16 per rotary): RMSNorm, residual add + RMSNorm, and rotary of q and k in place with K and V written to
their cache slots. They round where the model's forward rounds (torch_ops.py, HF's Llama): the residual sum
in the activations' dtype, float32 variance, the normalized row cast back before the weight multiplies it,
rotary's two products and their sum each in the activations' dtype. `TritonOps` has the calls of quantgate's
fused-ops namespace, so `LlamaForward` takes it as its `ops`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serving.kernels.cuda.interpreter import interpreted, round_to


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, x_stride, residual_stride, out_stride, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if ADD:  # residual += x, rounded as the model's add
        x = round_to(tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0).to(tl.float32)
                     + x.to(tl.float32), dtype, INTERPRETED)
        tl.store(residual_ptr + row * residual_stride + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / N
    normed = round_to(h * tl.rsqrt(variance + eps), dtype, INTERPRETED)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = round_to(weight.to(tl.float32) * normed.to(tl.float32), out_ptr.dtype.element_ty, INTERPRETED)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


@triton.jit
def _rotate_rows(ptr, row_stride, token, c1, c2, s1, s2,
                 HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERPRETED: tl.constexpr):
    """One token's heads of q or k rotated in place: x * cos + rotate_half(x) * sin, rounded per op;
    returns the two halves."""
    h = tl.arange(0, BLOCK_HEADS)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < HEADS) & (j < HALF)
    first = ptr + token * row_stride + h * HEAD_DIM + j
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    out1 = round_to(round_to(a1 * c1, dtype, INTERPRETED).to(tl.float32)
                    + round_to(-a2 * s1, dtype, INTERPRETED).to(tl.float32), dtype, INTERPRETED)
    out2 = round_to(round_to(a2 * c2, dtype, INTERPRETED).to(tl.float32)
                    + round_to(a1 * s2, dtype, INTERPRETED).to(tl.float32), dtype, INTERPRETED)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    return out1, out2


@triton.jit
def _rotary_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                         q_stride, k_stride, v_stride, cos_stride, cache_head_stride, cache_slot_stride,
                         HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                         BLOCK_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, STORE: tl.constexpr,
                         INTERPRETED: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    half_mask = j < HALF
    trig = token * cos_stride + j
    c1 = tl.load(cos_ptr + trig, mask=half_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + trig + HALF, mask=half_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + trig, mask=half_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + trig + HALF, mask=half_mask, other=0.0).to(tl.float32)
    _rotate_rows(q_ptr, q_stride, token, c1, c2, s1, s2, HEADS, BLOCK_HEADS, HEAD_DIM, HALF, BLOCK_HALF,
                 INTERPRETED)
    k1, k2 = _rotate_rows(k_ptr, k_stride, token, c1, c2, s1, s2, KV_HEADS, BLOCK_KV, HEAD_DIM, HALF, BLOCK_HALF,
                          INTERPRETED)
    if STORE:  # the rotated K from registers (not read back), V as it is
        slot = tl.load(slot_ptr + token).to(tl.int64)
        h = tl.arange(0, BLOCK_KV)[:, None].to(tl.int64)
        live = tl.where(slot >= 0, 1, 0)  # slot -1: a padding row, nothing written
        k_mask = (h < KV_HEADS) & (j < HALF * live)
        k_at = k_cache_ptr + h * cache_head_stride + slot * cache_slot_stride + j
        tl.store(k_at, k1.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
        tl.store(k_at + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
        d = tl.arange(0, BLOCK_D)[None, :]
        v_mask = (h < KV_HEADS) & (d < HEAD_DIM * live)
        v = tl.load(v_ptr + token * v_stride + h * HEAD_DIM + d, mask=v_mask)
        tl.store(v_cache_ptr + h * cache_head_stride + slot * cache_slot_stride + d,
                 v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        res = residual if residual is not None else x
        _rms_norm_kernel[(rows,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), eps,
                                  N=n, BLOCK=triton.next_power_of_2(n), ADD=residual is not None,
                                  INTERPRETED=interpreted(x))
    return out


def _rotary(q, k, v, cos, sin, head_dim, k_cache=None, v_cache=None, slots=None) -> None:
    tokens = q.shape[0]
    if tokens == 0:
        return
    heads, kv_heads, half = q.shape[1] // head_dim, k.shape[1] // head_dim, head_dim // 2
    store = k_cache is not None
    cache = k_cache if store else q
    _rotary_store_kernel[(tokens,)](
        q, k, v if store else k, cos, sin, cache, v_cache if store else q, slots if store else q,
        q.stride(0), k.stride(0), (v if store else k).stride(0), cos.stride(0),
        cache.stride(0) if store else 0, cache.stride(1) if store else 0,
        HEADS=heads, BLOCK_HEADS=triton.next_power_of_2(heads), KV_HEADS=kv_heads,
        BLOCK_KV=triton.next_power_of_2(kv_heads), HEAD_DIM=head_dim, HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(head_dim), STORE=store,
        INTERPRETED=interpreted(q),
    )


class TritonOps:
    """rms_norm, add_rms_norm, rotary, rotary_store (rows [tokens, width] with unit column stride)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _norm(x, None, weight, eps)

    @staticmethod
    def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place), then its RMSNorm."""
        return _norm(x, residual, weight, eps)

    @staticmethod
    def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
        _rotary(q, k, None, cos, sin, head_dim)

    @staticmethod
    def rotary_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        _rotary(q, k, v, cos, sin, head_dim, k_cache, v_cache, slots)
