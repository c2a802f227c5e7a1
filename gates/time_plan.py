"""The release's time per stage on this machine, from the pilot's measured costs (gates.pilot.Timing):
seconds per eval item per task, per prompt token, per decode step at each batch, per engine load.

A `measure <model>` stage is the load, the serving benchmark (waves of `concurrency` streams decoding
`max_tokens` each), the eval items at the release's `--limit`, the fidelity chunks and (for the models that
run them) the long-context probes, every one on that model's engine; the `speed` stage is each variant's load,
its warm-up rounds and the timed rounds until their budget or `max_rounds` ends them, beside the baseline.
Every model is costed at the baseline's pilot figures (a variant is usually faster: an upper bound there).
Quantizing and the canary are not costed here (`quantgate bench scale` measures quantization per parameter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gates.judging.policy import Policy

WARMUP_ROUNDS = 1  # flows.data.SpeedPlan.warmup_rounds: untimed rounds per pair before the timed ones


@dataclass(frozen=True)
class MeasureShape:
    """What one measure stage runs (flows.data.MeasureConfig's fields, passed in: gates may not import flows)."""

    items: dict[str, int]  # eval items per task at the release's limit
    bench_requests: int = 16
    bench_concurrency: int = 4
    bench_max_tokens: int = 32
    fidelity_tokens: int = 0  # chunks x chunk tokens
    probe_tokens: int = 0  # probes x lengths, for each model in probe_models
    probe_models: tuple[str, ...] = ()


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


def measure_seconds(name: str, shape: MeasureShape, item_s: dict[str, float], load_s: float,
                    prefill_tps: float, step_s: float | None, setup_s: dict[str, float] | None = None) -> StageTime:
    """`setup_s`: each task's cost per run beside its items (gates.pilot.Timing.setup_s)."""
    waves = math.ceil(shape.bench_requests / max(shape.bench_concurrency, 1))
    bench = waves * shape.bench_max_tokens * step_s if step_s is not None else 0.0
    setup_s = setup_s or {}
    evals = sum(n * item_s[t] + setup_s.get(t, 0.0) for t, n in shape.items.items() if t in item_s)
    untimed = sorted(t for t in shape.items if t not in item_s)
    prompt_tokens = shape.fidelity_tokens + (shape.probe_tokens if name in shape.probe_models else 0)
    seconds = load_s + bench + evals + prompt_tokens / prefill_tps
    counted = (f"load {load_s:.0f} + serving {bench:.0f} + evals {evals:.0f} ({sum(shape.items.values())} items)"
               f" + {prompt_tokens} prompt tokens {prompt_tokens / prefill_tps:.0f}")
    return StageTime(f"measure {name}", seconds, counted + (f"; not timed: {', '.join(untimed)}" if untimed else ""))


def speed_seconds(policy: Policy, variants: int, round_s: float, load_s: float) -> StageTime:
    """A pair's round times both models once at every point (2 x round_s); its timed rounds are
    SpeedPoints.pair_rounds (its share of the budget or max_rounds, never fewer than the first look's)."""
    pair_round = 2 * round_s
    timed = policy.speed.pair_rounds(variants, pair_round) * pair_round
    per_pair = load_s + WARMUP_ROUNDS * pair_round + timed
    return StageTime("speed", load_s + variants * per_pair,
                     f"baseline load + {variants} x (load + {WARMUP_ROUNDS} warm-up + {timed:.0f} s of timed rounds)")


def stage_times(policy: Policy, models: list[str], shape: MeasureShape, timing) -> list[StageTime]:
    """`models`: the baseline first, then each variant; `timing`: gates.pilot.Timing from a pilot."""
    if timing.prefill_tps is None or timing.load_s is None:
        return [StageTime(f"measure {m}", None, "no pilot") for m in models] + [StageTime("speed", None, "no pilot")]
    step = step_seconds(timing.decode_s, policy.speed.decode_steps, shape.bench_concurrency)
    rows = [measure_seconds(m, shape, timing.item_s, timing.load_s, timing.prefill_tps, step, timing.setup_s)
            for m in models]
    return rows + [speed_seconds(policy, len(models) - 1, timing.round_s, timing.load_s)]


def markdown(rows: list[StageTime], limit: int | None) -> str:
    at = f"--limit {limit}" if limit else "the suites' full item counts"
    lines = [f"## Time per stage (at {at}; this machine, from the pilot)", "",
             "| stage | planned s | what it counts |", "| --- | ---: | --- |"]
    lines += [f"| {r.stage} | {'—' if r.seconds is None else f'{r.seconds:.0f}'} | {r.counted} |" for r in rows]
    known = [r.seconds for r in rows if r.seconds is not None]
    lines += ["", f"- measure and speed stages: **{sum(known) / 60:.1f} min**; quantizing and the canary not costed "
              "here (`quantgate bench scale` measures quantization per parameter)"]
    return "\n".join(lines) + "\n"
