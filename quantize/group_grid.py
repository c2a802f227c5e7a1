"""The int4 layout's grid, for methods that choose their own codes (GPTQ, AWQ, round-to-nearest at 3 bits).

The engine serves w = (q - 8) * scale + zero per group of inputs, scale and zero in bf16, q in 0..15
(serving/model/quant/int4.py). A method here picks q in 0..2**bits - 1 (bits 3 or 4: a 3-bit grid is the same layout
with half the codes unused) against the scale and zero *as stored* (rounded to bf16), so what it optimises
is exactly what the kernels compute.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from serving.model.quant.int4 import pack_nibbles

BITS = (3, 4)


@dataclass
class GroupCodes:
    q: torch.Tensor  # [N, K] uint8 codes in 0..2**bits - 1
    scale: torch.Tensor  # [N, K/g] float32 holding bf16 values
    zero: torch.Tensor  # [N, K/g] float32 holding bf16 values (the value of code 8)

    def layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [N, K/2] uint8, scales_and_zeros [K/g, N, 2] bf16): the int4 layout's two buffers."""
        sz = torch.stack([self.scale, self.zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return pack_nibbles(self.q), sz

    def dequantized(self) -> torch.Tensor:
        n, k = self.q.shape
        groups = self.scale.shape[1]
        q = self.q.view(n, groups, k // groups).float()
        return ((q - 8) * self.scale[..., None] + self.zero[..., None]).view(n, k)


def check_bits(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits must be 3 or 4 (stored in the int4 layout), got {bits!r}")
    return bits


def group_params(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min/max scale and zero of groups `w` [..., g], rounded to bf16 as stored."""
    low, high = torch.aminmax(w, dim=-1)
    scale = ((high - low) / (2**bits - 1)).clamp(min=1e-8)
    zero = low + 8 * scale
    return _bf16(scale), _bf16(zero)


def quantize_with(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of `w` [..., g] on the grid of `scale`, `zero` [...] (float codes in 0..2**bits - 1)."""
    return ((w - zero[..., None]) / scale[..., None] + 8).round().clamp(0, 2**bits - 1)


def dequantize_with(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (q - 8) * scale[..., None] + zero[..., None]


def round_to_nearest(weight: torch.Tensor, group_size: int, bits: int) -> GroupCodes:
    """Plain round-to-nearest per group of `group_size` inputs: the baseline the other methods beat."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    scale, zero = group_params(groups, bits)
    q = quantize_with(groups, scale, zero, bits)
    return GroupCodes(q.reshape(n, k).to(torch.uint8), scale, zero)


def fake_quantize(weight: torch.Tensor, group_size: int, bits: int) -> torch.Tensor:
    """`weight` as round-to-nearest leaves it (float32), for searches that compare candidates."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    scale, zero = group_params(groups, bits)
    scale, zero = scale[..., None], zero[..., None]
    # quantize_with then dequantize_with, the same operations in place: the searches call this per candidate
    out = groups.sub(zero).div_(scale).add_(8).round_().clamp_(0, 2**bits - 1)
    return out.sub_(8).mul_(scale).add_(zero).reshape(n, k)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


@contextmanager
def one_thread() -> Iterator[None]:
    """Thousands of small ops: a thread pool's fork and join per op costs more than the op, and much more
    when the cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
