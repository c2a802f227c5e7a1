"""Where Triton's interpreter (CPU tensors, TRITON_INTERPRET=1) computes otherwise than a GPU, and the
kernels' way around it, switched on by a constexpr `INTERPRETED` that is True only for CPU tensors:
it multiplies bfloat16 tiles in tl.dot wrongly, and it truncates float32 -> bfloat16 where GPUs round to
nearest even. Both workarounds give what the GPU gives."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpreted(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 x rounded to `dtype` to nearest even (the interpreter: the bits rounded first, so its
    truncation is exact)."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def dot_operand(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """x as tl.dot takes it: rounded to `dtype` (the interpreter: then held in float32; products of bf16
    values are exact in float32, which GPUs accumulate in, so the result is the same)."""
    if INTERPRETED:
        y = round_to(x.to(tl.float32), dtype, INTERPRETED).to(tl.float32)
    else:
        y = x.to(dtype)
    return y
