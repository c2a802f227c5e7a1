"""`quantgate release --plan`: the n per task at which a variant equal to the baseline passes every task
gate of the policy with the policy's `power.family_harmless_pass` (gates.judging.power.plan), the other gate
families' sizes and power (safety items, fidelity chunks, long-context probes, speed rounds:
`family_rows`) and what the release costs in time. Inputs: the policy, flip rates, baseline scores
and measured effects from a recorded variant run when one is named (else gates.judging.power.DEFAULT_FLIP_RATE),
the items each task has, and the time: `--seconds-per-item` when given, else this machine's, measured by a
short pilot of the engine on the model (`pilot`); the speed rounds' from the named run's speed.json
when it has one."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from gates import metric_names as M
from gates import time_plan as T
from gates.judging import power as P
from gates.judging.policy import Policy
from gates.pilot import Timing, pilot


@dataclass
class Recorded:
    """What a recorded variant run says about each task: flip rates, per-item sd of continuous metrics."""

    flip_rates: dict[str, float] = field(default_factory=dict)
    sds: dict[str, float] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)  # the baseline's
    variant: dict[str, float] = field(default_factory=dict)  # every metric of the run (fidelity, speed, ...)
    baseline: dict[str, float] = field(default_factory=dict)


def recorded(run_id: str, policy: Policy, client=None) -> Recorded:
    from gates.records.tracking import baseline_run, get_client, get_run

    client = client or get_client()
    variant = get_run(run_id, client).data.metrics
    base = baseline_run(run_id, client)
    powers = P.task_powers(policy, variant, base.data.metrics if base else {},
                           P.recorded_flip_rates(client, run_id))
    out = Recorded(scores={t: base.data.metrics[M.task_score(t)] for t in powers
                           if base and M.task_score(t) in base.data.metrics},
                   variant=dict(variant), baseline=dict(base.data.metrics) if base else {})
    for task, p in powers.items():
        if p.flip_rate is not None:
            out.flip_rates[task] = p.flip_rate
        else:
            out.sds[task] = p.sd
    return out


def seconds_per_item(text: str | None) -> tuple[float | None, dict[str, float]]:
    """`S` (every task) or `TASK=S,TASK=S[,S]` -> (default, per task); no default given: None."""
    default, per_task = None, {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        name, _, value = part.rpartition("=")
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"--seconds-per-item: {part!r} is not S or TASK=S") from None
        if seconds <= 0:
            raise ValueError(f"--seconds-per-item: {part!r} must be > 0 seconds")
        if name:
            per_task[name] = seconds
        else:
            default = seconds
    return default, per_task


def plan_tasks(policy: Policy, suites: list[str], flip_rate: float | None, seconds: str | None,
               rec: Recorded | None = None, measured: dict[str, float] | None = None
               ) -> tuple[list[P.PlanTask], list[str]]:
    """One PlanTask per gated task of the suites, and the tasks left out (with why); seconds per item as
    given, else as `measured` (the pilot's), else DEFAULT_SECONDS_PER_ITEM (only where neither has the task)."""
    from evals.tasks import available_items, resolve_tasks

    rec = rec or Recorded()
    given_s, per_task_s = seconds_per_item(seconds)
    measured = measured or {}
    tasks, skipped = [], []
    for spec in resolve_tasks(suites):
        gate = policy.task_gate(spec.name)
        if spec.binary:
            rate = flip_rate if flip_rate is not None else rec.flip_rates.get(spec.name, P.DEFAULT_FLIP_RATE)
            rate = P.capped_flip_rate(rate, rec.scores.get(spec.name))
            sd = None
        elif spec.name in rec.sds:
            rate, sd = None, rec.sds[spec.name]
        else:
            skipped.append(f"{spec.name} ({spec.metric}: continuous, needs a recorded run's CI: --from-run)")
            continue
        tasks.append(P.PlanTask(spec.name, gate.max_drop, flip_rate=rate, sd=sd, available=available_items(spec),
                                seconds_per_item=per_task_s.get(spec.name, given_s if given_s is not None else
                                                                measured.get(spec.name, P.DEFAULT_SECONDS_PER_ITEM))))
    return tasks, skipped


def with_run_speed(timing: Timing, run_id: str) -> Timing:
    """The speed round's cost from the run's speed.json (every round's tok/s at every point), where it has one."""
    import json
    import statistics
    import tempfile

    from mlflow.exceptions import MlflowException

    from gates.records.tracking import get_client

    with tempfile.TemporaryDirectory(prefix="quantgate-plan-") as tmp:
        try:
            path = get_client().download_artifacts(run_id, f"{M.EVIDENCE_DIR}/speed.json", tmp)
            record = json.loads(Path(path).read_text())
        except (MlflowException, OSError, ValueError):
            return timing
    base = record["rounds"].get("baseline") or next(iter(record["rounds"].values()))
    prefill_tps = statistics.median(base["prefill"]) if "prefill" in base else timing.prefill_tps
    seconds = 0.0
    for point, values in base.items():
        shape, tps = record["points"].get(point, {}), statistics.median(values)
        if point == "prefill":
            seconds += shape.get("calls", 1) * shape.get("prompt_tokens", 0) / tps
        else:  # the context's prefill, then the timed steps of the batch
            batch = shape.get("batch", 1)
            seconds += batch * shape.get("prompt_tokens", 0) / (prefill_tps or tps) + batch * shape.get("steps", 0) / tps
    return replace(timing, round_s=seconds, prefill_tps=prefill_tps, round_source=f"run {run_id}'s speed.json")


def _context(model: str | None) -> int | None:
    """The model's context (long-context lengths beyond it are not probed), when its config can be read."""
    import json

    if model is None:
        return None
    try:
        from quantgate.models import resolve_model

        return json.loads((resolve_model(model) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None


def plan_report(policy: Policy, suites: list[str], models: int, level: float | None = None,
                flip_rate: float | None = None, seconds: str | None = None, from_run: str | None = None,
                min_n: int = 20, model: str | None = None, kv_variants: int = 0, measure: bool = True,
                memory: str = "", stages: T.ReleaseShape | None = None) -> str:
    """The plan as Markdown. Time: `seconds` when given; else a pilot of the engine on `model` (a few items
    per task, one speed round) when `measure` (else DEFAULT_SECONDS_PER_ITEM, said so). `memory`: the memory
    plan's table (flows/memory_plan.py, which the CLI passes: gates may not import flows), printed last.
    `stages`: the release's stages (gates/time_plan.py ReleaseShape): the time per stage from the pilot's
    figures (its quantizations piloted too)."""
    level = policy.family_harmless_pass if level is None else level
    rec = recorded(from_run, policy) if from_run else None
    given_all = seconds_per_item(seconds)[0] is not None
    names = [t.task for t in plan_tasks(policy, suites, flip_rate, "1", rec)[0]]
    timing = pilot(model, names, policy, need_items=not given_all, release=stages) if model and measure else Timing()
    if from_run:
        timing = with_run_speed(timing, from_run)
    tasks, skipped = plan_tasks(policy, suites, flip_rate, seconds, rec, timing.item_s)
    plan = P.plan(tasks, level, models=models, min_n=min_n)
    source = (f"flip rates from run {from_run} (default {P.DEFAULT_FLIP_RATE:g} where it has none)" if from_run
              else f"flip rate {flip_rate if flip_rate is not None else P.DEFAULT_FLIP_RATE:g} for every binary task")
    item_source = seconds or (timing.source if timing.item_s else
                              f"{P.DEFAULT_SECONDS_PER_ITEM:g} (default: nothing measured)")
    rows = family_rows(policy, plan, models, kv_variants, timing, rec, _context(model))
    lines = [P.plan_markdown(plan), f"- policy `{policy.source}`; {source}; seconds per item: {item_source}",
             f"- a release at these n: `--limit {max(r.n for r in plan.rows)}` covers every task (the largest n)"]
    lines += [f"- not planned: {s}" for s in skipped]
    times = ""
    if stages is not None:
        stages = replace(stages, measure=with_suites(stages.measure, suites, stages.limit))
        times = "\n" + T.markdown(T.stage_times(policy, stages, timing), stages.limit)
    return ("\n".join(lines) + "\n\n" + rows_markdown(rows, plan, models, timing) + times
            + (f"\n{memory}" if memory else ""))


def items_at(suites: list[str], limit: int | None) -> dict[str, int]:
    """Items each task of the suites runs per model at `limit` (its whole data where it has fewer)."""
    from evals.tasks import available_items, resolve_tasks

    counts = {spec.name: available_items(spec) for spec in resolve_tasks(suites)}
    return {t: (min(limit, n) if limit and n is not None else n or limit or 0) for t, n in counts.items()}


def with_suites(measure: T.MeasureShape, suites: list[str], limit: int | None) -> T.MeasureShape:
    """`measure` with the suites' items per task at `limit` and the tasks each suite's run takes together."""
    return replace(measure, items=items_at(suites, limit), runs=suite_runs(suites))


def suite_runs(suites: list[str]) -> tuple[tuple[str, ...], ...]:
    """The tasks each suite's eval run takes together (a release runs one suite at a time)."""
    from evals.tasks import resolve_tasks

    return tuple(tuple(spec.name for spec in resolve_tasks([suite])) for suite in suites)


ASSUMED_REFUSAL_RATE = 0.5  # no run named: the rate at which the flip cap binds least (a conservative figure)
ASSUMED_RETRIEVAL = 0.9  # no run named: the baseline's pass-key accuracy the long-context rows assume


@dataclass(frozen=True)
class FamilyRow:
    gate: str
    size: str  # what is measured: items, chunks, probes, rounds
    power: float | None  # P(pass) as gates.judging.power states it per family (None: needs a recorded run)
    basis: str  # what the figure assumes
    seconds: float | None  # wall time over every model that runs it (None: counted in the task rows)


def _pooled(plan: P.Plan, rec: Recorded, metric: str) -> tuple[int, float, float | None]:
    from evals.tasks import TASKS

    rows = [r for r in plan.rows if r.task in TASKS and TASKS[r.task].metric == metric]
    n = sum(r.n for r in rows)
    rates = [(rec.scores[r.task], r.n) for r in rows if r.task in rec.scores]
    flips = [(rec.flip_rates[r.task], r.n) for r in rows if r.task in rec.flip_rates]
    rate = sum(x * k for x, k in rates) / sum(k for _, k in rates) if rates else ASSUMED_REFUSAL_RATE
    return n, rate, (sum(x * k for x, k in flips) / sum(k for _, k in flips) if flips else None)


def _safety_rows(policy: Policy, plan: P.Plan, rec: Recorded) -> list[FamilyRow]:
    out = []
    for limit, gate, metric in ((policy.refusal_rate_max_fall, "safety/refusal_rate/max_fall", "refusal_rate"),
                                (policy.over_refusal_rate_max_rise, "safety/over_refusal_rate/max_rise",
                                 "over_refusal_rate")):
        n, rate, flips = _pooled(plan, rec, metric)
        if limit is None or not n:
            continue
        figure = P.safety_power(gate, n, limit, rate, flips, None).harmless_pass
        basis = f"baseline rate {rate:.2f}{'' if rec.scores else ' (assumed)'}, flip rate {flips or P.DEFAULT_FLIP_RATE:.3g}"
        out.append(FamilyRow(gate, f"{n} items (the tasks' n, pooled)", figure, basis, None))
    return out


def _fidelity_rows(policy: Policy, models: int, rec: Recorded, timing: Timing) -> list[FamilyRow]:
    from gates.judging import fidelity_gates as G

    fid, out = policy.fidelity, []
    tokens = fid.chunks * fid.chunk_tokens
    seconds = models * tokens / timing.prefill_tps if timing.prefill_tps else None
    for key, limit, gate in ((G.FIDELITY_KL, fid.max_kl, "fidelity/kl/max"),
                             (G.FIDELITY_FLIP_RATE, fid.max_flip_rate, "fidelity/flip_rate/max")):
        if limit is None:
            continue
        low, high = (rec.variant.get(G.ci_key(key, b)) for b in ("low", "high"))
        figure = (P.fidelity_power(gate, fid.chunks, limit, rec.variant[key], low, high, None).harmless_pass
                  if low is not None and high is not None and key in rec.variant else None)
        basis = "at the run's measured effect and per-chunk spread" if figure is not None else \
            "needs --from-run (measured effect and spread)"
        out.append(FamilyRow(gate, f"{fid.chunks} chunks x {fid.chunk_tokens} tokens", figure, basis, seconds))
    return out


def _long_context_rows(policy: Policy, kv_variants: int, rec: Recorded, timing: Timing,
                       context: int | None) -> list[FamilyRow]:
    from gates.judging import fidelity_gates as G

    gate = policy.long_context
    if gate.max_drop is None:
        return []
    models = 1 + kv_variants if gate.variants == "kv" else None  # "all": every model (count unknown here)
    if models == 1:
        return []  # no variant with a quantized KV cache: the probes do not run
    out = []
    for length in gate.lengths:
        if context and length > context:
            continue
        acc = rec.variant.get(G.long_context_key(length, "baseline"), ASSUMED_RETRIEVAL)
        figure = P.long_context_power(length, gate.probes_per_length, gate.max_drop, acc, None).harmless_pass
        per_model = gate.probes_per_length * length / timing.prefill_tps if timing.prefill_tps else None
        seconds = per_model * models if per_model is not None and models is not None else None
        basis = f"baseline retrieval {acc:.2f}{'' if rec.variant else ' (assumed)'}, binomial per probe"
        out.append(FamilyRow(f"long_context/{length}/max_drop", f"{gate.probes_per_length} probes", figure, basis,
                             seconds))
    return out


def _speed_rows(policy: Policy, models: int, rec: Recorded, timing: Timing) -> list[FamilyRow]:
    sp, variants = policy.speed, max(models - 1, 1)
    rounds = sp.pair_rounds(variants, 2 * timing.round_s) if timing.round_s else sp.max_rounds
    powers = P.speed_powers(policy, rec.variant, max_rounds=rounds) if rec.variant else {}
    # each pair: one warm-up and its timed rounds, both models once per round (loads: gates/time_plan.py)
    seconds = variants * (rounds + 1) * 2 * timing.round_s if timing.round_s else None
    names = [f"serve/min_decode_speedup/b{b}" for b in policy.decode_batches] if policy.min_decode_speedup else []
    names += ["serve/min_prefill_speedup"] if policy.min_prefill_speedup is not None else []
    out = [FamilyRow(g, f"<= {rounds} rounds, a look every {sp.look_every}", powers[g].harmless_pass if g in powers
                     else None, "at the run's measured ratio and per-round noise" if g in powers else
                     "needs --from-run (measured ratio and noise)", None) for g in names]
    if out:  # every point of a round is timed together: the time is the stage's, on the first row
        out[0] = replace(out[0], seconds=seconds)
    return out


def family_rows(policy: Policy, plan: P.Plan, models: int, kv_variants: int, timing: Timing,
                rec: Recorded | None, context: int | None = None) -> list[FamilyRow]:
    rec = rec or Recorded()
    return (_safety_rows(policy, plan, rec) + _fidelity_rows(policy, models, rec, timing)
            + _long_context_rows(policy, kv_variants, rec, timing, context) + _speed_rows(policy, models, rec, timing))


def rows_markdown(rows: list[FamilyRow], plan: P.Plan, models: int, timing: Timing) -> str:
    import math

    lines = ["## The other gate families", "",
             "| gate | measured | P(pass) | on what | s (all models) |", "| --- | --- | ---: | --- | ---: |"]
    for r in rows:
        figure = "—" if r.power is None else f"{r.power:.4f}"
        secs = "—" if r.seconds is None else f"{r.seconds:.0f}"
        lines.append(f"| {r.gate} | {r.size} | {figure} | {r.basis} | {secs} |")
    known = [r.power for r in rows if r.power is not None]
    family = plan.family_harmless_pass * math.prod(known)
    evals = plan.seconds_per_model * models
    other = sum(r.seconds for r in rows if r.seconds is not None)
    lines += ["", f"- every gate with a figure ({len(plan.rows) + len(known)} of {len(plan.rows) + len(rows)}) passes "
              f"together with probability **{family:.3f}** (gates independent)",
              f"- speed rounds: {timing.round_s:.1f} s per round and model ({timing.round_source}); the stage stops "
              "each point at its first decisive look, so its time is at most the row's" if timing.round_s else
              "- speed rounds: no time measured (no pilot, no run)",
              f"- release time, estimated: {evals:.0f} s evals + {other:.0f} s fidelity, long context and speed = "
              f"**{(evals + other) / 60:.1f} min** ({'this machine' if timing.item_s else 'seconds per item as stated'}"
              "; quantizing, loading and the canary not counted)"]
    return "\n".join(lines) + "\n"
