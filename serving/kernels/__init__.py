"""quantgate's paged-attention decode kernel for CPU (paged_attention.cpp), built by `quantgate.kernels`.

`paged_decode()` returns `torch.ops.quantgate.paged_decode`, or None where it cannot run: another device,
no compiler, or `QUANTGATE_PAGED_KERNEL=0`; callers then take the torch path.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from quantgate import kernels

SOURCE = Path(__file__).with_name("paged_attention.cpp")


def enabled() -> bool:
    return os.environ.get("QUANTGATE_PAGED_KERNEL", "1") != "0"


def paged_decode(device: torch.device | str = "cpu"):
    """The compiled decode op for this device, or None."""
    if torch.device(device).type != "cpu" or not enabled():
        return None
    if not kernels.load(SOURCE) or not hasattr(torch.ops.quantgate, "paged_decode"):
        return None
    return torch.ops.quantgate.paged_decode
