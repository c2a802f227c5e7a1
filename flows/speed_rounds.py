"""The release's speed evidence: paired, repeated, with a confidence interval.

The baseline is paired with each variant in turn (`measure`): the baseline is loaded once, then each variant
is loaded, timed against it, and released before the next one loads, so at most two models are resident at
any time. Within a pair the two are timed in interleaved rounds: in each round both run every operating point
(prefill, decode at each batch the policy names) on the same fresh prompts, one after the other (the order
rotates from round to round, so neither always goes first). A drift of the machine's speed during a round
falls on both alike, and each round's ratio variant / baseline is taken within the round. The rounds are
group-sequential (`sequential_rounds`, statistics in `gates.judging.speed_verdicts`): at every look (each
`look_every` rounds) each (variant, point) still running gets its repeated CI at the look's adjusted level;
one that clears the gate's minimum or lies wholly below it stops and is no longer timed, the rest go on until
the rounds or the time budget run out (then `uninformative` if they still straddle). One untimed warm-up round
first covers kernel builds, first-call packing and every batch shape. The points are the policy's
(`SpeedPlan.from_policy`): served prompt and context lengths, and a long-context point for KV-quantized
variants.

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
from dataclasses import asdict, replace
from pathlib import Path

from flows.data import BASELINE, SpeedPlan, SpeedResult, Variant
from gates import metric_names as M
from gates.judging.policy import pair_budget_s
from gates.judging.speed_verdicts import CONTINUE, Look, SequentialDesign, ratio_ci, sequential_look
from quantgate.allocator import release_engine_memory

Timer = Callable[[str, str, int], float]  # (model, operating point, round; < 0: warm-up) -> tokens/s
Speeds = dict[str, dict[str, list[float]]]  # model -> point -> tok/s per round
Looks = dict[tuple[str, str], Look]  # (variant, point) -> the look it stopped at
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


def _runners(order: Sequence[str], point: str, active: set[tuple[str, str]], baseline: str) -> list[str]:
    """Who runs a point this round: the variants still running there, and the baseline if any is."""
    live = [n for n in order if (n, point) in active]
    return [n for n in order if n == baseline or n in live] if live else []


def _stop_at_look(speeds: Speeds, active: set[tuple[str, str]], minimums: dict[str, float | None],
                  design: SequentialDesign, final: bool, baseline: str) -> Looks:
    """Every running (variant, point) looked at; those with a decision leave `active`."""
    stopped: Looks = {}
    for name, point in sorted(active):
        values = speeds[name][point]
        if len(values) < 2:
            continue
        ratios = [v / b for v, b in zip(values, speeds[baseline][point], strict=False)]
        look = sequential_look(ratios, minimums.get(point), design, final)
        if look.decision != CONTINUE:
            stopped[(name, point)] = look
    active.difference_update(stopped)
    return stopped


def sequential_rounds(names: Sequence[str], units: dict[str, Sequence[str]], timer: Timer,
                      design: SequentialDesign, minimums: dict[str, float | None], warmup: int = 1,
                      budget_s: float | None = None, clock: Callable[[], float] = time.perf_counter,
                      progress: Callable[[int], None] | None = None) -> tuple[Speeds, Looks]:
    """Paired rounds until every (variant, point) in `units` (point -> variants) stops, the rounds reach
    `design.max_rounds`, or the next round would pass the time budget: that round's look is then the last
    and spends the alpha left. The budget counts the timed rounds only (loading and the warm-up are one-off
    costs a slow first kernel build would otherwise eat it with) and never ends the rounds before the first
    look, so every point gets a CI. The baseline is names[0]; the order rotates from round to round."""
    baseline, points = names[0], list(units)
    for w in range(warmup):
        for point in points:
            for name in [baseline, *units[point]]:
                timer(name, point, -1 - w)
    deadline = None if budget_s is None else clock() + budget_s
    speeds: Speeds = {name: {p: [] for p in points} for name in names}
    active = {(v, p) for p, vs in units.items() for v in vs}
    looks: Looks = {}
    r = 0
    while active:
        order, started = [*names[r % len(names):], *names[:r % len(names)]], clock()
        for point in points:
            for name in _runners(order, point, active, baseline):
                speeds[name][point].append(timer(name, point, r))
        r += 1
        if progress is not None:
            progress(1)
        now = clock()
        over = deadline is not None and r >= design.look_every and now + (now - started) > deadline
        final = r >= design.max_rounds or over
        if design.is_look(r) or final:
            looks.update(_stop_at_look(speeds, active, minimums, design, final, baseline))
        if final:
            break
    return speeds, looks


def point_key(point: str) -> str:
    """The speedup metric of an operating point: "prefill", "decode_b<N>" or "long_decode_b<N>"."""
    if point == "prefill":
        return M.SERVE_PREFILL_SPEEDUP
    if point.startswith("long_decode_b") and point[len("long_decode_b"):].isdigit():
        return M.long_decode_speedup(int(point[len("long_decode_b"):]))
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


def sequential_metrics(speeds: Speeds, looks: Looks, plan: SpeedPlan,
                       baseline: str = BASELINE) -> dict[str, dict[str, float]]:
    """Per model: median tok/s and the operating point of every point it ran; per variant also each point's
    ratio with the CI of the look it stopped at, that CI's level and the rounds it took."""
    base = speeds[baseline]
    out: dict[str, dict[str, float]] = {}
    for name, by_point in speeds.items():
        metrics: dict[str, float] = {}
        for point, values in by_point.items():
            if not values:
                continue
            metrics[M.paired_tps(point)] = statistics.median(values)
            metrics.update({M.speed_point(point, f): float(v) for f, v in plan.shape(point).items()})
            if name == baseline:
                continue
            metrics[M.speed_point(point, "rounds")] = float(len(values))
            look = looks.get((name, point))
            if look is None:  # fewer than 2 rounds when the budget ended: an estimate, no CI
                metrics[point_key(point)] = statistics.fmean(v / b for v, b in zip(values, base[point], strict=False))
                continue
            metrics.update(look.ci.metrics(point_key(point)))
            metrics[M.speed_point(point, "ci_level")] = look.level
        if name != baseline:
            metrics[M.SERVE_SPEED_ROUNDS] = max((float(len(v)) for v in by_point.values()), default=0.0)
        out[name] = metrics
    return out


def cache_key(models: Sequence[Variant], plan: SpeedPlan) -> str:
    """The models (weights, KV dtype), the plan and the machine (`flows.machine.key`)."""
    from flows import machine

    ids = "|".join(f"{m.name}:{m.content_hash}:{m.kv_cache_dtype}" for m in models)
    return f"speed-{hashlib.sha256(ids.encode()).hexdigest()[:16]}-{plan.key()}-{machine.key(machine.describe(plan.device))}"


# ---- the engines ------------------------------------------------------------------------------------


def kv_blocks(plan: SpeedPlan) -> int:
    """KV blocks for the largest point: its batch x (its tokens + the sampled one, rounded up, + 1 spare)."""
    def need(batch: int, tokens: int) -> int:
        return batch * (-(-(tokens + 2) // BLOCK_SIZE) + 1)

    sizes = [need(1, plan.prefill_tokens)] + [need(b, plan.decode_context + plan.decode_tokens + 1)
                                               for b in plan.decode_batches]
    if plan.long_context:
        sizes.append(need(plan.long_batch, plan.long_context + plan.long_tokens + 1))
    return max(sizes)


def load_engine(model: Variant, plan: SpeedPlan):
    """A model's engine, loaded as the measure stage serves it (device, dtype, threads), with a KV cache just
    big enough for the rounds and no prefix cache (fresh prompts must be computed)."""
    from flows.machine import engine_placement
    from serving import LLMEngine

    blocks, batch = kv_blocks(plan), max([*plan.decode_batches, plan.long_batch if plan.long_context else 1])
    return LLMEngine.from_pretrained(model.path, **engine_placement(plan.device), kv_cache_dtype=model.kv_cache_dtype,
                                     model_name=model.name, enable_prefix_caching=False,
                                     max_num_seqs=batch, block_size=BLOCK_SIZE, num_kv_blocks=blocks)


def load_engines(models: Sequence[Variant], plan: SpeedPlan) -> dict:
    """Every model's engine (`load_engine`), all resident at once: for a check of one model's engine;
    `measure` holds two at most."""
    return {m.name: load_engine(m, plan) for m in models}


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(n)]


def time_prefill(engine, prompts: list[list[int]]) -> float:
    """Prompt tokens per second to the first token, each prompt alone, the median over the prompts: a 512-token
    prefill is one ~0.15 s call, and on a noisy host one call's tok/s moved by up to 25 % from round to round."""
    from serving import SamplingParams

    speeds = []
    for prompt in prompts:
        start = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        speeds.append(len(prompt) / (time.perf_counter() - start))
    return statistics.median(speeds)


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
            return time_prefill(engines[name], _prompts(vocab, plan.prefill_calls, plan.prefill_tokens, seed))
        shape = plan.shape(point)
        return time_decode(engines[name], _prompts(vocab, shape["batch"], shape["prompt_tokens"], seed), shape["steps"])

    return timer


def capped(plan: SpeedPlan, model_path: str) -> SpeedPlan:
    """The plan with its long-context point capped at the model's context (as the long-context probes are)."""
    config = Path(model_path) / "config.json"
    limit = json.loads(config.read_text()).get("max_position_embeddings") if config.is_file() else None
    if not plan.long_context or not limit or plan.long_context + plan.long_tokens + 2 <= limit:
        return plan
    return replace(plan, long_context=max(0, limit - plan.long_tokens - 2))


def _units(plan: SpeedPlan, variants: Sequence[Variant]) -> dict[str, list[str]]:
    """Point -> the variants timed there: every variant at the served points; the long-context one only where
    the KV cache is quantized."""
    units = {p: [m.name for m in variants] for p in plan.points()}
    kv = [m.name for m in variants if m.kv_cache_dtype != "auto"]
    units.update({p: kv for p in plan.points(kv=True) if p not in units and kv})
    return units


def _clocked(timer: Timer, walls: dict[str, float]) -> Timer:
    """`timer`, adding each call's wall seconds to walls["<model> <point>"] (warm-up calls under "warm-up")."""
    def timed(name: str, point: str, round_: int) -> float:
        start = time.perf_counter()
        value = timer(name, point, round_)
        key = "warm-up" if round_ < 0 else f"{name} {point}"
        walls[key] = walls.get(key, 0.0) + time.perf_counter() - start
        return value

    return timed


def _time_pair(base_engine, variant: Variant, plan: SpeedPlan, budget_s: float | None,
               progress: Callable[[int], None] | None, load: Callable,
               walls: dict[str, float]) -> tuple[Speeds, Looks]:
    """The baseline and one variant in the sequential rounds; the variant's engine is dropped on return.
    `walls` gets the variant's load and each model's and point's seconds (the time plan's check)."""
    start = time.perf_counter()
    engines = {BASELINE: base_engine, variant.name: load(variant, plan)}
    walls["load"] = time.perf_counter() - start
    units = _units(plan, [variant])
    design = SequentialDesign(plan.look_every, plan.rounds, plan.alpha, plan.spending)
    return sequential_rounds([BASELINE, variant.name], units, _clocked(engine_timer(engines, plan), walls), design,
                             {p: plan.minimum(p) for p in units}, plan.warmup_rounds, budget_s, progress=progress)


def pair_budget(plan: SpeedPlan, variants: int) -> float | None:
    """Each pair's share of the timed rounds' budget (gates.judging.policy.pair_budget_s)."""
    return pair_budget_s(plan.time_budget_s, variants)


def merge_pairs(pairs: dict[str, Speeds]) -> Speeds:
    """Every model's rounds: each variant's from its pair; the baseline's from every pair, in pair order."""
    merged: Speeds = {BASELINE: {}}
    for name, speeds in pairs.items():
        merged[name] = speeds[name]
        for point, values in speeds[BASELINE].items():
            merged[BASELINE].setdefault(point, []).extend(values)
    return merged


def measure(models: Sequence[Variant], plan: SpeedPlan, out: Path, machine: str,
            progress: Callable[[int], None] | None = None, load: Callable = load_engine) -> SpeedResult:
    """Time the baseline against each variant in turn (two models resident at most), write every round's
    figures to `out`/speed.json: `rounds` as before (each variant's rounds; the baseline's of every pair, in
    pair order), `pairs`, each variant's rounds beside the baseline's of its own pair (the pairing its
    ratios were taken from), and `wall_s`: seconds of each load, warm-up and model's point, per pair.
    `load(variant, plan)` builds an engine (`load_engine`)."""
    if models[0].name != BASELINE:
        raise ValueError(f"the baseline comes first, got {[m.name for m in models]}")
    start = time.perf_counter()
    plan = capped(plan, models[0].path)
    variants = list(models[1:])
    base_engine = load(models[0], plan)
    walls: dict[str, dict[str, float]] = {BASELINE: {"load": time.perf_counter() - start}}
    pairs: dict[str, Speeds] = {}
    looks: Looks = {}
    metrics: dict[str, dict[str, float]] = {}
    for variant in variants:
        walls[variant.name] = {}
        pairs[variant.name], pair_looks = _time_pair(base_engine, variant, plan, pair_budget(plan, len(variants)),
                                                     progress, load, walls[variant.name])
        release_engine_memory()  # the variant's engine is gone: its memory goes back before the next one loads
        looks.update(pair_looks)
        metrics[variant.name] = sequential_metrics(pairs[variant.name], pair_looks, plan)[variant.name]
    del base_engine
    release_engine_memory()
    speeds = merge_pairs(pairs)
    metrics = {BASELINE: sequential_metrics({BASELINE: speeds[BASELINE]}, {}, plan)[BASELINE], **metrics}
    units = _units(plan, variants)
    design = SequentialDesign(plan.look_every, plan.rounds, plan.alpha, plan.spending)
    out.mkdir(parents=True, exist_ok=True)
    report = out / "speed.json"
    report.write_text(json.dumps({
        "machine": machine, "plan": asdict(plan), "points": {p: plan.shape(p) for p in units},
        "design": asdict(design), "elapsed_s": time.perf_counter() - start, "rounds": speeds,
        "pairs": pairs, "wall_s": walls,
        "looks": {f"{v}/{p}": {"rounds": look.ci.n, "level": look.level, "decision": look.decision,
                                "estimate": look.ci.estimate, "low": look.ci.low, "high": look.ci.high}
                  for (v, p), look in sorted(looks.items())},
        "metrics": metrics}, indent=2, default=list))
    return SpeedResult(metrics=metrics, machine=machine, report=str(report))
