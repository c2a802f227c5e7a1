"""Linear layers whose weights are packed once for oneDNN (CPU, bfloat16).

`F.linear` on a bf16 CPU tensor hands oneDNN a plain row-major weight, which it re-lays out into its
blocked format on every call: at decode sizes (a few rows) that reordering reads and writes the whole
weight again, so a memory-bound step moves it ~2x. Packing once at load time removes that (measured on
SmolLM2-135M's 210 projections, one thread: 1.5x at 1 row, 1.7-2.2x at 4-16 rows, 1.1-1.2x at 64-256;
results bit-identical to `F.linear`). This is what IPEX and inductor's CPU freezing do; we do it on the
unmodified model by swapping `nn.Linear` modules, so quantized layers (ours, bitsandbytes) are untouched.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

PACK_ENV = "QUANTGATE_PACK_WEIGHTS"  # "0" keeps plain nn.Linear (to measure what packing buys)


def packing_wanted(device: torch.device, dtype: torch.dtype) -> bool:
    if os.environ.get(PACK_ENV, "1").strip() == "0":
        return False
    return device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight held as an opaque oneDNN tensor (a non-persistent buffer, so
    `resident_bytes` still counts it and nothing is written to checkpoints)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None),
                             persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Swap every plain bf16 `nn.Linear` for a `PackedLinear`; returns how many. Subclasses (bitsandbytes'
    Linear8bitLt is one) and other dtypes keep their own kernels. A weight shared with another module
    (tied embeddings and lm_head) stays shared and unpacked: packing it would hold a second copy."""
    counts: dict[int, int] = {}
    for _, tensor in model.named_parameters(remove_duplicate=False):
        counts[id(tensor)] = counts.get(id(tensor), 0) + 1
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.dtype != torch.bfloat16:
                continue
            if counts.get(id(child.weight), 0) > 1:
                continue
            setattr(parent, name, PackedLinear(child))
            swapped += 1
    return swapped
