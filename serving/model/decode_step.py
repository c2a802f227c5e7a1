"""A decode step's decoder stack as one compiled call (serving/kernels/cpu/decode_step.cpp).

`LlamaForward` runs each layer's dozen ops from Python; at batch 1 that Python costs about as much as the
matmuls. Where every projection of every layer is one of quantgate's own kernel calls (`KernelCall`), the
fused ops and the paged decode kernel are compiled, the cache holds the model's dtype and the step is
decode only, `DecodeStep` hands the whole stack to the plan: the same ops on the same tensors, called from
C++. Anything else (a prefill row, an 8-bit cache, another projection type) keeps the Python loop.
"""

from __future__ import annotations

import torch

from quantgate import settings
from serving.kernels.cpu import decoder_ops
from serving.model.attention import AttentionContext

SLOTS = ("qkv", "o", "gate_up", "down", "q", "k", "v", "gate", "up")  # decode_step.cpp's `Slot`, in order


class DecodeStep:
    def __init__(self, plan, paged_decode, dtype: torch.dtype):
        self.plan = plan
        self.paged_decode = paged_decode  # the decode op the model runner hands the step: the plan calls it
        self.dtype = dtype

    @classmethod
    def of(cls, forward, isa: str | None) -> DecodeStep | None:
        """The plan for a `LlamaForward`'s model, or None where some part of a layer is not a compiled call
        (or the forward runs on another device: its ops are then not compiled ones)."""
        plans, model = forward.plans, forward.model
        eps = {plan.input_norm[1] for plan in plans} | {plan.post_norm[1] for plan in plans} | {forward.final_norm[1]}
        compiled = all(isinstance(getattr(forward.ops, name, None), torch._ops.OpOverloadPacket)
                       for name in ("add_rms_norm", "rotary_store"))
        heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        whole_heads = model.model.layers[0].self_attn.q_proj.out_features == heads * forward.head_dim
        if not (settings.enabled(settings.DECODE_STEP) and compiled and whole_heads and len(eps) == 1
                and all(plan.kernels for plan in plans)):
            return None
        paged = decoder_ops.paged_decode("cpu", isa)
        plan_class = decoder_ops.decode_plan_class() if paged is not None else None
        if plan_class is None:
            return None
        ops = forward.ops
        plan = plan_class(ops.add_rms_norm.default._schema.name, ops.rotary_store.default._schema.name,
                          paged.default._schema.name, heads, kv_heads, forward.head_dim, eps.pop(),
                          forward.final_norm[0])
        if forward.silu_mul is not None:
            plan.set_silu_mul(forward.silu_mul.default._schema.name)
        for i, layer in enumerate(plans):
            for name, call in layer.kernels.items():
                plan.add_projection(i, SLOTS.index(name), call.op_name, list(call.tensors), list(call.ints),
                                    call.bf16_rows)
            plan.set_layer(i, layer.input_norm[0], layer.post_norm[0], layer.scaling, layer.window or 0)
        if not plan.complete():
            return None
        return cls(plan, paged, forward.dtype)

    def serves(self, ctx: AttentionContext, tokens: int) -> bool:
        """A decode-only step over a cache in the model's dtype, through the kernel the plan calls."""
        batch = ctx.decode_batch
        return (batch is not None and ctx.paged is None and not ctx.prefills and not ctx.decode_groups
                and ctx.kv_format == "auto" and ctx.k_cache[0].dtype == self.dtype and batch.num_seqs == tokens
                and batch.kernel is self.paged_decode)

    def __call__(self, ctx: AttentionContext, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        """The final norm's output [tokens, hidden]; `residual` is updated in place, the cache written."""
        batch = ctx.decode_batch
        return self.plan.run(x, residual, cos, sin, ctx.slot_mapping, batch.block_tables, batch.context_lens,
                             ctx.block_size, ctx.k_cache, ctx.v_cache)
