"""Calibrated int4 over a whole model: GPTQ or AWQ (or plain round-to-nearest) decoder layer by decoder layer.

The calibration tokens run through the model once to record each decoder layer's keyword inputs
(attention mask, rotary embeddings); then the hidden states are carried layer by layer: each layer is
quantized on the inputs it gets from the layers before it *as quantized*, and its quantized output feeds
the next. Inside a layer the linears that read the same tensor form a stage (q/k/v, o, gate/up, down on a
Llama), found by watching one forward. GPTQ quantizes stage after stage, each on inputs that already went
through the quantized stages before it; AWQ searches a scale per stage on the layer's float inputs and folds
it into the norm or linear before the stage. Weights end as their dequantized values in place, with their
codes kept by name for the int4 layout (quantize/calibrated_build.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from quantize import awq
from quantize.gptq import DEFAULT_DAMP, Hessian, gptq_quantize
from quantize.group_grid import GroupCodes, check_bits, round_to_nearest
from serving.kernels.cpu.isa import native_bf16
from serving.model.quant.int8 import int4_fits

log = logging.getLogger(__name__)

ALGORITHMS = ("rtn", "gptq", "awq")
# AWQ folds scales into the weight of an RMSNorm computing x * w, or Gemma 3's x * (1 + w) (awq.norm_offset).
AWQ_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


@dataclass(frozen=True)
class Recipe:
    algorithm: str
    group_size: int
    bits: int = 4
    damp: float = DEFAULT_DAMP
    grid: int = awq.DEFAULT_GRID
    quantize_lm_head: bool = True
    gptq_lm_head: bool = True  # False: the lm_head (and a tied embedding) round-to-nearest under GPTQ too

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        check_bits(self.bits)
        if not 0 < self.damp < 1:
            raise ValueError(f"damp must be in (0, 1), got {self.damp!r}")
        if not 1 <= self.grid <= 100:
            raise ValueError(f"grid must be 1..100 points, got {self.grid!r}")


class _Stop(Exception):
    """Raised by a hook once it has what it came for: the rest of the forward is not needed."""


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(model).__name__} has no model.layers: calibrated int4 needs a decoder stack")
    return "model.layers", layers


def check_architecture(model: nn.Module, recipe: Recipe) -> None:
    decoder_layers(model)
    model_type = getattr(model.config, "model_type", None)
    if recipe.algorithm == "awq" and model_type not in AWQ_MODEL_TYPES:
        raise ValueError(f"int4-awq folds its scales into RMSNorm weights as {', '.join(AWQ_MODEL_TYPES)} "
                         f"define them; {model_type!r} is not supported (use int4-gptq)")


def layer_kwargs(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
    """The first layer's input hidden states and every layer's keyword inputs, from one float forward."""
    _, layers = decoder_layers(model)
    first: list[torch.Tensor] = []
    kwargs: list[dict] = []

    def record(module, args, kw):
        if not first:
            first.append(args[0] if args else kw["hidden_states"])
        kwargs.append({k: v for k, v in kw.items() if k != "hidden_states"})
        if len(kwargs) == len(layers):
            raise _Stop

    handles = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in layers]
    try:
        model(input_ids=ids, use_cache=False)
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return first[0], kwargs


def run_layer(layer: nn.Module, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(x, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def calibration_forward(layer: nn.Module, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """A layer over the calibration tokens: its matmuls in bf16 where the CPU multiplies bf16 natively (as the
    engine serves there, and as GPU calibration runs in half precision), weights and residual stream fp32.
    Two of these per layer were ~40 % of an int4-awq build in fp32; the statistics they feed (mean |x|,
    output errors, Hessians) do not need more than bf16's 8 bits of mantissa."""
    if native_bf16() and x.dtype == torch.float32:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return run_layer(layer, x, kwargs)
    return run_layer(layer, x, kwargs)


def discover_stages(layer: nn.Module, x: torch.Tensor, kwargs: dict) -> tuple[list[list[str]], dict[str, torch.Tensor]]:
    """The layer's linears grouped by the tensor they read, in call order, and each stage's float input."""
    linears = {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
    seen: dict[int, tuple[list[str], torch.Tensor]] = {}

    def hook(name):
        def record(module, args):
            seen.setdefault(id(args[0]), ([], args[0]))[0].append(name)  # the tensor is held: no id reuse
        return record

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in linears.items()]
    try:
        calibration_forward(layer, x, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    stages = [names for names, _ in seen.values()]
    return stages, {names[0]: tensor for names, tensor in seen.values()}


@torch.no_grad()
def calibrate(model: nn.Module, ids: torch.Tensor, recipe: Recipe, show_progress: bool = True) -> dict[str, GroupCodes]:
    """Quantize every linear that fits the int4 layout, in place (dequantized values); returns their codes."""
    from tqdm import tqdm

    check_architecture(model, recipe)
    prefix, layers = decoder_layers(model)
    x, kwargs = layer_kwargs(model, ids) if recipe.algorithm != "rtn" else (None, [{}] * len(layers))
    codes: dict[str, GroupCodes] = {}
    bar = tqdm(layers, desc=f"int4-{recipe.algorithm}", unit="layer", disable=not show_progress or None)
    for index, layer in enumerate(bar):
        for name, group_codes in quantize_layer(layer, x, kwargs[index], recipe).items():
            codes[f"{prefix}.{index}.{name}"] = group_codes
        if x is not None:
            x = calibration_forward(layer, x, kwargs[index])
        log.info("int4-%s: layer %d/%d quantized", recipe.algorithm, index + 1, len(layers))
    head_name, head = head_to_quantize(model, recipe)
    if head is not None:
        codes[head_name] = head_codes(head.weight, model.model.norm(x) if x is not None else None, recipe)
        _set_weight(head, codes[head_name])
    return codes


def quantize_layer(layer: nn.Module, x: torch.Tensor | None, kwargs: dict, recipe: Recipe) -> dict[str, GroupCodes]:
    """One decoder layer's fitting linears quantized in place (dequantized values) on its inputs `x`;
    their codes by name within the layer."""
    fitting = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear) and int4_fits(m, recipe.group_size)}
    if recipe.algorithm == "gptq":
        found = _gptq_layer(layer, x, kwargs, fitting, recipe)
    elif recipe.algorithm == "awq":
        found = _awq_layer(layer, x, kwargs, fitting, recipe)
    else:
        found = {n: round_to_nearest(m.weight, recipe.group_size, recipe.bits) for n, m in fitting.items()}
    for name, group_codes in found.items():
        _set_weight(fitting[name], group_codes)
    return found


def head_codes(weight: torch.Tensor, normed: torch.Tensor | None, recipe: Recipe) -> GroupCodes:
    """The lm_head's codes: GPTQ on the final normed hidden states (under GPTQ), else round-to-nearest."""
    if recipe.algorithm == "gptq" and recipe.gptq_lm_head and normed is not None:
        hessian = Hessian(weight.shape[1])
        hessian.add(normed)
        return gptq_quantize(weight, hessian.matrix(), recipe.group_size, recipe.bits, recipe.damp)
    return round_to_nearest(weight, recipe.group_size, recipe.bits)


def head_to_quantize(model: nn.Module, recipe: Recipe) -> tuple[str | None, nn.Linear | None]:
    head = model.get_output_embeddings()
    if not recipe.quantize_lm_head or not isinstance(head, nn.Linear) or not int4_fits(head, recipe.group_size):
        return None, None
    if recipe.algorithm == "gptq" and not isinstance(getattr(model.model, "norm", None), nn.Module):
        raise ValueError(f"{type(model).__name__} has no model.norm before its lm_head for GPTQ's inputs")
    return next(n for n, m in model.named_modules() if m is head), head


def _set_weight(linear: nn.Linear, group_codes: GroupCodes) -> None:
    linear.weight.data.copy_(group_codes.dequantized().to(linear.weight.dtype))


def _gptq_layer(layer: nn.Module, x: torch.Tensor, kwargs: dict, fitting: dict[str, nn.Linear],
                recipe: Recipe) -> dict[str, GroupCodes]:
    """Stage by stage: each stage's Hessian from inputs that passed the stages already quantized."""
    stages, inputs = discover_stages(layer, x, kwargs)
    found: dict[str, GroupCodes] = {}
    for number, stage in enumerate(stages):
        names = [n for n in stage if n in fitting]
        if not names:
            continue
        hessian = Hessian(fitting[names[0]].in_features)
        if number == 0:
            hessian.add(inputs[stage[0]])
        else:
            _capture(layer, x, kwargs, layer.get_submodule(stage[0]), hessian)
        # rows are independent given the Hessian: the stage's linears are one matrix to GPTQ
        weight = torch.cat([fitting[n].weight.detach().float() for n in names])
        stacked = gptq_quantize(weight, hessian.matrix(), recipe.group_size, recipe.bits, recipe.damp)
        start = 0
        for name in names:
            rows = slice(start, start + fitting[name].out_features)
            found[name] = GroupCodes(stacked.q[rows], stacked.scale[rows], stacked.zero[rows])
            _set_weight(fitting[name], found[name])
            start = rows.stop
    return found


def _capture(layer: nn.Module, x: torch.Tensor, kwargs: dict, linear: nn.Module, hessian: Hessian) -> None:
    def record(module, args):
        hessian.add(args[0])
        raise _Stop

    handle = linear.register_forward_pre_hook(record)
    try:
        calibration_forward(layer, x, kwargs)
    except _Stop:
        pass
    finally:
        handle.remove()


def _awq_layer(layer: nn.Module, x: torch.Tensor, kwargs: dict, fitting: dict[str, nn.Linear],
               recipe: Recipe) -> dict[str, GroupCodes]:
    """Scales searched per stage on the float inputs and folded; then round-to-nearest on the new grid."""
    stages, inputs = discover_stages(layer, x, kwargs)
    for stage in stages:
        previous = _previous_op(layer, stage)
        names = [n for n in stage if n in fitting]
        if previous is None or not names:
            continue
        rows = inputs[stage[0]].reshape(-1, inputs[stage[0]].shape[-1])
        choice = awq.search_scales(_rows(rows, awq.SEARCH_ROWS), [fitting[n].weight for n in names],
                                   recipe.group_size, recipe.bits, recipe.grid, x_mean=rows.abs().float().mean(0))
        if choice.alpha is None:
            continue
        linears = [layer.get_submodule(n) for n in stage]
        if isinstance(previous, nn.Linear):
            awq.fold_into_linear(previous, linears, choice.scales)
        else:
            awq.fold_into_norm(previous, linears, choice.scales)
    return {n: round_to_nearest(m.weight, recipe.group_size, recipe.bits) for n, m in fitting.items()}


def _previous_op(layer: nn.Module, stage: list[str]) -> nn.Module | None:
    """What produces a stage's input and can absorb 1/s: the norm before q/k/v or gate/up (Gemma 3's
    `pre_feedforward_layernorm`: its `post_attention_layernorm` norms o_proj's output), v before o (only
    without grouped-query attention: otherwise v's rows feed several heads), up before down."""
    names = set(stage)
    if "self_attn.q_proj" in names:
        return getattr(layer, "input_layernorm", None)
    if "mlp.gate_proj" in names or "mlp.up_proj" in names:
        norm = getattr(layer, "pre_feedforward_layernorm", None)
        return norm if norm is not None else getattr(layer, "post_attention_layernorm", None)
    if names == {"self_attn.o_proj"}:
        v, o = layer.self_attn.v_proj, layer.self_attn.o_proj
        return v if v.out_features == o.in_features else None
    if names == {"mlp.down_proj"}:
        return layer.mlp.up_proj
    return None


def _rows(x: torch.Tensor, count: int) -> torch.Tensor:
    """`count` rows spread evenly over the calibration rows (fixed, not random)."""
    flat = x.reshape(-1, x.shape[-1])
    step = max(1, flat.shape[0] // count)
    return flat[::step][:count]
