"""What the flow measures for each model, through the layers below: quantize, serving benchmark, evals,
comparison. Only what composes several calls lives here; a stage that needs one call into `quantize`,
`serving` or `evals` makes it directly.

Metric keys are `gates.metric_names`' (the gate evaluator reads them back from MLflow).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

from evals.compare import compare as paired
from evals.compare import write_report
from evals.results import EvalResult, pooled_rate
from evals.run import run_suite
from flows import fidelity_stage, serving_harness
from flows.data import MeasureConfig, Measured, Variant
from flows.machine import engine_placement
from flows.progress import note
from flows.recipes import parse
from gates import metric_names as M
from quantgate.allocator import release_engine_memory
from quantgate.loading import resident_bytes
from quantize.capacity import ModelShape, capacity_row, capacity_shortfall, split_variant
from quantize.methods import get_method
from quantize.variant import quantize as build_variant
from serving import LLMEngine
from serving.model.quant.integrity import verify_variant

# Recorded in place of capacity/max_seqs where the weights leave the budget no KV block: the bytes they (and one
# block) exceed it by (1: the baseline's capacity was 0, so no gain); beside gates.metric_names' capacity keys.
CAPACITY_UNMEASURED = "capacity/unmeasured_over_bytes"

# ---- quantize ---------------------------------------------------------------------------------------


def check_methods(methods: list[str]) -> None:
    """Unknown methods and KV suffixes are named before anything runs (the method table is quantize's)."""
    for m in methods:
        weights, kv = split_variant(m)
        if weights == "baseline" and kv == "auto":
            raise ValueError("'baseline' is always measured; as a method it needs a KV suffix (baseline+kv8)")
        if weights != "baseline":
            get_method(parse(weights).method)


def quantize(source_dir: Path, method: str) -> Path:
    """The variant directory (quantize's content-addressed cache makes a repeat instant). `method` is a
    method or a recipe name (`int4_awq_g64`: flows.recipes), built with the recipe's options."""
    recipe = parse(method)
    return Path(build_variant(str(source_dir), recipe.method, **recipe.options))


def variant_hash(manifest: dict) -> str:
    """A variant's identity from its manifest's per-file sha256s (no need to hash the weights again)."""
    return hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()


def variant_intact(variant_dir: Path) -> bool:
    """A cached variant is reused only while every file matches its manifest's sha256, whatever its size:
    a release must never measure (or register) weights that differ from what was quantized."""
    try:
        verify_variant(Path(variant_dir), full=True)
    except (ValueError, OSError):
        return False
    return True


# ---- one model through the engine -------------------------------------------------------------------


def load_engine(variant: Variant, config: MeasureConfig):
    return LLMEngine.from_pretrained(variant.path, **engine_placement(config.device),
                                     kv_cache_memory_gb=config.kv_cache_memory_gb,
                                     model_name=variant.name, kv_cache_dtype=variant.kv_cache_dtype)


def measure(variant: Variant, config: MeasureConfig, out: Path, advance: Callable[[int], None]) -> Measured:
    """One model's engine, loaded, measured (`measure_engine`) and released: it is collected and its freed heap
    handed back to the OS before this returns, so the next model loads beside no other."""
    start = time.perf_counter()
    engine = load_engine(variant, config)
    try:
        return measure_engine(engine, variant, config, out, advance, time.perf_counter() - start)
    finally:
        del engine
        release_engine_memory()


def measure_engine(engine, variant: Variant, config: MeasureConfig, out: Path, advance: Callable[[int], None],
                   load_s: float) -> Measured:
    """Weights and KV capacity are recorded as served: counted after the serving benchmark, once the
    engine has packed what it packs on first use (an int4 layer keeps its codes beside the kernel's copy)."""
    metrics: dict[str, float] = {M.WEIGHTS_LOADED_BYTES: float(resident_bytes(engine.model)), "load_s": load_s}
    advance(1)
    clock = _PartClock({"load": load_s})
    bench_json = out / "serving.json"
    metrics.update(serving_benchmark(engine, config, variant.name, bench_json))
    clock.lap("serving")
    weights = resident_bytes(engine.model)
    metrics[M.WEIGHTS_BYTES] = float(weights)
    metrics.update(capacity(variant, weights, config, engine.runner.shape.dtype.itemsize, engine.kv_cache_dtype,
                            engine.block_size))
    advance(1)
    eval_dir = out / "evals"
    docs = config.eval_docs()
    for suite in config.suites:
        run_evals(engine, suite, None if docs else config.limit, eval_dir / suite, config.system_prompt,
                  config.chat_template, docs)
        clock.lap(f"evals {suite}")
        advance(1)
    metrics.update(eval_metrics(eval_dir, config.suites))
    artifacts = [str(bench_json)] + [str(eval_dir / s) for s in config.suites]
    artifacts += fidelity_stage.measure(engine, variant, config, out)
    clock.lap("fidelity and probes")
    clock.write(out / "seconds.json", variant.name)
    return Measured(variant=variant, metrics=metrics, eval_dir=str(eval_dir), bench_json=str(bench_json),
                    artifacts=artifacts)


class _PartClock:
    """Seconds of each part of a measure stage, written beside its results (seconds.json): what
    `quantgate bench release-memory` holds the time plan (gates/time_plan.py) against."""

    def __init__(self, parts: dict[str, float]):
        self.parts, self.last = dict(parts), time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part], self.last = now - self.last, now

    def write(self, path: Path, model: str) -> None:
        path.write_text(json.dumps({"model": model, "seconds": self.parts}, indent=2))


def serving_benchmark(engine, config: MeasureConfig, name: str, out_json: Path) -> dict[str, float]:
    """TTFT/TPOT percentiles and tokens/s at fixed concurrency, through the OpenAI-compatible server."""
    out_json.parent.mkdir(parents=True, exist_ok=True)
    report = serving_harness.benchmark(engine, config, name, out_json)
    return serving_harness.to_metrics(report)


def capacity(variant: Variant, weights: int, config: MeasureConfig, kv_dtype_bytes: int,
             kv_cache_dtype: str, block_size: int) -> dict[str, float]:
    """KV blocks and concurrent sequences of `capacity_seq_len` tokens that fit beside the weights in
    `capacity_budget_gb` (sized by the release's memory plan: flows/memory_plan.py; quantize.capacity, with the
    weight bytes measured here; an 8-bit cache counts its codes and scales as the engine stores them). Weights
    that leave no block are no measurement: `CAPACITY_UNMEASURED` (the bytes they exceed the budget by) is
    recorded instead of 0 sequences, and said so."""
    shape = ModelShape.from_config(json.loads((Path(variant.path) / "config.json").read_text()))
    budget = int(config.capacity_budget_gb * 2**30)
    row = capacity_row(variant.name, shape, weights, budget,
                       seq_len=config.capacity_seq_len, block_size=block_size, kv_dtype_bytes=kv_dtype_bytes,
                       kv_cache_dtype=kv_cache_dtype, weights_source="measured")
    reason = capacity_shortfall(row, budget)
    if reason is not None:
        note(f"{variant.name}: capacity not measured: {reason}")
        return {CAPACITY_UNMEASURED: float(max(weights + row.kv_bytes_per_block - budget, 1)),
                M.CAPACITY_KV_BYTES_PER_BLOCK: float(row.kv_bytes_per_block)}
    return {M.CAPACITY_KV_BLOCKS: float(row.num_blocks), M.CAPACITY_KV_TOKENS: float(row.num_blocks * block_size),
            M.CAPACITY_MAX_SEQS: float(row.max_seqs), M.CAPACITY_KV_BYTES_PER_BLOCK: float(row.kv_bytes_per_block)}


def capacity_gain(variant: dict[str, float], baseline: dict[str, float]) -> dict[str, float]:
    """Concurrent sequences at the same budget, variant / baseline; where either could not be measured (or the
    baseline fits none), no gain but `CAPACITY_UNMEASURED` on the variant's run: never a silent gap."""
    v, b = variant.get(M.CAPACITY_MAX_SEQS), baseline.get(M.CAPACITY_MAX_SEQS)
    if v is not None and b:
        return {M.CAPACITY_GAIN: v / b}
    over = max(variant.get(CAPACITY_UNMEASURED, 0.0), baseline.get(CAPACITY_UNMEASURED, 0.0))
    return {CAPACITY_UNMEASURED: over or 1.0}


def run_evals(engine, suite: str, limit: int | None, out_dir: Path, system_prompt: str | None = None,
              chat_template: bool | None = None, docs: range | None = None) -> None:
    run_suite(engine, [suite], limit=limit, out_dir=out_dir, system_prompt=system_prompt, chat_template=chat_template,
              docs=docs)


def eval_metrics(eval_dir: Path, suites: tuple[str, ...]) -> dict[str, float]:
    """Per-task metrics, and the safety rates pooled over items of every task measuring them
    (`safety/refusal_rate`: refused HarmBench + AdvBench prompts over all of them)."""
    metrics: dict[str, float] = {}
    tasks = []
    for suite in suites:
        result = EvalResult.load(eval_dir / suite)
        for name, t in result.tasks.items():
            metrics.update(M.task_metrics(name, t.score, n=t.n))
            tasks.append(t)
    for key, metric in ((M.SAFETY_REFUSAL_RATE, "refusal_rate"), (M.SAFETY_OVER_REFUSAL_RATE, "over_refusal_rate")):
        pooled = pooled_rate(tasks, metric)
        if pooled is not None:
            metrics[key] = pooled[0]
    return metrics


# ---- variant vs baseline ----------------------------------------------------------------------------


def load_evals(eval_dir: Path) -> EvalResult:
    """One model's results over all suites (each suite ran into its own directory)."""
    suites = sorted(p for p in Path(eval_dir).iterdir() if p.is_dir())
    if not suites:
        raise ValueError(f"{eval_dir} holds no eval results")
    results = [EvalResult.load(p) for p in suites]
    merged = results[0]
    for r in results[1:]:
        merged.tasks.update(r.tasks)
        merged.suites = sorted(set(merged.suites) | set(r.suites))
    return merged


def compare(baseline_eval: Path, variant_eval: Path, name: str, out: Path) -> tuple[dict[str, float], list[Path]]:
    """Paired per-task deltas with bootstrap CIs (evals.compare) as metrics, plus its report files."""
    base, var = load_evals(baseline_eval), load_evals(variant_eval)
    comparison = paired(base, {name: var})
    paths = write_report(comparison, base, {name: var}, out)
    metrics: dict[str, float] = {}
    for row in comparison.rows:
        metrics.update(M.task_metrics(row.task, row.variant_score, delta=row.delta, ci_low=row.ci_low,
                                      ci_high=row.ci_high, n=row.n))
    seen, seen_paths = fidelity_stage.compare(Path(baseline_eval).parent, Path(variant_eval).parent, out)
    return metrics | seen, list(paths.values()) + seen_paths
