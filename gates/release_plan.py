"""`quantgate release --plan`: the n per task at which a variant equal to the baseline passes every task
gate of the policy with the policy's `power.family_harmless_pass` (gates.judging.power.plan), and what that costs
in eval time. Inputs: the policy's max_drop per task, flip rates and baseline scores from a recorded
variant run when one is named (else gates.judging.power.DEFAULT_FLIP_RATE), the items each task has, and seconds
per item per task (given, else gates.judging.power.DEFAULT_SECONDS_PER_ITEM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gates import metric_names as M
from gates.judging import power as P
from gates.judging.policy import Policy


@dataclass
class Recorded:
    """What a recorded variant run says about each task: flip rates, per-item sd of continuous metrics."""

    flip_rates: dict[str, float] = field(default_factory=dict)
    sds: dict[str, float] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)  # the baseline's


def recorded(run_id: str, policy: Policy, client=None) -> Recorded:
    from gates.records.tracking import baseline_run, get_client, get_run

    client = client or get_client()
    variant = get_run(run_id, client).data.metrics
    base = baseline_run(run_id, client)
    powers = P.task_powers(policy, variant, base.data.metrics if base else {},
                           P.recorded_flip_rates(client, run_id))
    out = Recorded(scores={t: base.data.metrics[M.task_score(t)] for t in powers
                           if base and M.task_score(t) in base.data.metrics})
    for task, p in powers.items():
        if p.flip_rate is not None:
            out.flip_rates[task] = p.flip_rate
        else:
            out.sds[task] = p.sd
    return out


def seconds_per_item(text: str | None) -> tuple[float, dict[str, float]]:
    """`S` (every task) or `TASK=S,TASK=S[,S]` -> (default, per task)."""
    default, per_task = P.DEFAULT_SECONDS_PER_ITEM, {}
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


def available_items(spec) -> int | None:
    """Items the task's data has (None when they cannot be counted without loading the benchmark)."""
    from evals.tasks import validate_task_data

    try:
        count = validate_task_data(spec)
        if count >= 0:
            return count
        import pyarrow as pa

        files = spec.lm_eval()["dataset_kwargs"]["data_files"]
        paths = [p for value in files.values() for p in (value if isinstance(value, list) else [value])]
        return sum(pa.ipc.open_stream(p).read_all().num_rows for p in paths)
    except Exception:  # noqa: BLE001 - the plan then says "—" for the items; it never fails on counting
        return None


def plan_tasks(policy: Policy, suites: list[str], flip_rate: float | None, seconds: str | None,
               rec: Recorded | None = None) -> tuple[list[P.PlanTask], list[str]]:
    """One PlanTask per gated task of the suites, and the tasks left out (with why)."""
    from evals.tasks import resolve_tasks

    rec = rec or Recorded()
    default_s, per_task_s = seconds_per_item(seconds)
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
                                seconds_per_item=per_task_s.get(spec.name, default_s)))
    return tasks, skipped


def plan_report(policy: Policy, suites: list[str], models: int, level: float | None = None,
                flip_rate: float | None = None, seconds: str | None = None, from_run: str | None = None,
                min_n: int = 20) -> str:
    level = policy.family_harmless_pass if level is None else level
    rec = recorded(from_run, policy) if from_run else None
    tasks, skipped = plan_tasks(policy, suites, flip_rate, seconds, rec)
    plan = P.plan(tasks, level, models=models, min_n=min_n)
    source = (f"flip rates from run {from_run} (default {P.DEFAULT_FLIP_RATE:g} where it has none)" if from_run
              else f"flip rate {flip_rate if flip_rate is not None else P.DEFAULT_FLIP_RATE:g} for every binary task")
    lines = [P.plan_markdown(plan), f"- policy `{policy.source}`; {source}; seconds per item: "
             f"{seconds or f'{P.DEFAULT_SECONDS_PER_ITEM:g} (default)'}",
             f"- a release at these n: `--limit {max(r.n for r in plan.rows)}` covers every task (the largest n)"]
    lines += [f"- not planned: {s}" for s in skipped]
    return "\n".join(lines) + "\n"

