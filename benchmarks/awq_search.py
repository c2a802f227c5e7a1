"""AWQ's scale search, full vs sampled: the scales each picks and the output error they leave on held text.

The search used to measure each candidate on every calibration row (2,048) and every output row, one
thread, in fp32 ("full" here); `quantize/awq.py` now measures on SEARCH_ROWS calibration rows and an even
spread of output rows, on every core, in bf16 where the CPU has it natively, so its cost stays flat per parameter. This benchmark runs both on the same stage inputs of
a real model's first layers (captured on the calibration text, and on LAMBADA text the search never saw),
interleaved per stage, and reports per stage: the alpha each picked, the held-out relative output error of
round-to-nearest at the scales each picked (lower is better), and the seconds each search took.

    .venv/bin/python -m benchmarks.awq_search --model DIR [--layers 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from quantize import awq
from quantize.calibrated import _previous_op, _rows, decoder_layers, discover_stages, layer_kwargs, run_layer
from quantize.group_grid import fake_quantize

FULL = {"SEARCH_ROWS": 1 << 30, "SEARCH_OUTPUTS": 1 << 30, "SEARCH_DTYPE": torch.float32}
SAMPLED: dict[str, object] = {}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="benchmarks.awq_search", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--calibration-tokens", type=int, default=2048)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--search-rows", type=int, default=awq.SEARCH_ROWS, help="the sampled search's calibration rows")
    p.add_argument("--search-outputs", type=int, default=awq.SEARCH_OUTPUTS)
    p.add_argument("--output-share", type=int, default=awq.OUTPUT_SHARE)
    args = p.parse_args(argv)
    SAMPLED.update(SEARCH_ROWS=args.search_rows, SEARCH_OUTPUTS=args.search_outputs, OUTPUT_SHARE=args.output_share)
    rows = compare(Path(args.model), args.layers, args.calibration_tokens)
    for row in rows:
        print(f"layer {row['layer']:2d} {row['stage']:28s} alpha full {row['alpha_full']!s:5s} sampled "
              f"{row['alpha_sampled']!s:5s}  held-out error full {row['error_full']:.5f} sampled "
              f"{row['error_sampled']:.5f}  s full {row['seconds_full']:.2f} sampled {row['seconds_sampled']:.2f}")
    worse = sum(r["error_sampled"] > r["error_full"] * 1.001 for r in rows)
    ratio = sum(r["error_sampled"] for r in rows) / max(sum(r["error_full"] for r in rows), 1e-12)
    speed = sum(r["seconds_full"] for r in rows) / max(sum(r["seconds_sampled"] for r in rows), 1e-12)
    print(f"{len(rows)} stages: sampled/full held-out error {ratio:.4f} (worse by >0.1% on {worse}); "
          f"search {speed:.1f}x faster; CPU {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads; sampled = {SAMPLED}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "error_ratio": ratio, "speedup": speed}, indent=2))


def compare(source: Path, layers: int, tokens: int) -> list[dict]:
    from transformers import AutoTokenizer

    from benchmarks.int4_methods import held_text
    from quantgate.loading import load_causal_lm
    from quantize.calibration import calibration_set

    tokenizer = AutoTokenizer.from_pretrained(source)
    model = load_causal_lm(source, dtype=torch.float32).eval()
    _, stack = decoder_layers(model)
    del stack[layers:]
    model.config.num_hidden_layers = layers
    calibration = calibration_set(tokenizer, tokens, 256).ids
    held = torch.tensor([sum(held_text(tokenizer, 1024), [])[:1024]])
    rows = []
    with torch.no_grad():
        x, kwargs = layer_kwargs(model, calibration)
        h, held_kwargs = layer_kwargs(model, held)
        for index, layer in enumerate(stack):
            stages, inputs = discover_stages(layer, x, kwargs[index])
            _, held_inputs = discover_stages(layer, h, held_kwargs[index])
            for stage in stages:
                if _previous_op(layer, stage) is None:
                    continue
                weights = [layer.get_submodule(n).weight for n in stage]
                rows.append({"layer": index, "stage": "+".join(n.split(".")[-1] for n in stage),
                             **_paired(inputs[stage[0]], held_inputs[stage[0]], weights)})
            x, h = run_layer(layer, x, kwargs[index]), run_layer(layer, h, held_kwargs[index])
    return rows


def _paired(calibration: torch.Tensor, held: torch.Tensor, weights: list[torch.Tensor]) -> dict:
    rows = calibration.reshape(-1, calibration.shape[-1])
    found = {}
    for name, limits in (("full", FULL), ("sampled", SAMPLED)):
        saved = {k: getattr(awq, k) for k in limits}
        for k, v in limits.items():
            setattr(awq, k, v)
        try:
            start = time.perf_counter()
            choice = awq.search_scales(_rows(rows, awq.SEARCH_ROWS), weights, 32, 4, x_mean=rows.abs().mean(0))
            found[f"seconds_{name}"] = round(time.perf_counter() - start, 3)
        finally:
            for k, v in saved.items():
                setattr(awq, k, v)
        found[f"alpha_{name}"] = choice.alpha
        found[f"error_{name}"] = _held_error(held, weights, choice.scales)
    return found


def _held_error(held: torch.Tensor, weights: list[torch.Tensor], scales: torch.Tensor) -> float:
    x = held.reshape(-1, held.shape[-1]).float()
    weight = torch.cat([w.float() for w in weights])
    approx = fake_quantize(weight * scales, 32, 4) / scales
    reference = x @ weight.T
    return ((x @ approx.T - reference).square().mean() / reference.square().mean()).item()


if __name__ == "__main__":
    main()
