"""The release's speed evidence: paired, repeated, with a confidence interval.

The baseline and every variant are loaded together in this process and timed in interleaved rounds: in
each round every model runs every operating point (prefill, decode at each batch the policy names) on
the same fresh prompts, one after the other (the order rotates from round to round, so no model always
goes first). A drift of the machine's speed during a round falls on every model alike, and each round's
ratio variant / baseline is taken within the round; the ratios of the rounds give a geometric mean and a
95 % CI (`gates.judging.speed_verdicts.ratio_ci`), which the speed gates judge with three outcomes. One untimed warm-up
round first covers kernel builds, first-call packing and every batch shape.

The timing itself is `timer(model, point, round) -> tok/s`: the engines' (`engine_timer`) in the flow,
crafted numbers in tests.
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from flows.data import BASELINE, SpeedPlan, SpeedResult, Variant
from gates import metric_names as M
from gates.judging.speed_verdicts import ratio_ci

Timer = Callable[[str, str, int], float]  # (model, operating point, round; < 0: warm-up) -> tokens/s
Speeds = dict[str, dict[str, list[float]]]  # model -> point -> tok/s per round
BLOCK_SIZE = 16


def paired_rounds(names: Sequence[str], points: Sequence[str], timer: Timer, rounds: int,
                  warmup: int = 1, progress: Callable[[int], None] | None = None) -> Speeds:
    """Every model at every point in each round, models interleaved within the point (order rotated)."""
    if rounds < 2:
        raise ValueError(f"a confidence interval needs at least 2 paired rounds, got {rounds}")
    for w in range(warmup):
        for point in points:
            for name in names:
                timer(name, point, -1 - w)
    speeds: Speeds = {name: {point: [] for point in points} for name in names}
    for r in range(rounds):
        order = [*names[r % len(names):], *names[:r % len(names)]]
        for point in points:
            for name in order:
                speeds[name][point].append(timer(name, point, r))
        if progress is not None:
            progress(1)
    return speeds


def point_key(point: str) -> str:
    """The speedup metric of an operating point: "prefill" or "decode_b<N>"."""
    if point == "prefill":
        return M.SERVE_PREFILL_SPEEDUP
    if point.startswith("decode_b") and point[len("decode_b"):].isdigit():
        return M.decode_speedup(int(point[len("decode_b"):]))
    raise ValueError(f"unknown operating point {point!r} (prefill or decode_b<N>)")


def speed_metrics(speeds: Speeds, baseline: str = BASELINE) -> dict[str, dict[str, float]]:
    """Per model: its median tok/s per point; per variant also the paired ratio, CI and round count."""
    base = speeds[baseline]
    out: dict[str, dict[str, float]] = {}
    for name, by_point in speeds.items():
        metrics = {M.paired_tps(p): statistics.median(v) for p, v in by_point.items()}
        if name != baseline:
            for point, values in by_point.items():
                ratios = [v / b for v, b in zip(values, base[point], strict=True)]
                metrics.update(ratio_ci(ratios).metrics(point_key(point)))
            metrics[M.SERVE_SPEED_ROUNDS] = float(min(len(v) for v in by_point.values()))
        out[name] = metrics
    return out


def cache_key(models: Sequence[Variant], plan: SpeedPlan) -> str:
    """The models (weights, KV dtype), the plan and the machine (`flows.machine.key`)."""
    from flows import machine

    ids = "|".join(f"{m.name}:{m.content_hash}:{m.kv_cache_dtype}" for m in models)
    return f"speed-{hashlib.sha256(ids.encode()).hexdigest()[:16]}-{plan.key()}-{machine.key(machine.describe(plan.device))}"


# ---- the engines ------------------------------------------------------------------------------------


def load_engines(models: Sequence[Variant], plan: SpeedPlan) -> dict:
    """Every model's engine, loaded as the measure stage serves it (device, dtype, threads), with a KV
    cache just big enough for the rounds and no prefix cache (fresh prompts must be computed)."""
    from flows.machine import engine_placement
    from serving import LLMEngine

    longest = max(plan.prefill_tokens, plan.decode_context + plan.decode_tokens + 1) + 1
    batch = max(plan.decode_batches)
    blocks = batch * (-(-longest // BLOCK_SIZE) + 1)
    return {m.name: LLMEngine.from_pretrained(m.path, **engine_placement(plan.device), kv_cache_dtype=m.kv_cache_dtype,
                                              model_name=m.name, enable_prefix_caching=False,
                                              max_num_seqs=batch, block_size=BLOCK_SIZE, num_kv_blocks=blocks)
            for m in models}


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(n)]


def time_prefill(engine, prompt: list[int]) -> float:
    """Prompt tokens per second to the first token of one prompt."""
    from serving import SamplingParams

    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return len(prompt) / (time.perf_counter() - start)


def time_decode(engine, prompts: list[list[int]], tokens: int) -> float:
    """Output tokens/s of the batch once every sequence is past its prefill."""
    from serving import SamplingParams

    outs = engine.generate(prompts, SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True))
    start = max(o.metrics.token_times[0] for o in outs)
    end = max(o.metrics.token_times[-1] for o in outs)
    produced = sum(sum(1 for t in o.metrics.token_times if t > start) for o in outs)
    return produced / (end - start)


def engine_timer(engines: dict, plan: SpeedPlan) -> Timer:
    """Times an engine at a point; every model of a round gets the same prompts (seeded by round)."""
    vocab = min(e.vocab_size for e in engines.values())

    def timer(name: str, point: str, round_: int) -> float:
        seed = plan.seed * 1000 + round_
        if point == "prefill":
            return time_prefill(engines[name], _prompts(vocab, 1, plan.prefill_tokens, seed)[0])
        batch = int(point[len("decode_b"):])
        return time_decode(engines[name], _prompts(vocab, batch, plan.decode_context, seed), plan.decode_tokens)

    return timer


def measure(models: Sequence[Variant], plan: SpeedPlan, out: Path, machine: str,
            progress: Callable[[int], None] | None = None) -> SpeedResult:
    """Load every model, time the rounds, write every round's figures to `out`/speed.json."""
    if models[0].name != BASELINE:
        raise ValueError(f"the baseline comes first, got {[m.name for m in models]}")
    engines = load_engines(models, plan)
    names = [m.name for m in models]
    speeds = paired_rounds(names, plan.points(), engine_timer(engines, plan), plan.rounds, plan.warmup_rounds,
                           progress)
    metrics = speed_metrics(speeds)
    out.mkdir(parents=True, exist_ok=True)
    report = out / "speed.json"
    report.write_text(json.dumps({"machine": machine, "plan": asdict(plan), "rounds": speeds,
                                  "metrics": metrics}, indent=2, default=list))
    return SpeedResult(metrics=metrics, machine=machine, report=str(report))
