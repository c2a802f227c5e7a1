"""This machine's measured costs for the release plan: a short pilot of our engine on the model — seconds per
eval item per task, per speed round, per prompt token, per decode step at each batch, per load — and of each
quantization on the model's first layers (quantize/pilot.py) (`quantgate release --plan`: gates/release_plan.py
sizes n with them, gates/time_plan.py adds up each stage)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gates.judging.policy import Policy

PILOT_ITEMS = (4, 32)  # items per task timed twice: the difference is the per-item cost, without the task's setup;
# a release submits a suite's items together and the engine batches them: at 1 and 3 items the difference was
# latency, 3.3x the batched cost (Qwen2.5-Coder-0.5B, six suites at 40 items: 0.46 s planned, 0.14 s measured).
# At 40 items the plan is 3 t16 - 2 t4 from 4 and 16 (a run's noise tripled: 4.4-8.0 s for ARC-Easy's 4.4 s
# over two pilots), 1.29 t32 - 0.29 t4 from 4 and 32.


@dataclass
class Timing:
    """This machine's measured costs (one model): seconds per item per task, per speed round (every point),
    prompt tokens per second (fidelity chunks and long-context probes are prompt-bound); where from."""

    item_s: dict[str, float] = field(default_factory=dict)
    setup_s: dict[str, float] = field(default_factory=dict)  # per task and run, whatever its items (lm-eval
    # building its requests; the first task's also the harness's first import)
    round_s: float | None = None
    prefill_tps: float | None = None
    load_s: float | None = None  # the engine's load of the model
    first_load_s: float = 0.0  # what a process's first load pays beyond it: this machine's kernels built where
    # QUANTGATE_HOME has none yet (45 s of a 49 s first load of SmolLM2-135M in a fresh home), first calls
    decode_s: dict[int, float] = field(default_factory=dict)  # batch -> seconds of its decode point (context + steps)
    source: str = ""
    round_source: str = ""
    quantize: dict[str, Any] = field(default_factory=dict)  # stage label -> quantize.pilot.QuantizeTiming


def _time(fn) -> float:
    import time

    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _item_seconds(engine, task: str) -> tuple[float, float]:
    """A task's seconds per item and per run: two pilot runs of PILOT_ITEMS items, on different items (the
    engine's prefix cache would serve a repeated item's prompt, which a release computes), the difference over
    the extra items per item (the larger run's mean if noise inverts it), what the smaller run took beyond its
    items per run (a release pays it once per task and model). A task with fewer items takes overlapping ones."""
    from evals.run import run_suite
    from evals.tasks import available_items, resolve_tasks

    small, large = PILOT_ITEMS
    available = available_items(resolve_tasks([task])[0]) or small + large
    second = range(small, small + large) if available >= small + large else range(max(available - large, 0), available)
    t_small = _time(lambda: run_suite(engine, [task], docs=range(small)))
    t_large = _time(lambda: run_suite(engine, [task], docs=second))
    per_item = (t_large - t_small) / (len(second) - small)
    if per_item <= 0:
        return t_large / len(second), 0.0
    return per_item, max(t_small - small * per_item, 0.0)


def _round_seconds(engine, policy: Policy, seed: int) -> tuple[float, float, dict[int, float]]:
    """One model's speed round at the policy's points (as flows.speed_rounds times them, context prefill
    included), its prompt tokens per second and each decode point's seconds: (seconds, tok/s, {batch: s}).
    Each round its own prompts (`seed`): a repeat would come from the prefix cache (the speed stage's engines
    have none), as the warm-up's did (Qwen2.5-Coder-0.5B: a 512-token prefill timed 0.08 s, 0.51 s uncached)."""
    import random

    from serving import SamplingParams

    sp, rng = policy.speed, random.Random(seed)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(1000, engine.vocab_size) for _ in range(length)] for _ in range(n)]

    prefill = _time(lambda: engine.generate(prompts(1, sp.prefill_tokens),
                                            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    decode = {b: _time(lambda b=b: engine.generate(prompts(b, sp.decode_context), SamplingParams(
        max_tokens=sp.decode_steps + 1, temperature=0.0, ignore_eos=True)))
        for b in (policy.decode_batches if policy.min_decode_speedup is not None else [])}
    return prefill + sum(decode.values()), sp.prefill_tokens / prefill, decode


def pilot(model: str, tasks: list[str], policy: Policy, need_items: bool = True,
          quantize: tuple[tuple[str, str, dict], ...] = ()) -> Timing:
    """Time each of `quantize`'s (label, method, options) builds on the model's first layers; load the engine on
    `model` twice (the first load's excess is the process's once); time PILOT_ITEMS items of every task (when
    `need_items`) and one speed round after a warm-up one."""
    import time

    from quantgate.allocator import release_engine_memory
    from quantgate.models import resolve_model
    from quantize.pilot import quantize_timing
    from serving import LLMEngine

    source = str(resolve_model(model))
    built = {label: quantize_timing(Path(source), method, options) for label, method, options in quantize}
    first_s = _time(lambda: LLMEngine.from_pretrained(source))  # dropped at once: two engines never resident
    release_engine_memory()
    start = time.perf_counter()
    engine = LLMEngine.from_pretrained(source)
    load_s = time.perf_counter() - start
    timing = Timing(source=f"measured here: a pilot of {PILOT_ITEMS[0]} and {PILOT_ITEMS[1]} items per task on {model}",
                    load_s=load_s, first_load_s=max(first_s - load_s, 0.0), quantize=built)
    if need_items:
        for task in tasks:
            timing.item_s[task], timing.setup_s[task] = _item_seconds(engine, task)
    _round_seconds(engine, policy, seed=0)  # warm-up: first calls pay for allocation and kernel selection
    timing.round_s, timing.prefill_tps, timing.decode_s = _round_seconds(engine, policy, seed=1)
    timing.round_source = f"one pilot round of the baseline on {model}"
    return timing
