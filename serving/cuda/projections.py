"""q/k/v and gate/up of plain `nn.Linear` layers as one GEMM each on the Triton path: at decode sizes a
GPU step is launch-bound, and the k/v projections are too small to fill the device on their own. The
weights (and biases, where every module has one) are concatenated once and each module's weight becomes a
view of its rows, so nothing is held twice and the modules still work alone. Quantized layers keep their
own calls."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from serving.llama_forward import LlamaForward, Outputs


def _fused(modules: list) -> Outputs | None:
    if any(type(m) is not torch.nn.Linear for m in modules):
        return None
    biases = [m.bias for m in modules]
    if len({(m.weight.dtype, m.weight.device) for m in modules}) != 1 or len({b is None for b in biases}) != 1:
        return None
    sizes = [m.out_features for m in modules]
    weight = torch.cat([m.weight.detach() for m in modules]).contiguous()
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    start = 0
    for m, n in zip(modules, sizes, strict=True):
        m.weight = torch.nn.Parameter(weight[start : start + n], requires_grad=False)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return lambda x: F.linear(x, weight, bias).split(sizes, dim=-1)


def fuse_projections(forward: LlamaForward) -> int:
    """Fuse every layer's plain q/k/v and gate/up; returns how many groups were fused."""
    fused = 0
    for plan, layer in zip(forward.plans, forward.model.model.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _fused([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up = _fused([mlp.gate_proj, mlp.up_proj])
        if qkv is not None:
            plan.qkv, fused = qkv, fused + 1
        if gate_up is not None:
            plan.gate_up, fused = gate_up, fused + 1
    return fused
