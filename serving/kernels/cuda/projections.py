"""The Triton path's projections: plain `nn.Linear` q/k/v and gate/up as one GEMM each (at decode sizes a
GPU step is launch-bound, and the k/v projections are too small to fill the device alone), and weight-only
int8 and int4 layers (quantize/) through woq.py's dequantize-in-the-GEMM kernels, fused the same way.
Weights, scales and biases are concatenated once and each module's tensors become views of their rows, so
nothing is held twice and the modules still work alone (int4's small scale tables are concatenated by
output column into a copy). Other layers (bitsandbytes, torchao, a dropped plain layout) keep their own
calls."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from serving.kernels.cuda.wo_gemm import int4_linear, int8_linear
from serving.model.llama_forward import LlamaForward
from serving.model.quant.int4 import Int4WeightOnlyLinear
from serving.model.quant.int8 import Int8WeightOnlyLinear

Projection = Callable[[torch.Tensor], torch.Tensor]
WEIGHT_ONLY = (Int8WeightOnlyLinear, Int4WeightOnlyLinear)


def _share(modules: list, name: str) -> torch.Tensor | None:
    """Every module's `name` tensor concatenated by rows, each module handed back a view of its rows."""
    parts = [getattr(m, name) for m in modules]
    if parts[0] is None:
        return None
    fused = torch.cat([p.detach() for p in parts]).contiguous()
    start = 0
    for m, part in zip(modules, parts, strict=True):
        view = fused[start : start + part.shape[0]]
        setattr(m, name, torch.nn.Parameter(view, requires_grad=False) if isinstance(part, torch.nn.Parameter)
                else view)
        start += part.shape[0]
    return fused


def _projection(modules: list) -> Projection | None:
    """One call computing the modules' outputs side by side, or None (another kind, mixed dtypes)."""
    kinds = {type(m) for m in modules}
    if len(kinds) != 1 or len({m.bias is None for m in modules}) != 1:
        return None
    kind = kinds.pop()
    if kind is torch.nn.Linear and len({(m.weight.dtype, m.weight.device) for m in modules}) == 1:
        weight, bias = _share(modules, "weight"), _share(modules, "bias")
        return lambda x: F.linear(x, weight, bias)
    if kind is Int8WeightOnlyLinear and all(m.weight_int8.numel() for m in modules):
        codes, scales, bias = _share(modules, "weight_int8"), _share(modules, "scales"), _share(modules, "bias")
        return lambda x: int8_linear(x, codes, scales, bias)
    if (kind is Int4WeightOnlyLinear and all(m.codes.numel() for m in modules)
            and len({m.group_size for m in modules}) == 1):
        group = modules[0].group_size
        sz = torch.cat([m.scales_and_zeros for m in modules], dim=1).contiguous()
        codes, bias = _share(modules, "codes"), _share(modules, "bias")
        return lambda x: int4_linear(x, codes, sz, group, bias)
    return None


def _outputs(modules: list):
    """x -> each module's output: one fused call split by columns; where the modules do not fuse (say int4
    q beside bf16 k/v), each weight-only module through its kernel and the rest as they are; None: unchanged."""
    fused = _projection(modules)
    if fused is not None:
        sizes = [m.out_features for m in modules]
        return lambda x: fused(x).split(sizes, dim=-1)
    if not any(isinstance(m, WEIGHT_ONLY) for m in modules):
        return None
    calls = [(_projection([m]) if isinstance(m, WEIGHT_ONLY) else None) or m.forward for m in modules]
    return lambda x: [call(x) for call in calls]


def fuse_projections(forward: LlamaForward) -> int:
    """Swap in fused q/k/v and gate/up calls (and int8/int4 o_proj, down_proj); returns how many changed."""
    changed = 0
    for plan, layer in zip(forward.plans, forward.model.model.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        calls = {"qkv": _outputs([attn.q_proj, attn.k_proj, attn.v_proj]),
                 "gate_up": _outputs([mlp.gate_proj, mlp.up_proj])}
        for name, module in (("o_proj", attn.o_proj), ("down_proj", mlp.down_proj)):
            if isinstance(module, WEIGHT_ONLY):
                calls[name] = _projection([module])
        for name, call in calls.items():
            if call is not None:
                setattr(plan, name, call)
                changed += 1
    return changed
