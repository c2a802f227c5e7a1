"""The decoder stack of Llama-family models (Llama, Qwen2, Mistral), run directly over the model's modules.

transformers' forward makes several times more torch ops and Python module calls per layer than the math
needs, and at batch 1 that Python costs as much as the matmuls. Here a layer is ~12 ops: the
fused RMSNorm, residual-add + RMSNorm and in-place rotary of serving/kernels/cpu (which also writes K and V to
their cache slots when the cache holds the model's dtype), the model's own projection modules (so quantized
layers — ours, bitsandbytes, torchao — run unchanged; in bf16 our kernels' gate_up call writes
silu(gate) * up itself), and paged attention called directly. The math is the model's, rounded where it rounds (fused_ops.cpp; only RMSNorm's variance is
summed in another order), so greedy outputs stay token-identical to HF in fp32. Anything else (another architecture, a pipeline stage's stub layers,
`QUANTGATE_FAST_FORWARD=0`, no compiled ops) runs through the model's own forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantgate import settings
from serving.kernels.cpu.decoder_ops import fused_ops
from serving.model import attention
from serving.model.attention import AttentionContext
from serving.model.decode_step import DecodeStep
from serving.model.fused_linear import Projection, fuse
from serving.model.quant.kernel_path import KernelCall, silu_pair_call

FAST_FORWARD_ENV = settings.FAST_FORWARD.name
# decoder layer class -> what its forward is: pre-norm attention + SwiGLU MLP, RMSNorm, rotary on q and k
LAYER_CLASSES = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer")


def supports(model) -> bool:
    """Whether `LlamaForward` computes exactly what this model's forward does."""
    if not settings.enabled(settings.FAST_FORWARD):
        return False
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(model, "lm_head") or not hasattr(inner, "rotary_emb"):
        return False
    config = model.config
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "pretraining_tp", 1) != 1:
        return False
    if not layers or not all(type(layer).__name__ in LAYER_CLASSES for layer in layers):
        return False
    return compute_dtype(model) in (torch.float32, torch.bfloat16)


def compute_dtype(model) -> torch.dtype:
    """What the hidden states are held in: the norms' dtype (a quantized embedding's codes are not)."""
    return model.model.norm.weight.dtype


Outputs = Callable[[torch.Tensor], Sequence[torch.Tensor]]


@dataclass
class LayerPlan:
    """One decoder layer's callables, looked up once (module attribute access costs more than the math)."""

    input_norm: tuple[torch.Tensor, float]
    post_norm: tuple[torch.Tensor, float]
    qkv: Outputs  # x -> (q, k, v), each [tokens, heads * head_dim]
    o_proj: Projection
    gate_up: Outputs  # x -> (gate, up)
    gate_up_silu: Projection | None  # x -> silu(gate) * up in one call (wo_bf16's formats), bit for bit the same
    down_proj: Projection
    scaling: float
    window: int | None  # sliding-window layers: what the model's forward passes attention as `sliding_window`
    kernels: dict[str, KernelCall]  # by decode_step.SLOTS name: the projections that are one compiled call

    @classmethod
    def of(cls, layer) -> LayerPlan:
        attn, mlp = layer.self_attn, layer.mlp
        calls = _kernel_calls({"qkv": {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj},
                               "o": {"o": attn.o_proj}, "gate_up": {"gate": mlp.gate_proj, "up": mlp.up_proj},
                               "down": {"down": mlp.down_proj}})
        return cls(_norm(layer.input_layernorm), _norm(layer.post_attention_layernorm),
                   _outputs([attn.q_proj, attn.k_proj, attn.v_proj], calls.get("qkv")),
                   calls.get("o") or attn.o_proj.forward, _outputs([mlp.gate_proj, mlp.up_proj], calls.get("gate_up")),
                   silu_pair_call(calls.get("gate_up")),
                   calls.get("down") or mlp.down_proj.forward, attn.scaling, _sliding_window(attn), calls)


def _kernel_calls(groups: dict[str, dict[str, object]]) -> dict[str, KernelCall]:
    """Each group of projections as one fused call, else each member as its own call, where it is one."""
    calls = {}
    for group, members in groups.items():
        fused = fuse(list(members.values()))
        if fused is not None:
            calls[group] = fused
            continue
        for name, module in members.items():
            single = fuse([module]) if len(members) > 1 else None
            if single is not None:
                calls[name] = single
    return calls


def _sliding_window(attn) -> int | None:
    """Qwen2 sets it per layer (None on full ones); Mistral's forward passes its config's to every layer."""
    if type(attn).__name__ == "MistralAttention":
        return attn.config.sliding_window
    return getattr(attn, "sliding_window", None)


def _norm(module) -> tuple[torch.Tensor, float]:
    return module.weight, module.variance_epsilon


def _outputs(modules, fused: KernelCall | None) -> Outputs:
    """One fused call split into each module's columns, or the modules one after another."""
    if fused is None:
        calls = [m.forward for m in modules]
        return lambda x: [call(x) for call in calls]
    sizes = [m.out_features for m in modules]
    return lambda x: fused(x).split(sizes, dim=-1)


def silu_mul_op(ops, dtype: torch.dtype):
    """bf16: fused_ops' silu_mul, F.silu(gate) * up to the bit in one pass (a table of torch's silu); fp32
    keeps torch's two ops (its exp is the one HF's token identity is checked against)."""
    return getattr(ops, "silu_mul", None) if dtype == torch.bfloat16 else None


class LlamaForward:
    def __init__(self, model, ops, isa: str | None = None):
        self.model = model
        self.ops = ops
        self.plans = [LayerPlan.of(layer) for layer in model.model.layers]
        self.final_norm = _norm(model.model.norm)
        self.head_dim = model.model.layers[0].self_attn.head_dim
        self.dtype = compute_dtype(model)
        self.silu_mul = silu_mul_op(ops, self.dtype)
        self.step = DecodeStep.of(self, isa)

    @classmethod
    def of(cls, model, device: torch.device, isa: str | None = None) -> LlamaForward | None:
        ops = fused_ops(device, isa) if supports(model) else None
        return None if ops is None else cls(model, ops, isa)

    def __call__(self, ctx: AttentionContext, input_ids: torch.Tensor, positions: torch.Tensor,
                 keep_rows: torch.Tensor) -> torch.Tensor:
        """Logits [len(keep_rows), vocab] for one step's flattened tokens ([tokens] ids and positions)."""
        model, ops, plans = self.model, self.ops, self.plans
        residual = model.model.embed_tokens(input_ids).to(self.dtype).contiguous()  # [tokens, hidden]
        cos, sin = model.model.rotary_emb(residual[None], positions[None])
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [tokens, head_dim]
        x = ops.rms_norm(residual, *plans[0].input_norm)
        if self.step is not None and self.step.serves(ctx, x.shape[0]):
            return model.lm_head(self.step(ctx, x, residual, cos, sin).index_select(0, keep_rows))
        for i, plan in enumerate(plans):
            out = plan.o_proj(self._attention(ctx, i, plan, x, cos, sin))
            x = ops.add_rms_norm(residual, out.contiguous(), *plan.post_norm)
            out = plan.down_proj(self._mlp_in(plan, x))
            norm = plans[i + 1].input_norm if i + 1 < len(plans) else self.final_norm
            x = ops.add_rms_norm(residual, out.contiguous(), *norm)
        return model.lm_head(x.index_select(0, keep_rows))

    def _mlp_in(self, plan: LayerPlan, x: torch.Tensor) -> torch.Tensor:
        if self.silu_mul is not None and plan.gate_up_silu is not None:
            return plan.gate_up_silu(x)
        gate, up = plan.gate_up(x)
        return self.silu_mul(gate, up) if self.silu_mul is not None else F.silu(gate) * up

    def _attention(self, ctx, layer_idx: int, plan: LayerPlan, x, cos, sin) -> torch.Tensor:
        tokens, dim = x.shape[0], self.head_dim
        q, k, v = plan.qkv(x)
        k_cache, v_cache = ctx.k_cache[layer_idx], ctx.v_cache[layer_idx]
        stored = ctx.kv_format == "auto" and k_cache.dtype == k.dtype  # K/V go to their slots in the same pass
        if stored:
            self.ops.rotary_store(q, k, v, cos, sin, dim, k_cache, v_cache, ctx.slot_mapping)
        else:
            self.ops.rotary(q, k, cos, sin, dim)
        out = attention.attend(ctx, layer_idx, q.view(tokens, -1, dim), k.view(tokens, -1, dim).transpose(0, 1),
                               v.view(tokens, -1, dim).transpose(0, 1), plan.scaling, stored, plan.window)
        return out.reshape(tokens, -1)
