"""Which kernel serves a weight-only layer on the path (`quantgate.kernels.isa`) it was built under.

`woq`: quantgate/kernels/woq_linear, bf16 activations, the `amx` or `avx512bf16` build.
`wo`: quantgate/kernels/wo_linear, fp32 activations, the build for the layer's ISA (avx512, avx2 or
scalar; a bf16 path runs the avx512 build where `woq`'s shape rules do not fit).
`torch`: torch's own ops (another device, `QUANTGATE_ISA=torch`, no compiler, shapes no kernel takes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantgate.kernels import isa as isas
from quantgate.kernels import wo_linear as wo
from quantgate.kernels import woq


@dataclass(frozen=True)
class KernelPath:
    kind: str  # "woq" | "wo" | "torch"
    isa: str  # the instruction set it runs on ("torch" for torch's ops)


TORCH = KernelPath("torch", "torch")


def choose(isa: str, device: torch.device, fits_woq: bool, fits_wo: bool) -> KernelPath:
    if device.type != "cpu" or isa == "torch":
        return TORCH
    if isa in isas.BF16_PATHS:
        if fits_woq and woq.available(isa=isa):
            return KernelPath("woq", isa)
        isa = "avx512"
    if fits_wo and wo.available(isa):
        return KernelPath("wo", isa)
    return TORCH


def wide_compute_dtype(x_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What torch's dequantize-then-matmul fallback computes in: bf16 for fp32 inputs only where the CPU
    multiplies bf16 natively (elsewhere a bf16 matmul is tens of times slower than fp32)."""
    if x_dtype == torch.float32 and device.type == "cpu" and isas.native_bf16():
        return torch.bfloat16
    return x_dtype
