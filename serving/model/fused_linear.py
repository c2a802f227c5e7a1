"""Projections that read the same input, run as one matmul: q/k/v, and the MLP's gate/up.

At decode sizes every kernel call has a fixed cost (threads woken, output allocated) and the small k/v
projections (a third of q's width under GQA) are too short to keep every core streaming; one call over
the concatenated weight does both jobs once. The modules keep working on their own: their weights become
views into the fused tensor (slices along the output tiles are contiguous; int4's scales, laid out by
group first, are strided views), so nothing is held twice and `resident_bytes` still counts every byte
once. Only quantgate's own kernel layouts fuse (bf16 pairs, int8, int4 of one group size, no bias, one
kernel path); any other mix returns None and the caller runs the modules.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from serving.kernels.cpu import wo_fp32
from serving.model.packed_linear import PairPackedLinear, WoLinear
from serving.model.quant.int4 import Int4WeightOnlyLinear
from serving.model.quant.int8 import Int8WeightOnlyLinear
from serving.model.quant.kernel_path import KernelCall, bf16_op

Projection = Callable[[torch.Tensor], torch.Tensor]


def fuse(modules: list) -> KernelCall | None:
    """One call computing every module's output side by side (for fp32 or bf16 rows), or None. A single
    module gets its own kernel call (no copy)."""
    kinds = {type(m) for m in modules}
    if len(kinds) != 1 or any(getattr(m, "bias", None) is not None for m in modules):
        return None
    kind = kinds.pop()
    if kind is nn.Linear:  # torch's fp32 GEMM, one module at a time (joined, MKL could block it otherwise)
        fp32 = len(modules) == 1 and modules[0].weight.dtype == torch.float32
        return KernelCall(torch.ops.aten.linear.default, (modules[0].weight,), (), False) if fp32 else None
    if kind is PairPackedLinear:
        if len({m.isa for m in modules}) != 1:
            return None
        return KernelCall(bf16_op(modules[0].isa, "bf16"), (_share(modules, "packed_weight"),), (), True)
    if kind is WoLinear and len({(m.isa, m.packed_weight.dtype) for m in modules}) == 1:
        return _fused_wo(modules)
    if kind not in (Int8WeightOnlyLinear, Int4WeightOnlyLinear):
        return None
    paths = {m.kernel_path() for m in modules}
    path = paths.pop() if len(paths) == 1 else None
    if path is not None and path.kind == "wo_fp32":
        return _fused_wo(modules)
    if path is None or path.kind != "wo_bf16":
        return None
    if kind is Int8WeightOnlyLinear:
        tensors = (_share(modules, "_woq_weight"), _share(modules, "scales"))
        return KernelCall(bf16_op(path.isa, "int8"), tensors, (), True)
    if kind is Int4WeightOnlyLinear and len({m.group_size for m in modules}) == 1:
        codes = _share(modules, "_woq_codes")
        # [K/g, N, 2], joined along N: the modules keep strided views, which their own forward would copy
        scales = _share(modules, "scales_and_zeros", [m._scales_for_kernel() for m in modules], dim=1)
        group, n = modules[0].group_size, sum(m.out_features for m in modules)
        return KernelCall(bf16_op(path.isa, "int4"), (codes, scales), (group, n), True)
    return None


def _fused_wo(modules: list) -> KernelCall | None:
    """One wo_linear call over the modules' tiled layouts (fp32 math; the caller's dtype out)."""
    first = modules[0]
    if isinstance(first, WoLinear):
        packed = _share(modules, "packed_weight")
        name = "linear_f32" if packed.dtype == torch.float32 else "linear_bf16"
        return KernelCall(wo_fp32._op(first.isa, name), (packed,), (), False)
    isa = first.kernel_path().isa
    if isinstance(first, Int8WeightOnlyLinear):
        tensors = (_share(modules, "_wo_weight"), _share(modules, "scales"))
        return KernelCall(wo_fp32._op(isa, "linear_int8"), tensors, (), False)
    if len({m.group_size for m in modules}) != 1:
        return None
    codes = _share(modules, "_wo_codes")
    scales = _share(modules, "scales_and_zeros", [m._scales_for_kernel() for m in modules], dim=1)
    return KernelCall(wo_fp32._op(isa, "linear_int4"), (codes, scales), (first.group_size,), False)


def _share(modules: list, name: str, parts: list[torch.Tensor] | None = None, dim: int = 0) -> torch.Tensor:
    """Concatenate `parts` (by default each module's `name` tensor) along `dim` and hand each module back
    its slice of the result (a view) as its `name`, where the dtypes agree."""
    parts = parts if parts is not None else [getattr(m, name) for m in modules]
    if len(parts) == 1:
        return parts[0].contiguous()
    fused = torch.cat(parts, dim=dim).contiguous()
    start = 0
    for m, part in zip(modules, parts, strict=True):
        if getattr(m, name).dtype == fused.dtype:
            setattr(m, name, fused.narrow(dim, start, part.shape[dim]))
        start += part.shape[dim]
    return fused
