"""The Triton path's projections: plain `nn.Linear` q/k/v and gate/up as one GEMM each (at decode sizes a
GPU step is launch-bound, and the k/v projections are too small to fill the device alone), and weight-only
int8 layers (quantize/weight_only.py) through woq.py's dequantize-in-the-GEMM kernel, fused the same way.
Weights, scales and biases are concatenated once and each module's tensors become views of their rows, so
nothing is held twice and the modules still work alone. Other layers (int4, bitsandbytes, torchao) keep
their own calls."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from quantize.weight_only import Int8WeightOnlyLinear
from serving.cuda.woq import int8_linear
from serving.llama_forward import LlamaForward

Projection = Callable[[torch.Tensor], torch.Tensor]


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
    return None


def _split(call: Projection | None, modules: list):
    if call is None:
        return None
    sizes = [m.out_features for m in modules]
    return lambda x: call(x).split(sizes, dim=-1)


def fuse_projections(forward: LlamaForward) -> int:
    """Swap in fused q/k/v and gate/up calls (and int8 o_proj/down_proj); returns how many calls changed."""
    changed = 0
    for plan, layer in zip(forward.plans, forward.model.model.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        calls = {"qkv": _split(_projection(qkv := [attn.q_proj, attn.k_proj, attn.v_proj]), qkv),
                 "gate_up": _split(_projection(gate_up := [mlp.gate_proj, mlp.up_proj]), gate_up)}
        for name, module in (("o_proj", attn.o_proj), ("down_proj", mlp.down_proj)):
            if isinstance(module, Int8WeightOnlyLinear):
                calls[name] = _projection([module])
        for name, call in calls.items():
            if call is not None:
                setattr(plan, name, call)
                changed += 1
    return changed
