"""`w8a8`: int8 weights and per-row int8 activations (serving/model/quant/w8a8.py), SmoothQuant-calibrated.

For each set of linears reading one input (q/k/v, gate/up, o, down, the lm_head), the calibration text's
activations give max|x| per input channel; SmoothQuant's s = max|x|^a / max|w|^(1-a) moves range from the
outlier channels into the weights. `a` is searched per set on a grid, with s = 1 (no smoothing) always a
candidate, minimising the set's output error on a sample of calibration rows after both sides are quantized
as the op quantizes them, so the search never does worse than plain W8A8 on its calibration data. A tied
lm_head keeps s = 1: it shares its int8 table with the embedding.

This module is the in-memory build (a source without safetensors: the whole model in the build's dtype) and the
search both builds share; quantize/w8a8_stream.py builds a safetensors source one decoder layer at a time into the
same file, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from serving.model.quant.w8a8 import Int8DynamicLinear, quantize_rows

ALPHAS = (0.25, 0.4, 0.5, 0.6, 0.75)  # SmoothQuant's migration strengths tried beside s = 1
SAMPLE_ROWS = 256  # calibration rows per input the search measures the output error on


@dataclass
class InputStats:
    """One input several linears read: their names, max|x| per channel, a sample of rows."""

    names: list[str] = field(default_factory=list)
    peak: torch.Tensor | None = None
    rows: list[torch.Tensor] = field(default_factory=list)

    def add(self, activations: torch.Tensor, stride: int) -> None:
        """One sequence's activations at this input."""
        x = activations.detach().reshape(-1, activations.shape[-1]).float()
        peak = x.abs().amax(0)
        self.peak = peak if self.peak is None else torch.maximum(self.peak, peak)
        self.rows.append(x[::stride])


def build_w8a8(source: Path, opts: dict[str, Any], show_progress: bool = True) -> nn.Module:
    from transformers import AutoTokenizer

    from quantgate.loading import load_causal_lm
    from quantize.calibration import calibration_set

    model = load_causal_lm(source, dtype=getattr(torch, opts["dtype"])).eval()
    calibration = calibration_set(AutoTokenizer.from_pretrained(source), int(opts["calibration_tokens"]),
                                  int(opts["seq_len"]))
    start = time.perf_counter()
    linears = targets(model, opts)
    ids = calibration.ids
    inputs = collect_inputs(linears, lambda: [model(row[None]) for row in ids], sample_stride(ids))
    head = model.get_output_embeddings()
    tied = tied_head(model)
    choices = {}
    for i, stats in enumerate(inputs):
        fixed = tied and any(linears[n] is head for n in stats.names)
        choices.update(smooth_inputs(stats, [linears[n] for n in stats.names], fixed))
        if show_progress and (i + 1) % 16 == 0:
            print(f"w8a8: {i + 1}/{len(inputs)} inputs smoothed", flush=True)
    swap_linears(model, choices)
    if opts["quantize_embeddings"]:
        quantize_embedding(model, tied)
    model.quantgate_record = {
        "algorithm": {"name": "smoothquant", "alphas": list(ALPHAS), "sample_rows": SAMPLE_ROWS,
                      "chosen": {n: a for n, (_, a) in choices.items()},
                      "seconds": round(time.perf_counter() - start, 3)},
        "calibration": calibration.record,
    }
    return model


def targets(model: nn.Module, opts: dict[str, Any]) -> dict[str, nn.Linear]:
    """The linears w8a8 quantizes: every one, the lm_head by option."""
    head = model.get_output_embeddings()
    skip = set() if opts["quantize_lm_head"] else {id(head)}
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) not in skip}
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layers for w8a8 to quantize")
    return linears


def tied_head(model: nn.Module) -> bool:
    head = model.get_output_embeddings()
    return head is not None and getattr(head, "weight", None) is model.get_input_embeddings().weight


def swap_linears(module: nn.Module, choices: dict[str, tuple[torch.Tensor | None, float | None]]) -> None:
    """Each linear named in `choices` (relative to `module`) becomes an Int8DynamicLinear with its smoothing."""
    for name, (smooth, _) in choices.items():
        parent, _, child = name.rpartition(".")
        owner = module.get_submodule(parent) if parent else module
        setattr(owner, child, Int8DynamicLinear.from_linear(getattr(owner, child), smooth))


def sample_stride(ids: torch.Tensor) -> int:
    """Every how many rows of a sequence's activations the search keeps: SAMPLE_ROWS over the calibration."""
    return max(1, ids.numel() // SAMPLE_ROWS)


def collect_inputs(linears: dict[str, nn.Linear], run: Callable[[], Any], stride: int) -> list[InputStats]:
    """Each input's statistics while `run()` drives the calibration sequences one at a time through the linears;
    linears fed the same tensor in a forward share an input."""
    by_key: dict[tuple[str, int, tuple[int, ...]], InputStats] = {}
    owner: dict[str, InputStats] = {}

    def hook(name: str):
        def record(module: nn.Module, args: tuple) -> None:
            stats = owner.get(name)
            if stats is None:  # first sequence: group by the tensor each linear of one module reads
                key = (name.rpartition(".")[0], args[0].data_ptr(), tuple(args[0].shape))
                stats = owner[name] = by_key.setdefault(key, InputStats())
                stats.names.append(name)
            if stats.names[0] == name:  # the set's first member records for all
                stats.add(args[0], stride)
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return list({id(s): s for s in owner.values()}.values())


def smooth_inputs(stats: InputStats, members: list[nn.Linear],
                  fixed: bool) -> dict[str, tuple[torch.Tensor | None, float | None]]:
    """{name: (smooth or None, alpha)} for the linears reading one input: the alpha with the least output
    error, or (None, None) where no smoothing did best (or `fixed`: a tied lm_head)."""
    weight = torch.cat([m.weight.detach().float() for m in members])
    choice = search_smoothing(stats, lambda: [weight], fixed)
    return dict.fromkeys(stats.names, choice)


def search_smoothing(stats: InputStats, weight_blocks: Callable[[], Iterable[torch.Tensor]],
                     fixed: bool) -> tuple[torch.Tensor | None, float | None]:
    """(smooth, alpha) with the least mean squared output error over the weight's rows, handed over in blocks
    (a whole weight, or a streamed head's row blocks: per-row codes make the blocks' errors add up)."""
    x = torch.cat(stats.rows)[:SAMPLE_ROWS]
    references: list[torch.Tensor] = []  # x @ block^T per block: the same for every candidate
    peaks: list[torch.Tensor] = []  # max|w| per input channel per block, taken on the first pass

    def error(smooth: torch.Tensor | None) -> float:
        total, count = 0.0, 0
        for i, block in enumerate(weight_blocks()):
            block = block.float()
            if i == len(references):
                references.append(x @ block.t())
                peaks.append(block.abs().amax(0))
            total += _error_sum(x, block, smooth, references[i])
            count += x.shape[0] * block.shape[0]
        return total / count

    best: tuple[float, torch.Tensor | None, float | None] = (error(None), None, None)
    if not fixed:
        w_peak = torch.stack(peaks).amax(0).clamp(min=1e-5)
        x_peak = stats.peak.clamp(min=1e-5)
        for alpha in ALPHAS:
            smooth = (x_peak.pow(alpha) / w_peak.pow(1 - alpha)).clamp(min=1e-5)
            candidate = error(smooth)
            if candidate < best[0]:
                best = (candidate, smooth, alpha)
    return best[1], best[2]


def _error(x: torch.Tensor, weight: torch.Tensor, smooth: torch.Tensor | None) -> float:
    """Mean squared output error of x @ w^T as the op computes it with `smooth`."""
    return _error_sum(x, weight, smooth) / (x.shape[0] * weight.shape[0])


def _error_sum(x: torch.Tensor, weight: torch.Tensor, smooth: torch.Tensor | None,
               reference: torch.Tensor | None = None) -> float:
    from serving.model.quant.int8 import quantize_per_channel

    inv = torch.ones(x.shape[1]) if smooth is None else 1.0 / smooth
    codes, scales = quantize_per_channel(weight if smooth is None else weight * smooth[None, :])
    x_codes, row_scale = quantize_rows(x, inv)
    y = integer_products(x_codes, codes) * row_scale[:, None] * scales
    return float((y - (x @ weight.t() if reference is None else reference)).pow(2).sum())


def integer_products(x_codes: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """x_codes @ codes^T, exact, as fp32: torch's int8 GEMM (int32 sums) where its shapes allow it, else in fp64.
    In fp32 the sums past 2^24 rounded, and the product was most of an 8B-shaped layer's search (10.8 s of gate/up)."""
    if x_codes.shape[0] > 16 and x_codes.shape[1] % 8 == 0 and codes.shape[0] % 8 == 0:
        return torch._int_mm(x_codes.to(torch.int8), codes.t()).float()
    return (x_codes.double() @ codes.double().t()).float()


def quantize_embedding(model: nn.Module, tied: bool) -> None:
    from serving.model.quant.int8 import Int8Embedding, keep_embedding_scale

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embed, nn.Embedding):
        return
    if tied and isinstance(head, Int8DynamicLinear):
        table = Int8Embedding.sharing(head, embed.weight.dtype)
    else:
        table = Int8Embedding.from_embedding(embed)
    model.set_input_embeddings(keep_embedding_scale(embed, table))
