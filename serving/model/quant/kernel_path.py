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
class KernelCall:
    """One compiled linear op with its weights bound: `op(rows, *tensors, *ints)`. A wo_bf16 op (`bf16_rows`)
    reads bf16 rows and writes `wo_bf16.out_dtype` of the input's dtype (its last int); a wo_fp32 op (or
    torch's own linear over an fp32 weight) reads fp32 rows and writes fp32, cast back to the input's dtype.
    A layer's own call (`WeightOnlyLinear.kernel_call`) and a fused projection's (serving/model/fused_linear.py)
    are both one of these; the decode-step plan (serving/kernels/cpu/decode_step.cpp) calls the same op with
    the same arguments."""

    op: torch._ops.OpOverload
    tensors: tuple[torch.Tensor, ...]
    ints: tuple[int, ...]
    bf16_rows: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16_rows:
            return self.op(x.to(torch.bfloat16).contiguous(), *self.tensors, *self.ints, wo_bf16.out_dtype(x.dtype))
        rows = x if x.dtype is torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
        return self.op(rows, *self.tensors, *self.ints).to(x.dtype)

    @property
    def op_name(self) -> str:
        return self.op._schema.name


def bf16_op(isa: str | None, kind: str) -> torch._ops.OpOverload:
    """The wo_bf16 op for weights of `kind` ("int8", "int4", "bf16"; "<kind>_silu": silu_pair_call's) on path `isa`."""
    return getattr(wo_bf16._kernel(isa), kind)


SILU_OPS = {f"woq_linear_{kind}": f"woq_linear_{kind}_silu" for kind in ("bf16", "int8", "int4")}


def silu_pair_call(gate_up: KernelCall | None) -> KernelCall | None:
    """`gate_up` (one call over the gate's then the up's channels) with silu(gate) * up in its epilogue, where
    its kernel has one (wo_bf16's bf16, int8, int4): the call then writes half the bytes and skips a pass over them."""
    if gate_up is None or not gate_up.bf16_rows:
        return None
    namespace, name = gate_up.op_name.split("::")
    if name not in SILU_OPS or gate_up.tensors[0].shape[0] % 2:
        return None
    op = getattr(getattr(torch.ops, namespace), SILU_OPS[name]).default
    return KernelCall(op, gate_up.tensors, gate_up.ints, True)


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
