"""w8a8 built one decoder layer at a time, straight into `w8a8.safetensors` (as calibrated_stream.py builds int4-awq).

The model is a skeleton on the meta device. The calibration sequences pass through the embedding, then layer by
layer: its weights are read from the source's safetensors, the sequences run through it one at a time in the build
dtype (as the in-memory build's whole-model forward runs them) while hooks record each input's peaks and sample
rows, each input set's smoothing is searched by quantize/w8a8.py's code, the linears become Int8DynamicLinear, their
tensors are written at their places (the header comes from the same structure built on meta), and the float outputs
carry on. The head keeps s = 1 where tied; else its smoothing is searched over row blocks of the source (per-row
codes: the blocks' errors add up) and written block by block; an untied embedding's rows are int8 from row blocks.

Memory: one decoder layer in the build dtype, its int8 copy and the search's copies of its widest input set, the
calibration hidden states, a block of the head's rows. The probe runs a fixed input through the source's layers
and the quantized ones side by side and compares the logits, as the in-memory build's check does.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantize import streaming
from quantize.calibrated import decoder_layers, run_layer
from quantize.calibrated_stream import materialise, pass_through, relative_error, skeleton, tied_aliases
from quantize.variant_writer import VariantWriter, st_dtype, torch_dtype
from quantize.w8a8 import (
    ALPHAS,
    SAMPLE_ROWS,
    InputStats,
    collect_inputs,
    quantize_embedding,
    sample_stride,
    search_smoothing,
    smooth_inputs,
    swap_linears,
    targets,
    tied_head,
)
from serving.model.quant.int8 import quantize_per_channel
from serving.model.quant.w8a8 import Int8DynamicLinear, reference_linear

log = logging.getLogger(__name__)



def stream_w8a8(source: Path, opts: dict[str, Any], out: Path, show_progress: bool = True) -> dict[str, Any] | None:
    """Build the variant into `out`; returns the manifest's "tensors", "record" and "probe", or None where the
    source is not streamable (the in-memory build then runs)."""
    from transformers import AutoTokenizer

    from quantize.calibration import calibration_set
    from quantize.probe import check_layer_by_layer

    if not streaming.streamable(source):
        return None
    try:
        plan, tied = plan_w8a8(source, opts)
    except streaming.NotStreamable as exc:
        log.warning("%s; building w8a8 in memory", exc)
        return None
    model = skeleton(source, plan.dtype)
    decoder_layers(model)
    calibration = calibration_set(AutoTokenizer.from_pretrained(source), int(opts["calibration_tokens"]),
                                  int(opts["seq_len"]))
    started = time.perf_counter()
    with streaming.variant_file(plan, out / streaming.WEIGHTS_FILES["w8a8"]) as writer:
        walk = _Walk(model, plan, writer, tied)
        walk.layers(calibration.ids, show_progress)
        float_logits, quant_logits = walk.outside()
    streaming.write_configs(plan, out)
    probe = check_layer_by_layer(quant_logits, float_logits, "w8a8")
    for name, alpha in walk.chosen.items():
        plan.table[name]["smoothed"] = alpha is not None
    record = {"algorithm": {"name": "smoothquant", "alphas": list(ALPHAS), "sample_rows": SAMPLE_ROWS,
                            "chosen": walk.chosen, "seconds": round(time.perf_counter() - started, 3),
                            "streamed": "one decoder layer at a time"},
              "calibration": calibration.record}
    return {"tensors": plan.table, "record": record,
            "probe": {"kind": "layer by layer", "logit_cosine": probe.cosine,
                      "top1_agreement": probe.top1_agreement, "layers": walk.layer_errors}}


def plan_w8a8(source: Path, opts: dict[str, Any]) -> tuple[streaming.Plan, bool]:
    """The variant's layout from config.json alone (the in-memory build's structure made on the meta device), and
    whether the lm_head is the embedding's table (a skeleton built under init_empty_weights is not tied)."""
    from quantize.tensor_table import tensor_table
    from serving.model.quant.checkpoint import file_metadata

    weights = streaming.open_source(source)
    model, _ = streaming.meta_model(source, opts["dtype"])
    tied = tied_head(model)
    with torch.device("meta"), torch.no_grad():
        swap_linears(model, dict.fromkeys(targets(model, opts), (None, None)))
        if opts["quantize_embeddings"]:
            quantize_embedding(model, tied)
    state = model.state_dict(keep_vars=True)
    stored, tied_names = streaming.dedupe(state)
    specs = {key: (st_dtype(state[key].dtype), tuple(state[key].shape)) for key in stored}
    plan = streaming.Plan("w8a8", weights, getattr(torch, opts["dtype"]), specs, [],
                          file_metadata(model, "w8a8", tied_names), model.config, tensor_table(model))
    return plan, tied


class _Walk:
    """The calibration sequences through the decoder layers, then the tensors outside them, written as it goes."""

    def __init__(self, model: nn.Module, plan: streaming.Plan, writer: VariantWriter, head_tied: bool):
        self.model, self.plan, self.writer = model, plan, writer
        self.prefix, self.decoder = decoder_layers(model)
        self.aliases = tied_aliases(model)
        self.tied: dict[str, str] = json.loads(plan.metadata["tied"])  # {tied name: stored name}
        self.head_tied = head_tied
        self.chosen: dict[str, float | None] = {}
        self.layer_errors: list[float] = []

    def layers(self, ids: torch.Tensor, show_progress: bool) -> None:
        from tqdm import tqdm

        from quantize.probe import probe_ids

        inner = self.model.model
        embed = inner.get_input_embeddings()
        for name, module in inner.named_children():  # the final norm (and whatever else is small)
            if name != "layers" and module is not embed and any(True for _ in module.parameters()):
                materialise(module, f"model.{name}.", self.plan, self.aliases)
        probe = torch.tensor([probe_ids(self.model.config.vocab_size)])
        with self._rows_of(embed, [probe, ids]) as index:
            h_float, probe_kwargs = pass_through(self.model, index(probe))
            runs = [pass_through(self.model, index(row[None])) for row in ids]
        xs, kwargs = [x for x, _ in runs], [kw for _, kw in runs]
        self.stride = sample_stride(ids)
        h_quant = h_float
        bar = tqdm(self.decoder, desc="w8a8", unit="layer", disable=not show_progress or None)
        with torch.no_grad():
            for index, layer in enumerate(bar):
                prefix = f"{self.prefix}.{index}."
                materialise(layer, prefix, self.plan, self.aliases)
                xs, choices = self._smooth(layer, xs, [kw[index] for kw in kwargs])
                h_float = run_layer(layer, h_float, probe_kwargs[index])
                swap_linears(layer, choices)
                self._write_layer(prefix, layer)
                h_quant = run_layer(layer, h_quant, probe_kwargs[index])
                self.layer_errors.append(relative_error(h_quant, h_float))
                self.chosen.update({prefix + n: a for n, (_, a) in choices.items()})
                for module in layer.modules():
                    if isinstance(module, Int8DynamicLinear):
                        module.forget_kernel()  # its compiled call held the packed quads past the layer
                layer.to("meta")
            norm = getattr(inner, "norm", None)
            self.normed = [norm(x) for x in xs] if norm is not None else xs
            self.probe_hidden = (norm(h_float), norm(h_quant)) if norm is not None else (h_float, h_quant)

    @contextmanager
    def _rows_of(self, embed: nn.Module, ids: list[torch.Tensor]) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """The embedding holding only the rows `ids` look up (gathered from the source's row blocks: a whole fp32
        table is 2.1 GB at Llama-3-8B's shapes, ten times its layer), and the ids' places in it; the embedding's own
        forward still runs (Gemma's row scale)."""
        name = next(n for n, m in self.model.named_modules() if m is embed)
        wanted = torch.unique(torch.cat([t.reshape(-1) for t in ids]))
        rows, start = [], 0
        for block in streaming.source_blocks(self.plan.source, self._source_key(f"{name}.weight")):
            inside = wanted[(wanted >= start) & (wanted < start + block.shape[0])]
            rows.append(block[inside - start].to(self.plan.dtype))
            start += block.shape[0]
        padding = getattr(embed, "padding_idx", None)
        embed._parameters["weight"] = nn.Parameter(torch.cat(rows), requires_grad=False)
        embed.padding_idx = None  # a row index of the whole table
        try:
            yield lambda t: torch.searchsorted(wanted, t)
        finally:
            embed.padding_idx = padding
            embed.to("meta")

    def _smooth(self, layer: nn.Module, xs: list[torch.Tensor], kwargs: list[dict]):
        """The layer's outputs over the sequences, and each linear's (smooth, alpha) from its input's statistics."""
        linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        outs: list[torch.Tensor] = []

        def run() -> None:
            outs.extend(run_layer(layer, x, kw) for x, kw in zip(xs, kwargs, strict=True))

        inputs = collect_inputs(linears, run, self.stride)
        choices: dict[str, tuple[torch.Tensor | None, float | None]] = {}
        for stats in inputs:
            choices.update(smooth_inputs(stats, [linears[n] for n in stats.names], fixed=False))
        return outs, choices

    def _write_layer(self, prefix: str, layer: nn.Module) -> None:
        values = {prefix + k: v for k, v in layer.state_dict().items()}
        for key in self.plan.specs:
            if key.startswith(prefix):
                if key not in values:
                    raise ValueError(f"{key}: the w8a8 layout has it, the calibrated layer does not (a linear the "
                                     "calibration never called)")
                self.writer.write(key, values[key])

    def outside(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the tensors outside the decoder layers; returns the probe's logits (float, quantized)."""
        head = self.model.get_output_embeddings()
        head_name = next((n for n, m in self.model.named_modules() if m is head), None)
        logits = self._head(head_name) if isinstance(head, nn.Linear) else None
        for key in self.plan.specs:
            if key.startswith(self.prefix + ".") or key in self.writer.written:
                continue
            owner, _, attr = key.rpartition(".")
            if attr == "weight_int8":  # an untied embedding's int8 rows
                streaming.run_job(self.plan, streaming.Job("int8", self._source_key(f"{owner}.weight"),
                                                           [key, f"{owner}.scales"]), self.writer)
            elif attr != "scales":
                streaming.run_job(self.plan, streaming.Job("copy", self._source_key(key), [key]), self.writer)
        return logits if logits is not None else (self.probe_hidden[0][0], self.probe_hidden[1][0])

    def _head(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The lm_head (smoothed from row blocks where it is quantized and untied); the probe's logits through it."""
        key = self._source_key(f"{name}.weight")
        float_h, quant_h = (h.reshape(-1, h.shape[-1]).float() for h in self.probe_hidden)
        quantized = f"{name}.inv_smooth" in self.plan.specs

        def blocks():
            return (b.to(self.plan.dtype) for b in streaming.source_blocks(self.plan.source, key))

        smooth = None
        if quantized and not self.head_tied:
            stats = InputStats(names=[name])
            for x in self.normed:
                stats.add(x, self.stride)
            smooth, alpha = search_smoothing(stats, blocks, fixed=False)
            self.chosen[name] = alpha
        elif quantized:
            self.chosen[name] = None
        inv = torch.ones(self.model.config.hidden_size) if smooth is None else (1.0 / smooth).contiguous()
        floats, quants, scales, at = [], [], [], 0
        for block in blocks():
            weight = block.float()
            floats.append(float_h @ weight.T)
            if not quantized:
                quants.append(quant_h @ weight.T)
                stored = self._stored(f"{name}.weight")
                at += self.writer.write_part(stored, block.to(torch_dtype(self.plan.specs[stored][0])), at)
                continue
            codes, row_scales = quantize_per_channel(weight if smooth is None else weight * smooth[None, :])
            at += self.writer.write_part(self._stored(f"{name}.weight_int8"), codes, at)
            scales.append(row_scales)
            quants.append(reference_linear(quant_h, codes, row_scales, inv))
        if quantized:
            self.writer.write(self._stored(f"{name}.scales"), torch.cat(scales))
            self.writer.write(f"{name}.inv_smooth", inv)
        if f"{name}.bias" in self.plan.specs:
            self.writer.write(f"{name}.bias", _read(self.plan, self._source_key(f"{name}.bias")))
        return torch.cat(floats, -1), torch.cat(quants, -1)

    def _stored(self, key: str) -> str:
        return self.tied.get(key, key)

    def _source_key(self, key: str) -> str:
        return key if key in self.plan.source.files else self.aliases.get(key, key)


def _read(plan: streaming.Plan, key: str) -> torch.Tensor:
    return torch.cat([b.to(plan.dtype) for b in streaming.source_blocks(plan.source, key)])

