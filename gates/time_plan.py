"""The release's time per stage on this machine, from the pilot's measured costs (gates.pilot.Timing):
seconds per eval item per task, per prompt token, per decode step at each batch, per engine load.

A `measure <model>` stage is the load, the serving benchmark (waves of `concurrency` streams decoding
`max_tokens` each), the eval items at the release's `--limit`, the fidelity chunks and (for the models that
run them) the long-context probes, every one on that model's engine; the `speed` stage is each variant's load,
its warm-up rounds and the timed rounds until their budget or `max_rounds` ends them, beside the baseline.
A variant's load and decode step are the baseline's less what its builds on the model's first 1 and 6 layers
save beside the model cut alike, carried to the model's depth (gates.pilot.CutServed); its eval items and speed
rounds are the baseline's. The flow's `resolve` step hashes the source where this home has not remembered it;
a first release of a source outside the home copies it for the registry (`snapshot`) before any build.
A `quantize <method>` stage is its build as the pilot timed it on the model's first layers (quantize/pilot.py:
a fresh process's start, the fixed part, each decoder layer); the `canary` (run only when a variant passes)
loads the champion and the challenger and replays its requests through the router, as the pilot replayed a few
through one server (gates.pilot._canary_seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from gates.judging.policy import Policy

WARMUP_ROUNDS = 1  # flows.data.SpeedPlan.warmup_rounds: untimed rounds per pair before the timed ones


@dataclass(frozen=True)
class MeasureShape:
    """What one measure stage runs (flows.data.MeasureConfig's fields, passed in: gates may not import flows)."""

    items: dict[str, int]  # eval items per task at the release's limit
    runs: tuple[tuple[str, ...], ...] = ()  # the tasks each eval run takes together (a suite's): its setup is paid
    # once (Qwen2.5-Coder-0.5B, the safety suite's three tasks at 4 items: 2.3 s together, 5.9 s one by one)
    bench_requests: int = 16
    bench_concurrency: int = 4
    bench_max_tokens: int = 32
    fidelity_tokens: int = 0  # chunks x chunk tokens
    probe_tokens: int = 0  # probes x lengths, for each model in probe_models
    probe_models: tuple[str, ...] = ()


@dataclass(frozen=True)
class CanaryShape:
    """What the canary replays (flows.canary_stage's constants and the release's --canary-requests)."""

    requests: int = 24
    concurrency: int = 4
    max_tokens: int = 16


@dataclass(frozen=True)
class ReleaseShape:
    """The release the time plan costs: its models (the baseline first), what each measure stage runs, the
    `--limit`, each quantization's (stage label, method, options) and the canary's replay."""

    models: list[str]
    measure: MeasureShape
    limit: int | None = None
    quantize: tuple[tuple[str, str, dict], ...] = ()
    canary: CanaryShape | None = None
    weights: dict[str, str] = field(default_factory=dict)  # a variant's model label -> its quantize label
    snapshot: bool = False  # a first release copies its source for the registry (flows.records.snapshot)


@dataclass(frozen=True)
class StageTime:
    stage: str
    seconds: float | None  # None: a cost the pilot did not measure
    counted: str  # what the figure adds up


def step_seconds(decode_s: dict[int, float], steps: int, batch: int) -> float | None:
    """Seconds per decode step at `batch` streams: the pilot's nearest measured batch (its context's prefill
    included, spread over its steps)."""
    if not decode_s:
        return None
    nearest = min(decode_s, key=lambda b: (abs(b - batch), b))
    return decode_s[nearest] / (steps + 1)


def less_saved(baseline_s: float, saved_s: float) -> float:
    """A variant's cost: the baseline's less what its cuts say it saves (gates.pilot.CutServed.saved); never
    below a tenth of the baseline's (a few layers' noise must not plan a free stage)."""
    return max(baseline_s - saved_s, 0.1 * baseline_s)


def measure_seconds(name: str, shape: MeasureShape, item_s: dict[str, float], load_s: float,
                    prefill_tps: float, wave_s: float | None, setup_s: dict[str, float] | None = None) -> StageTime:
    """`wave_s`: one wave of the serving benchmark (`bench_concurrency` streams of `bench_max_tokens`);
    `setup_s`: each task's cost per run beside its items (gates.pilot.Timing.setup_s)."""
    waves = math.ceil(shape.bench_requests / max(shape.bench_concurrency, 1))
    bench = waves * wave_s if wave_s is not None else 0.0
    evals = sum(n * item_s[t] for t, n in shape.items.items() if t in item_s) + _setup_seconds(shape, setup_s or {})
    untimed = sorted(t for t in shape.items if t not in item_s)
    prompt_tokens = shape.fidelity_tokens + (shape.probe_tokens if name in shape.probe_models else 0)
    seconds = load_s + bench + evals + prompt_tokens / prefill_tps
    counted = (f"load {load_s:.0f} + serving {bench:.0f} + evals {evals:.0f} ({sum(shape.items.values())} items)"
               f" + {prompt_tokens} prompt tokens {prompt_tokens / prefill_tps:.0f}")
    return StageTime(f"measure {name}", seconds, counted + (f"; not timed: {', '.join(untimed)}" if untimed else ""))


def _setup_seconds(shape: MeasureShape, setup_s: dict[str, float]) -> float:
    """Each eval run's setup: the largest of its tasks' (a task in no run is a run of its own)."""
    runs = [run for run in shape.runs if any(t in shape.items for t in run)]
    alone = [(t,) for t in shape.items if not any(t in run for run in runs)]
    return sum(max((setup_s.get(t, 0.0) for t in run if t in shape.items), default=0.0) for run in runs + alone)


def speed_seconds(policy: Policy, variants: int, round_s: float, load_s: float) -> StageTime:
    """A pair's round times both models once at every point (2 x round_s); its timed rounds are
    SpeedPoints.pair_rounds (its share of the budget or max_rounds, never fewer than the first look's)."""
    pair_round = 2 * round_s
    timed = policy.speed.pair_rounds(variants, pair_round) * pair_round
    per_pair = load_s + WARMUP_ROUNDS * pair_round + timed
    return StageTime("speed", load_s + variants * per_pair,
                     f"baseline load + {variants} x (load + {WARMUP_ROUNDS} warm-up + {timed:.0f} s of timed rounds)")


def quantize_seconds(label: str, built) -> StageTime:
    """`built`: quantize.pilot.QuantizeTiming, or None where the pilot did not build it."""
    if built is None:
        return StageTime(f"quantize {label}", None, "not piloted")
    return StageTime(f"quantize {label}", built.seconds,
                     f"start {built.start_s:.0f} + fixed {built.fixed_s:.0f} + {built.layers} layers x "
                     f"{built.per_layer_s:.2f} s")


def canary_seconds(canary: CanaryShape, load_s: float, step_s: float | None, up_s: float | None = None,
                   request_s: float | None = None) -> StageTime:
    """Both versions loaded and served, then the replay: as the pilot replayed a few of its requests through a
    server and the router (`up_s`, `request_s`), else its waves of `concurrency` at the decode step."""
    loads = f"2 loads {2 * load_s:.0f}"
    if request_s is not None:
        replay, up = canary.requests * request_s, up_s or 0.0
        return StageTime("canary", 2 * load_s + up + replay,
                         f"{loads} + servers and router {up:.0f} + {canary.requests} requests x {request_s:.2f} s "
                         f"{replay:.0f} (when a variant passes)")
    waves = math.ceil(canary.requests / max(canary.concurrency, 1))
    replay = waves * canary.max_tokens * step_s if step_s is not None else 0.0
    return StageTime("canary", 2 * load_s + replay,
                     f"{loads} + {canary.requests} requests x {canary.max_tokens} tokens {replay:.0f} (when a variant passes)")


def _measure_row(name: str, shape: MeasureShape, timing, step: float | None, cut) -> StageTime:
    """A model's measure stage: the baseline's figures, a variant's load and steps less what its cut saves."""
    wave = timing.serving_wave_s if timing.serving_wave_s is not None else (
        None if step is None else shape.bench_max_tokens * step)
    load = timing.load_s
    if cut is not None:  # what a variant saves per step, on each of a wave's bench_max_tokens steps
        load = less_saved(load, cut.saved("load_s"))
        wave = None if wave is None else less_saved(wave, shape.bench_max_tokens * cut.saved("step_s"))
    row = measure_seconds(name, shape, timing.item_s, load, timing.prefill_tps, wave, timing.setup_s)
    layers = " and ".join(map(str, cut.layers)) if cut else ""
    return replace(row, counted=row.counted + f"; load and steps from its cuts at {layers} layers") if cut else row


def stage_times(policy: Policy, release: ReleaseShape, timing) -> list[StageTime]:
    """Every stage of `release` in the order the flow runs them; `timing`: gates.pilot.Timing from a pilot."""
    models, shape = release.models, release.measure
    before = [quantize_seconds(label, timing.quantize.get(label)) for label, _, _ in release.quantize]
    if release.snapshot:  # after the memory check, before any build
        before.insert(0, StageTime("snapshot", timing.snapshot_s, "copying the source for the registry (first release)"))
    if timing.source_hash_s >= 0.5:  # the flow's first step hashes the source where this home has not yet
        before.insert(0, StageTime("resolve", timing.source_hash_s, "hashing the source (once: then remembered)"))
    if timing.prefill_tps is None or timing.load_s is None:
        rest = [StageTime(f"measure {m}", None, "no pilot") for m in models] + [StageTime("speed", None, "no pilot")]
        return before + rest + ([StageTime("canary", None, "no pilot")] if release.canary else [])
    step = step_seconds(timing.decode_s, policy.speed.decode_steps, shape.bench_concurrency)
    rows = [_measure_row(m, shape, timing, step, timing.variants.get(release.weights.get(m, ""))) for m in models]
    if rows and timing.first_load_s >= 0.5:  # the flow's first load pays a fresh process's first calls
        rows[0] = replace(rows[0], seconds=rows[0].seconds + timing.first_load_s,
                          counted=f"first load's first calls {timing.first_load_s:.0f} + " + rows[0].counted)
    if rows and timing.first_wave_s >= 0.5:  # and its first serving benchmark starts the first server
        rows[0] = replace(rows[0], seconds=rows[0].seconds + timing.first_wave_s,
                          counted=f"first server's wave {timing.first_wave_s:.0f} + " + rows[0].counted)
    rows = before + rows + [speed_seconds(policy, len(models) - 1, timing.round_s, timing.load_s)]
    if release.canary:
        canary_step = step_seconds(timing.decode_s, policy.speed.decode_steps, release.canary.concurrency)
        rows.append(canary_seconds(release.canary, timing.load_s, canary_step, timing.canary_up_s,
                                   timing.canary_request_s))
    return rows


def markdown(rows: list[StageTime], limit: int | None) -> str:
    at = f"--limit {limit}" if limit else "the suites' full item counts"
    lines = [f"## Time per stage (at {at}; this machine, from the pilot)", "",
             "| stage | planned s | what it counts |", "| --- | ---: | --- |"]
    lines += [f"| {r.stage} | {'—' if r.seconds is None else f'{r.seconds:.0f}'} | {r.counted} |" for r in rows]
    known = [r.seconds for r in rows if r.seconds is not None and r.stage != "canary"]
    canary = [r.seconds for r in rows if r.stage == "canary" and r.seconds is not None]
    lines += ["", f"- the release until its verdicts: **{sum(known) / 60:.1f} min**"
              + (f"; the canary {canary[0] / 60:.1f} min more where a variant passes" if canary else "")]
    unplanned = [r.stage for r in rows if r.seconds is None]
    lines += [f"- not costed: {', '.join(unplanned)}"] if unplanned else []
    return "\n".join(lines) + "\n"
