"""int4-gptq / int4-awq built one decoder layer at a time, straight into int4wo's variant file.

The in-memory build (quantize/calibrated_build.py) loads the whole model; here the model is a skeleton whose
parameters stay on the meta device (buffers such as the rotary tables are real). The calibration tokens
run once through the embedding with every decoder layer passing its input through, which records each
layer's keyword inputs; then layer by layer: its weights are read from the source's safetensors, it is
calibrated and quantized by the same code as the in-memory build (quantize/calibrated.py `quantize_layer`),
its tensors are written at their places in `int4wo.safetensors` (the header comes from int4wo's streamed
plan: quantize/streaming.py), the quantized layer carries the hidden states on, and it goes back to meta.
The embedding and lm_head are round-to-nearest from source row blocks (GPTQ's head from its Hessian).

Memory: one decoder layer in the build's dtype beside the calibration hidden states, plus the head while
GPTQ quantizes it. The probe runs a fixed input through the source's layers and the quantized ones side by
side as they pass and compares the logits: the same check, and threshold, as the in-memory build's.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantize import streaming
from quantize.calibrated import (
    GroupCodes,
    Recipe,
    calibration_forward,
    check_architecture,
    decoder_layers,
    head_codes,
    head_to_quantize,
    quantize_layer,
    run_layer,
)
from quantize.group_grid import round_to_nearest
from quantize.variant_writer import VariantWriter

log = logging.getLogger(__name__)


def stream_calibrated(source: Path, opts: dict[str, Any], recipe: Recipe, out: Path,
                      show_progress: bool = True) -> dict[str, Any] | None:
    """Build the variant into `out`; returns the manifest's "tensors", "probe" and the algorithm record, or
    None where the source is not streamable (the in-memory build then runs)."""
    from quantize.probe import check_layer_by_layer

    if not streaming.streamable(source):
        return None
    try:
        plan = streaming.plan_stream(source, "int4wo", _int4wo_options(opts))
    except streaming.NotStreamable as exc:
        log.warning("%s; building int4-%s in memory", exc, recipe.algorithm)
        return None
    model = skeleton(source, plan.dtype)
    check_architecture(model, recipe)
    ids, calibration = _calibration(source, opts, recipe)
    started = time.perf_counter()
    path = out / streaming.WEIGHTS_FILES["int4wo"]
    with streaming.variant_file(plan, path) as writer:
        run = _LayerRun(model, plan, writer, recipe)
        run.all_layers(ids, show_progress)
        logits_float, logits_quantized = run.outer_tensors()
    streaming.write_configs(plan, out)
    probe = check_layer_by_layer(logits_quantized, logits_float, f"int4-{recipe.algorithm}")
    record: dict[str, Any] = {"algorithm": {"name": recipe.algorithm, **recipe.__dict__,
                                            "seconds": round(time.perf_counter() - started, 3),
                                            "streamed": "one decoder layer at a time"}}
    if calibration is not None:
        record["calibration"] = calibration
    return {"tensors": plan.table, "record": record,
            "probe": {"kind": "layer by layer", "logit_cosine": probe.cosine,
                      "top1_agreement": probe.top1_agreement, "layers": run.layer_errors}}


def _int4wo_options(opts: dict[str, Any]) -> dict[str, Any]:
    return {k: opts[k] for k in ("group_size", "quantize_lm_head", "quantize_embeddings", "dtype")}


def skeleton(source: Path, dtype: torch.dtype) -> nn.Module:
    """The source's model with every parameter on the meta device and its buffers (rotary tables) real."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantgate.loading import model_construction

    config = AutoConfig.from_pretrained(source)
    with model_construction(), init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _calibration(source: Path, opts: dict[str, Any], recipe: Recipe) -> tuple[torch.Tensor | None, Any]:
    if recipe.algorithm == "rtn":
        return None, None
    from transformers import AutoTokenizer

    from quantize.calibration import calibration_set

    found = calibration_set(AutoTokenizer.from_pretrained(source), int(opts["calibration_tokens"]),
                            int(opts["seq_len"]))
    return found.ids, found.record


def materialise(module: nn.Module, prefix: str, plan: streaming.Plan, aliases: dict[str, str]) -> None:
    """Read `module`'s parameters (named `prefix` + name in the source) in the build's dtype."""
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, _ in module.named_parameters():
        key = prefix + name
        key = key if key in plan.source.files else aliases.get(key, key)
        if key not in plan.source.files:
            raise streaming.NotStreamable(f"{plan.source.directory}: no tensor {prefix + name!r} in its safetensors")
        by_file.setdefault(plan.source.files[key], []).append((name, key))
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as handle:
            for name, key in names:
                owner, _, attr = name.rpartition(".")
                target = module.get_submodule(owner) if owner else module
                value = handle.get_tensor(key).to(plan.dtype)
                target._parameters[attr] = nn.Parameter(value, requires_grad=False)


def pass_through(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
    """The first layer's input and every layer's keyword inputs, with each decoder layer (still on meta)
    passing its input through: the embedding, masks and rotary tables are the only work done."""
    _, layers = decoder_layers(model)
    first: list[torch.Tensor] = []
    kwargs: list[dict] = []

    def record(*args: Any, **kw: Any) -> torch.Tensor:
        hidden_states = args[0] if args else kw.pop("hidden_states")
        first.append(hidden_states)
        kwargs.append(kw)
        return hidden_states

    for layer in layers:
        layer.forward = record
    try:
        with torch.no_grad():
            model.model(input_ids=ids, use_cache=False)
    finally:
        for layer in layers:
            del layer.forward
    if len(kwargs) != len(layers):
        raise ValueError(f"{type(model).__name__}: {len(kwargs)} of {len(layers)} decoder layers were called")
    return first[0], kwargs


class _LayerRun:
    """The walk through the decoder layers and the tensors outside them, writing as it goes."""

    def __init__(self, model: nn.Module, plan: streaming.Plan, writer: VariantWriter, recipe: Recipe):
        self.model, self.plan, self.writer, self.recipe = model, plan, writer, recipe
        self.prefix, self.layers = decoder_layers(model)
        self.aliases = tied_aliases(model)
        self.layer_errors: list[float] = []
        self.normed: torch.Tensor | None = None

    def all_layers(self, ids: torch.Tensor | None, show_progress: bool) -> None:
        from tqdm import tqdm

        from quantize.probe import probe_ids

        inner = self.model.model
        outer = [(n, m) for n, m in inner.named_children() if n != "layers" and any(True for _ in m.parameters())]
        for name, module in outer:  # the embedding and the final norm: small beside the layers
            materialise(module, f"model.{name}.", self.plan, self.aliases)
        probe = torch.tensor([probe_ids(self.model.config.vocab_size)])
        h_float, probe_kwargs = pass_through(self.model, probe)
        x, kwargs = pass_through(self.model, ids) if ids is not None else (None, [{}] * len(self.layers))
        embed = inner.get_input_embeddings()
        embed.to("meta")  # its values are read again from the source, a block of rows at a time
        h_quant = h_float
        bar = tqdm(self.layers, desc=f"int4-{self.recipe.algorithm}", unit="layer", disable=not show_progress or None)
        with torch.no_grad():
            for index, layer in enumerate(bar):
                prefix = f"{self.prefix}.{index}."
                materialise(layer, prefix, self.plan, self.aliases)
                h_float = run_layer(layer, h_float, probe_kwargs[index])
                codes = quantize_layer(layer, x, kwargs[index], self.recipe)
                self._write_layer(prefix, layer, codes)
                if x is not None:
                    x = calibration_forward(layer, x, kwargs[index])
                h_quant = run_layer(layer, h_quant, probe_kwargs[index])
                self.layer_errors.append(relative_error(h_quant, h_float))
                layer.to("meta")
                log.info("int4-%s: layer %d/%d written", self.recipe.algorithm, index + 1, len(self.layers))
            norm = getattr(inner, "norm", None)
            self.probe_hidden = (norm(h_float), norm(h_quant)) if norm is not None else (h_float, h_quant)
            if x is not None and norm is not None:
                self.normed = norm(x)

    def _write_layer(self, prefix: str, layer: nn.Module, codes: dict[str, GroupCodes]) -> None:
        values = {prefix + k: v for k, v in layer.state_dict().items()}
        for name, group_codes in codes.items():
            values[f"{prefix}{name}.codes"], values[f"{prefix}{name}.scales_and_zeros"] = group_codes.layout()
        for key in self.plan.specs:
            if not key.startswith(prefix):
                continue
            if key not in values:
                raise ValueError(f"{key}: the int4wo layout has it, the calibrated layer does not "
                                 "(a linear the calibration did not quantize)")
            self.writer.write(key, values[key])

    def outer_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the tensors outside the decoder layers; returns the probe's logits (float, quantized)."""
        head_name, head = head_to_quantize(self.model, self.recipe)
        tied = json.loads(self.plan.metadata["tied"])
        head_outputs = {f"{head_name}.codes", tied.get(f"{head_name}.codes")} - {None} if head is not None else set()
        logits = None
        for job in self.plan.jobs:
            if job.outputs[0].startswith(self.prefix + "."):
                continue
            if job.kind == "copy":
                streaming.run_job(self.plan, job, self.writer)
            elif job.outputs[0] in head_outputs:
                logits = self._quantized_head(job)
            else:
                self._round_to_nearest(job)
        return logits if logits is not None else self._float_head()

    def _round_to_nearest(self, job: streaming.Job, normed: torch.Tensor | None = None):
        """Write `job`'s tensor round-to-nearest a block of rows at a time; with `normed`, also return the
        probe's logits through its float and quantized rows."""
        codes_at = 0
        scales, floats, quants = [], [], []
        for block in streaming.source_blocks(self.plan.source, job.source_key):
            block = block.to(self.plan.dtype)
            group_codes = round_to_nearest(block, job.group_size, self.recipe.bits)
            packed, sz = group_codes.layout()
            codes_at += self.writer.write_part(job.outputs[0], packed, codes_at)
            scales.append(sz)
            if normed is not None:
                floats.append(normed[0] @ block.float().T)
                quants.append(normed[1] @ group_codes.dequantized().T)
        self.writer.write(job.outputs[1], torch.cat(scales, dim=1))
        return (torch.cat(floats, -1)[0], torch.cat(quants, -1)[0]) if normed is not None else None

    def _quantized_head(self, job: streaming.Job) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self.recipe.algorithm == "gptq" and self.recipe.gptq_lm_head and self.normed is not None):
            return self._round_to_nearest(job, self.probe_hidden)
        weight = torch.cat([b.to(self.plan.dtype) for b in streaming.source_blocks(self.plan.source, job.source_key)])
        group_codes = head_codes(weight, self.normed, self.recipe)
        packed, sz = group_codes.layout()
        self.writer.write(job.outputs[0], packed)
        self.writer.write(job.outputs[1], sz)
        float_h, quant_h = self.probe_hidden
        return (float_h @ weight.float().T)[0], (quant_h @ group_codes.dequantized().T)[0]

    def _float_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The probe's logits through an unquantized head (its source rows), or the final hidden states
        where the model's head is not a plain linear."""
        float_h, quant_h = self.probe_hidden
        head = self.model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            return float_h[0], quant_h[0]
        key = next(n for n, m in self.model.named_modules() if m is head) + ".weight"
        key = key if key in self.plan.source.files else self.aliases.get(key, key)
        weight = torch.cat([b.to(self.plan.dtype).float() for b in streaming.source_blocks(self.plan.source, key)])
        return (float_h @ weight.T)[0], (quant_h @ weight.T)[0]


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """A tied lm_head's weight is stored under the embedding's name (or the other way round)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return {}
    embed = next(n for n, m in model.named_modules() if m is model.get_input_embeddings()) + ".weight"
    return {"lm_head.weight": embed, embed: "lm_head.weight"}


def relative_error(quantized: torch.Tensor, reference: torch.Tensor) -> float:
    return round((quantized - reference).norm().item() / max(reference.norm().item(), 1e-12), 6)
