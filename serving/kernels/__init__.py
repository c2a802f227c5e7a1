"""quantgate's CPU kernels for serving, built by `quantgate.kernels`: the paged-attention decode kernel
(paged_attention.cpp) and the decoder's fused small ops (fused_ops.cpp).

`paged_decode()` returns `torch.ops.quantgate.paged_decode`, `fused_ops()` the `torch.ops.quantgate_ops`
namespace, or None where they cannot run: another device, no compiler, or `QUANTGATE_PAGED_KERNEL=0` /
`QUANTGATE_FUSED_OPS=0`; callers then take the torch path.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from quantgate import kernels

SOURCE = Path(__file__).with_name("paged_attention.cpp")
FUSED_SOURCE = Path(__file__).with_name("fused_ops.cpp")


def enabled() -> bool:
    return os.environ.get("QUANTGATE_PAGED_KERNEL", "1") != "0"


def paged_decode(device: torch.device | str = "cpu"):
    """The compiled decode op for this device, or None."""
    if torch.device(device).type != "cpu" or not enabled():
        return None
    if not kernels.load(SOURCE) or not hasattr(torch.ops.quantgate, "paged_decode"):
        return None
    return torch.ops.quantgate.paged_decode


def fused_ops(device: torch.device | str = "cpu"):
    """`torch.ops.quantgate_ops` (rms_norm, add_rms_norm, rotary) for this device, or None."""
    if torch.device(device).type != "cpu" or os.environ.get("QUANTGATE_FUSED_OPS", "1") == "0":
        return None
    if not kernels.load(FUSED_SOURCE, kernels.PRECISE_CFLAGS) or not hasattr(torch.ops.quantgate_ops, "rotary"):
        return None
    return torch.ops.quantgate_ops
