"""The decoder's small ops in torch, with the calls of quantgate's fused-ops namespace (rms_norm,
add_rms_norm, rotary, rotary_store): the reference fused_ops.py's Triton kernels are checked against, and a
`LlamaForward` ops namespace for any torch device. Each rounds where the model's forward rounds (HF's LlamaRMSNorm: float32
variance, the normalized row cast back before the weight; rotary in the activations' dtype), so fp32 greedy
outputs stay token-identical to the model's own forward."""

from __future__ import annotations

import torch

from serving.kernels.cuda.store import store_kv


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    """x [tokens, heads * head_dim] (a view into the projection's output) rotated in place."""
    rows = x.view(x.shape[0], -1, head_dim)
    half = head_dim // 2
    rotated = torch.cat((-rows[..., half:], rows[..., :half]), dim=-1)
    rows.copy_(rows * cos[:, None] + rotated * sin[:, None])


class TorchOps:
    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    @staticmethod
    def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place, rounded as the model's add), then its RMSNorm."""
        residual.add_(x)
        return TorchOps.rms_norm(residual, weight, eps)

    @staticmethod
    def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
        _rotate(q, cos, sin, head_dim)
        _rotate(k, cos, sin, head_dim)

    @staticmethod
    def rotary_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """rotary, then K and V written to their cache slots (slot -1: skipped)."""
        TorchOps.rotary(q, k, cos, sin, head_dim)
        tokens = k.shape[0]
        store_kv(k.view(tokens, -1, head_dim).transpose(0, 1), v.view(tokens, -1, head_dim).transpose(0, 1),
                 k_cache, v_cache, slots)
