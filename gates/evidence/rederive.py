"""Re-derive a release's gate inputs from the per-item records its runs hold under `evidence/`.

`quantgate verify` hash-checks those records against the manifest; this module recomputes from them, with
the code and the seeded resamples the release used, the metrics the gates read, so that verify can judge
again on numbers that follow from the items rather than on the aggregates the run recorded:

- tasks: each model's per-sample logs (`<suite>/samples/<task>.jsonl`) -> its score and n
  (`evals.results.aggregate`), and per variant the paired delta and bootstrap CI (`evals.compare.compare`:
  seed `DEFAULT_SEED` + crc32 of variant/task, `DEFAULT_BOOT` resamples) and the flip rates the gate's
  power reads (`gates.judging.power.flip_rates`);
- safety: the pooled refusal and over-refusal rates over the refusal tasks' items (`pooled_rate`);
- fidelity: both models' `fidelity.json` -> per-chunk KL and flips, cluster-bootstrap CIs
  (`evals.fidelity.compare`, seeded by the plan the file records);
- long context: both models' `long_context.json` -> per-length paired CI (`evals.long_context.compare`,
  seed 0 + length, as the release calls it);
- speed: every round in `speed.json` -> per point the paired ratio and its CI: for the group-sequential
  design (speed.json has `design`, or a plan with looks) every look replayed from the rounds (`gates.evidence.speed_replay`: the
  round each point stopped at, the stopping look's CI at its adjusted level); for the older fixed-round
  plan the t interval over all rounds (`gates.judging.speed_verdicts.ratio_ci`); a record of neither kind
  is left to the hash check.

Weights, capacity and latency gates read measurements with no per-item record: verify hash-checks them.
The metric-key mapping of fidelity, long context and speed repeats `flows` (gates may not import flows).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gates import metric_names as M
from gates.judging import fidelity_gates as G

FIDELITY_FILE = "fidelity.json"  # flows.fidelity_stage.FIDELITY_FILE
PROBES_FILE = "long_context.json"  # flows.fidelity_stage.PROBES_FILE
SPEED_FILE = "speed.json"  # flows.speed_rounds.measure
# The fields of flows.data.SpeedPlan whose rounds `ratio_ci` judges (a fixed number of paired rounds).
_FIXED_SPEED_PLAN = {"decode_batches", "decode_tokens", "decode_context", "prefill_tokens", "rounds",
                     "warmup_rounds", "seed", "device"}


@dataclass
class Derived:
    metrics: dict[str, float] = field(default_factory=dict)  # metric key -> value recomputed from items
    families: list[str] = field(default_factory=list)  # what was recomputed, in words
    flip_rates: dict[str, float] = field(default_factory=dict)  # per task, for the task gates' power
    problems: list[str] = field(default_factory=list)  # records present that do not re-derive
    notes: list[str] = field(default_factory=list)  # records present that are left to the hash check


def load_evals(evidence: Path | None):
    """One model's eval results over every suite folder of its `evidence/` (None: it has none)."""
    from evals.results import SUMMARY, EvalResult

    suites = sorted(p.parent for p in evidence.glob(f"*/{SUMMARY}")) if evidence and evidence.is_dir() else []
    if not suites:
        return None
    results = [EvalResult.load(p) for p in suites]
    merged = results[0]
    for r in results[1:]:
        merged.tasks.update(r.tasks)
    return merged


def derive_model(evidence: Path | None) -> Derived:
    """A model's own task scores and n and its pooled safety rates, as `flows.measuring.eval_metrics` logs them."""
    from evals.results import aggregate, pooled_rate

    out = Derived()
    try:
        result = load_evals(evidence)
    except (ValueError, KeyError, TypeError) as exc:
        out.problems.append(f"per-sample logs do not load: {exc}")
        return out
    if result is None:
        return out
    for name, t in result.tasks.items():
        score = aggregate(t.metric, [s.score for s in t.samples], [s.weight for s in t.samples])
        out.metrics.update(M.task_metrics(name, score, n=len(t.samples)))
    for key, metric in ((M.SAFETY_REFUSAL_RATE, "refusal_rate"), (M.SAFETY_OVER_REFUSAL_RATE, "over_refusal_rate")):
        pooled = pooled_rate(result.tasks.values(), metric)
        if pooled is not None:
            out.metrics[key] = pooled[0]
    out.families.append(f"tasks {', '.join(sorted(result.tasks))} from their per-sample logs")
    return out


def derive_pair(base: Path | None, var: Path | None, variant: str, baseline: str) -> Derived:
    """A variant's paired metrics against the baseline from both runs' records, each family on its own."""
    out = derive_model(var)
    for family in (_tasks, _fidelity, _long_context, _speed):
        try:
            family(out, base, var, variant, baseline)
        except (ValueError, KeyError, TypeError, IndexError, ZeroDivisionError) as exc:
            out.problems.append(f"{family.__name__.lstrip('_').replace('_', ' ')}: the records do not re-derive "
                                f"({type(exc).__name__}: {exc})")
    return out


def _tasks(out: Derived, base: Path | None, var: Path | None, variant: str, baseline: str) -> None:
    from evals.compare import compare
    from gates.judging.power import flip_rates

    b, v = load_evals(base), load_evals(var)
    if b is None or v is None:
        return
    comparison = compare(b, {variant: v})  # the release's defaults: DEFAULT_SEED, DEFAULT_BOOT, alpha 0.05
    for row in comparison.rows:
        out.metrics.update(M.task_metrics(row.task, row.variant_score, delta=row.delta, ci_low=row.ci_low,
                                          ci_high=row.ci_high, n=row.n))
    out.flip_rates = flip_rates(comparison.to_json())
    out.families.append(f"paired task CIs ({comparison.n_boot} resamples, seed {comparison.seed} + crc32)")


def _both(base: Path | None, var: Path | None, name: str) -> tuple[Path, Path] | None:
    if base is None or var is None or not (base / name).is_file() or not (var / name).is_file():
        return None
    return base / name, var / name


def _fidelity(out: Derived, base: Path | None, var: Path | None, variant: str, baseline: str) -> None:
    from evals import fidelity as F

    files = _both(base, var, FIDELITY_FILE)
    if files is None:
        return
    r = F.compare(F.load(files[0]), F.load(files[1]))
    out.metrics.update({G.FIDELITY_KL: r.kl, G.ci_key(G.FIDELITY_KL, "low"): r.kl_ci_low,
                        G.ci_key(G.FIDELITY_KL, "high"): r.kl_ci_high, G.FIDELITY_FLIP_RATE: r.flip_rate,
                        G.ci_key(G.FIDELITY_FLIP_RATE, "low"): r.flip_ci_low,
                        G.ci_key(G.FIDELITY_FLIP_RATE, "high"): r.flip_ci_high,
                        G.FIDELITY_POSITIONS: float(r.positions), G.FIDELITY_TAIL_MASS: r.tail_mass})
    out.families.append(f"fidelity from {r.chunks} chunks' top-k logprobs")


def _long_context(out: Derived, base: Path | None, var: Path | None, variant: str, baseline: str) -> None:
    from evals import long_context as L

    files = _both(base, var, PROBES_FILE)
    if files is None:
        return
    rows = L.compare(L.load(files[0]), L.load(files[1]))  # seed 0 + length, as flows.fidelity_stage calls it
    for row in rows.values():
        values = {"baseline": row.baseline, "variant": row.variant, "delta": row.delta, "delta_ci_low": row.ci_low,
                  "delta_ci_high": row.ci_high, "n": float(row.n)}
        out.metrics.update({G.long_context_key(row.length, f): float(x) for f, x in values.items()})
    out.families.append(f"long context from each probe's answer ({', '.join(map(str, rows))} tokens)")


def _speed(out: Derived, base: Path | None, var: Path | None, variant: str, baseline: str) -> None:
    import statistics

    from gates.judging.speed_verdicts import ratio_ci

    path = var / SPEED_FILE if var is not None else None
    if path is None or not path.is_file():
        return
    record: dict[str, Any] = json.loads(path.read_text())
    from gates.evidence import speed_replay

    if speed_replay.is_sequential(record):  # group-sequential rounds: every look replayed
        metrics, problems = speed_replay.derive(record, variant, baseline)
        out.metrics.update(metrics)
        out.problems += problems
        out.families.append(f"speed from every round and look of {', '.join(sorted(record['rounds'][variant]))} "
                            f"(group-sequential, looks every {speed_replay.design_of(record).look_every} rounds)")
        return
    unknown = set(record.get("plan", {})) - _FIXED_SPEED_PLAN
    if unknown:
        out.notes.append(f"speed: {SPEED_FILE} has plan fields {sorted(unknown)} this verify does not know (not "
                         "a fixed-round plan): its gates are hash-checked only")
        return
    rounds = record["rounds"]
    mine, ref = rounds[variant], rounds[baseline]
    for point, values in mine.items():
        out.metrics[M.paired_tps(point)] = statistics.median(values)
        ratios = [v / b for v, b in zip(values, ref[point], strict=True)]
        out.metrics.update(ratio_ci(ratios).metrics(_point_key(point)))
    out.metrics[M.SERVE_SPEED_ROUNDS] = float(min(len(v) for v in mine.values()))
    out.families.append(f"speed from every round of {', '.join(mine)}")


def _point_key(point: str) -> str:
    from gates.evidence.speed_replay import point_key

    return point_key(point)


_GATE_OF = (  # metric key -> the gate that reads it
    (re.compile(r"^task/(.+)/(score|n|delta|delta_ci_low|delta_ci_high)$"), r"task/\1/max_drop"),
    (re.compile(r"^safety/refusal_rate$"), "safety/refusal_rate/max_fall"),
    (re.compile(r"^safety/over_refusal_rate$"), "safety/over_refusal_rate/max_rise"),
    (re.compile(r"^fidelity/kl(_ci_low|_ci_high)?$"), "fidelity/kl/max"),
    (re.compile(r"^fidelity/flip_rate(_ci_low|_ci_high)?$"), "fidelity/flip_rate/max"),
    (re.compile(r"^fidelity/(positions|tail_mass)$"), "fidelity/kl/max and fidelity/flip_rate/max"),
    (re.compile(r"^long_context/(\d+)/.+$"), r"long_context/\1/max_drop"),
    (re.compile(r"^serve/decode_speedup_b(\d+)(_ci_low|_ci_high)?$"), r"serve/min_decode_speedup/b\1"),
    (re.compile(r"^serve/paired_decode_b(\d+)_tps$"), r"serve/min_decode_speedup/b\1"),
    (re.compile(r"^serve/point/decode_b(\d+)/.+$"), r"serve/min_decode_speedup/b\1"),
    (re.compile(r"^serve/long_decode_speedup_b(\d+)(_ci_low|_ci_high)?$"), r"serve/min_decode_speedup/long_b\1"),
    (re.compile(r"^serve/(paired_long_decode_b|point/long_decode_b)(\d+)(_tps|/.+)$"),
     r"serve/min_decode_speedup/long_b\2"),
    (re.compile(r"^serve/point/prefill/.+$"), "serve/min_prefill_speedup"),
    (re.compile(r"^serve/(prefill_speedup(_ci_low|_ci_high)?|paired_prefill_tps)$"), "serve/min_prefill_speedup"),
    (re.compile(r"^serve/speed_rounds$"), "the speed gates"),
)

# gate name -> the metric (of the variant) without which it cannot have been re-derived
_DECIDED_BY = (
    (re.compile(r"^task/(.+)/max_drop$"), r"task/\1/delta_ci_low"),
    (re.compile(r"^safety/refusal_rate/max_fall$"), M.SAFETY_REFUSAL_RATE),
    (re.compile(r"^safety/over_refusal_rate/max_rise$"), M.SAFETY_OVER_REFUSAL_RATE),
    (re.compile(r"^fidelity/kl/max$"), "fidelity/kl_ci_high"),
    (re.compile(r"^fidelity/flip_rate/max$"), "fidelity/flip_rate_ci_high"),
    (re.compile(r"^long_context/(\d+)/max_drop$"), r"long_context/\1/delta_ci_low"),
    (re.compile(r"^serve/min_decode_speedup/b(\d+)$"), r"serve/decode_speedup_b\1_ci_low"),
    (re.compile(r"^serve/min_decode_speedup/long_b(\d+)$"), r"serve/long_decode_speedup_b\1_ci_low"),
    (re.compile(r"^serve/min_prefill_speedup$"), "serve/prefill_speedup_ci_low"),
)


def gate_of(key: str) -> str:
    """The gate a re-derived metric feeds (for naming it in a mismatch)."""
    for pattern, gate in _GATE_OF:
        if pattern.match(key):
            return pattern.sub(gate, key)
    return "no gate"


def rederived(gate: str, variant: Derived, baseline: Derived | None) -> bool:
    """Whether every input the gate reads was recomputed from items (a safety gate also needs the baseline's)."""
    for pattern, key in _DECIDED_BY:
        if pattern.match(gate):
            needed = pattern.sub(key, gate)
            if gate.startswith("safety/"):
                return needed in variant.metrics and baseline is not None and needed in baseline.metrics
            return needed in variant.metrics
    return False


__all__ = ["Derived", "derive_model", "derive_pair", "gate_of", "load_evals", "rederived"]
