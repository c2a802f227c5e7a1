"""Which kernel serves a weight-only layer on the path (`serving.kernels.cpu.isa`) it was built under.

`wo_bf16`: serving/kernels/cpu/wo_bf16, bf16 activations, the `amx` or `avx512bf16` build.
`wo_fp32`: serving/kernels/cpu/wo_fp32, fp32 activations, the build for the layer's ISA (avx512, avx2 or
scalar; a bf16 path runs the avx512 build where `wo_bf16`'s shape rules do not fit).
`torch`: torch's own ops (another device, `QUANTGATE_ISA=torch`, no compiler, shapes no kernel takes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.kernels.cpu import isa as isas
from serving.kernels.cpu import wo_bf16, wo_fp32


@dataclass(frozen=True)
class KernelPath:
    kind: str  # "wo_bf16" | "wo_fp32" | "torch": the kernel family
    isa: str  # the instruction set it runs on ("torch" for torch's ops)


TORCH = KernelPath("torch", "torch")


def choose(isa: str, device: torch.device, fits_woq: bool, fits_wo: bool) -> KernelPath:
    if device.type != "cpu" or isa == "torch":
        return TORCH
    if isa in isas.BF16_PATHS:
        if fits_woq and wo_bf16.available(isa=isa):
            return KernelPath("wo_bf16", isa)
        isa = "avx512"
    if fits_wo and wo_fp32.available(isa):
        return KernelPath("wo_fp32", isa)
    return TORCH


def wide_compute_dtype(x_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What torch's dequantize-then-matmul fallback computes in: bf16 for fp32 inputs only where the CPU
    multiplies bf16 natively (elsewhere a bf16 matmul is tens of times slower than fp32)."""
    if x_dtype == torch.float32 and device.type == "cpu" and isas.native_bf16():
        return torch.bfloat16
    return x_dtype
