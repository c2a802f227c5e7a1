"""Projections that read the same input, run as one matmul: q/k/v, and the MLP's gate/up.

At decode sizes every kernel call has a fixed cost (threads woken, output allocated) and the small k/v
projections (a third of q's width under GQA) are too short to keep every core streaming; one call over
the concatenated weight does both jobs once. The modules keep working on their own: their weights become
views into the fused tensor (slices along the output tiles are contiguous; int4's scales, laid out by group
first, are strided views), so nothing is held twice and `resident_bytes` still counts every byte once. Only
quantgate's own kernel layouts fuse (bf16 pairs, int8, int4 of one group size, W8A8 of one smoothing, no bias,
one kernel path); any other mix returns None and the caller runs the modules. A quantized layer's kernel is
chosen in one place, its format's `WeightOnlyLinear._kernel_call` (serving/model/quant/weight_only.py): the
fused call is that call over the modules' kernel tensors joined along their output channels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from serving.kernels.cpu import wo_fp32
from serving.model.packed_linear import PairPackedLinear, WoLinear
from serving.model.quant.kernel_path import KernelCall, bf16_op
from serving.model.quant.w8a8 import Int8DynamicLinear
from serving.model.quant.weight_only import WeightOnlyLinear

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
        packed = _share(modules, "packed_weight")  # wo_fp32 over the tiled layout: fp32 math, the caller's dtype out
        name = "linear_f32" if packed.dtype == torch.float32 else "linear_bf16"
        return KernelCall(wo_fp32._op(modules[0].isa, name), (packed,), (), False)
    if issubclass(kind, WeightOnlyLinear):
        return _fused_weight_only(modules)
    if kind is Int8DynamicLinear:
        return _fused_dynamic(modules)
    return None


def _fused_weight_only(modules: list[WeightOnlyLinear]) -> KernelCall | None:
    """The modules' own `_kernel_call` over their kernel tensors joined along the output channels, where one
    kernel path (and one int4 group size) serves them all."""
    paths = {m.kernel_path() for m in modules}
    if len(paths) != 1 or len({getattr(m, "group_size", None) for m in modules}) != 1:
        return None
    path, first = paths.pop(), modules[0]
    if len(modules) == 1 or not first._own_kernel():
        return first.kernel_call()  # its own call (no copy), or None where torch's ops serve it
    parts = [m._kernel_tensors(path) for m in modules]
    # int4's scales [K/g, N, 2] join along N: the modules keep strided views, which their own forward copies
    tensors = tuple(_share(modules, name, [p[i] for p in parts], dim)
                    for i, (name, dim) in enumerate(first._kernel_fields(path)))
    return first._kernel_call(path, tensors)


def _fused_dynamic(modules: list[Int8DynamicLinear]) -> KernelCall | None:
    """W8A8 layers reading one input with one smoothing (quantize/w8a8.py gives q/k/v, gate/up one): one op
    over their weights (plain or packed quads), compensations and scales joined along the output channels."""
    first = modules[0]
    if len(modules) == 1 or first.kernel_call() is None:
        return first.kernel_call()
    if any(m.kernel_kind() != first.kernel_kind() or not torch.equal(m.inv_smooth, first.inv_smooth)
           for m in modules[1:]):
        return None
    names = ("_packed", "_compensation", "scales") if first.kernel_kind() == "vnni" else ("weight_int8", "scales")
    tensors = tuple(_share(modules, name) for name in names)
    return KernelCall(first.kernel_op(), (*tensors, first.inv_smooth), (), first.bf16_rows())


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
