"""Paired, task-by-task comparison of variants against a baseline, over the same items.

Per task: baseline and variant scores, delta, a paired bootstrap 95 % CI of the delta (fixed seed), the
exact McNemar p-value for binary tasks, and the items that flipped right→wrong and wrong→right with
both outputs. A task is flagged when the variant is worse and the CI of the delta excludes zero (and,
for binary tasks, McNemar rejects at `alpha`). The aggregate row (mean over the binary accuracy tasks)
is shown beside the per-task rows, never instead of them: a 15-point drop on one task can hide in a
mean that moves by 2.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from evals.results import EvalResult, TaskResult

DEFAULT_SEED = 20261129
DEFAULT_BOOT = 2000


@dataclass
class Flip:
    doc_id: int
    item_id: str
    target: str
    baseline_response: str
    variant_response: str


@dataclass
class TaskComparison:
    variant: str
    task: str
    suite: str
    metric: str
    higher_is_better: bool
    binary: bool
    n: int  # paired items
    baseline: float
    variant_score: float
    delta: float  # variant - baseline, in the metric's own units
    ci_low: float
    ci_high: float
    mcnemar_p: float | None
    lost: list[Flip] = field(default_factory=list)  # right → wrong
    gained: list[Flip] = field(default_factory=list)  # wrong → right
    flagged: bool = False
    reason: str = ""


@dataclass
class AggregateComparison:
    variant: str
    tasks: list[str]
    baseline: float
    variant_score: float
    delta: float
    ci_low: float
    ci_high: float


@dataclass
class Comparison:
    baseline: str
    variants: list[str]
    seed: int
    n_boot: int
    alpha: float
    rows: list[TaskComparison]
    aggregates: list[AggregateComparison]

    def flagged(self) -> list[TaskComparison]:
        return [r for r in self.rows if r.flagged]

    def row(self, variant: str, task: str) -> TaskComparison:
        for r in self.rows:
            if r.variant == variant and r.task == task:
                return r
        raise KeyError((variant, task))

    def to_json(self) -> dict:
        return asdict(self)


def mcnemar_exact(lost: int, gained: int) -> float:
    """Two-sided exact McNemar test on the discordant pairs (binomial, p = 0.5)."""
    n = lost + gained
    if n == 0:
        return 1.0
    k = min(lost, gained)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2.0 * tail)


def _agg_counts(metric: str, scores: np.ndarray, weights: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The task's score on each resample, given as item counts (resamples x items); leading axes of
    `scores` carry through."""
    if metric == "bits_per_byte":
        return -(scores @ counts.T) / (weights @ counts.T) / math.log(2)
    return (scores @ counts.T) / counts.shape[1]


def _agg(metric: str, scores: np.ndarray, weights: np.ndarray) -> float:
    return float(_agg_counts(metric, scores, weights, np.ones((1, len(scores))))[0])


def paired_delta_ci(base_scores: np.ndarray, variant_scores: np.ndarray, weights: np.ndarray, metric: str,
                    seed: int, n_boot: int = DEFAULT_BOOT, alpha: float = 0.05
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Percentile bootstrap CI of variant - baseline over paired items (the last axis): (low, high, deltas).

    Leading axes are independent replicates (e.g. simulated draws in gates.judging.power) judged on one set of
    resamples, as one comparison is."""
    n = base_scores.shape[-1]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    counts = np.bincount((idx + n * np.arange(n_boot)[:, None]).ravel(), minlength=n_boot * n)
    counts = counts.reshape(n_boot, n).astype(float)
    deltas = _agg_counts(metric, variant_scores, weights, counts) - _agg_counts(metric, base_scores, weights, counts)
    low, high = np.percentile(deltas, [100 * alpha / 2, 100 * (1 - alpha / 2)], axis=-1)
    return low, high, deltas


def _task_seed(seed: int, variant: str, task: str) -> int:
    return (seed + zlib.crc32(f"{variant}/{task}".encode())) % 2**32


def _paired(base: TaskResult, var: TaskResult) -> list[int]:
    b, v = base.by_doc(), var.by_doc()
    common = sorted(set(b) & set(v))
    for doc_id in common:
        if b[doc_id].item_id != v[doc_id].item_id:
            raise ValueError(f"task {base.task!r}: doc {doc_id} is item {b[doc_id].item_id!r} in the baseline but "
                             f"{v[doc_id].item_id!r} in the variant; the runs used different task data")
    if not common:
        raise ValueError(f"task {base.task!r}: baseline and variant share no items")
    return common


def compare_task(base: TaskResult, var: TaskResult, variant: str, seed: int = DEFAULT_SEED,
                 n_boot: int = DEFAULT_BOOT, alpha: float = 0.05) -> tuple[TaskComparison, np.ndarray]:
    """One task's paired comparison; also returns the bootstrap deltas (for the aggregate)."""
    if base.metric != var.metric:
        raise ValueError(f"task {base.task!r}: metric {base.metric!r} vs {var.metric!r}")
    docs = _paired(base, var)
    b, v = base.by_doc(), var.by_doc()
    bs = np.array([b[d].score for d in docs], dtype=float)
    vs = np.array([v[d].score for d in docs], dtype=float)
    ws = np.array([b[d].weight for d in docs], dtype=float)
    ci_low, ci_high, deltas = paired_delta_ci(bs, vs, ws, base.metric, _task_seed(seed, variant, base.task),
                                              n_boot, alpha)
    low, high = float(ci_low), float(ci_high)
    row = TaskComparison(variant=variant, task=base.task, suite=base.suite, metric=base.metric,
                         higher_is_better=base.higher_is_better, binary=base.binary, n=len(docs),
                         baseline=_agg(base.metric, bs, ws), variant_score=_agg(base.metric, vs, ws),
                         delta=0.0, ci_low=low, ci_high=high, mcnemar_p=None)
    row.delta = round(row.variant_score - row.baseline, 12)  # no "-0.0000" from float noise
    if base.binary:
        for d in docs:
            flip = Flip(d, b[d].item_id, b[d].target, b[d].response, v[d].response)
            if b[d].correct and not v[d].correct:
                row.lost.append(flip)
            elif v[d].correct and not b[d].correct:
                row.gained.append(flip)
        row.mcnemar_p = mcnemar_exact(len(row.lost), len(row.gained))
    worse = row.delta < 0 if base.higher_is_better else row.delta > 0
    ci_excludes_zero = high < 0 if base.higher_is_better else low > 0
    significant = ci_excludes_zero and (row.mcnemar_p is None or row.mcnemar_p < alpha)
    if worse and significant:
        row.flagged = True
        row.reason = (f"{base.metric} {row.baseline:.4f} → {row.variant_score:.4f} "
                      f"(Δ {row.delta:+.4f}, 95% CI [{low:+.4f}, {high:+.4f}]"
                      + (f", McNemar p={row.mcnemar_p:.2g}" if row.mcnemar_p is not None else "") + ")")
    return row, deltas


def compare(baseline: EvalResult, variants: dict[str, EvalResult], seed: int = DEFAULT_SEED,
            n_boot: int = DEFAULT_BOOT, alpha: float = 0.05) -> Comparison:
    if not variants:
        raise ValueError("compare needs at least one variant")
    rows: list[TaskComparison] = []
    aggregates: list[AggregateComparison] = []
    for name, var in variants.items():
        shared = [t for t in baseline.tasks if t in var.tasks]
        if not shared:
            raise ValueError(f"variant {name!r} shares no task with the baseline")
        agg_tasks, agg_deltas, agg_b, agg_v = [], [], [], []
        for task in shared:
            row, deltas = compare_task(baseline.tasks[task], var.tasks[task], name, seed, n_boot, alpha)
            rows.append(row)
            if row.binary and row.suite == "accuracy":
                agg_tasks.append(task)
                agg_deltas.append(deltas)
                agg_b.append(row.baseline)
                agg_v.append(row.variant_score)
        if agg_tasks:
            mean_deltas = np.mean(agg_deltas, axis=0)
            low, high = np.percentile(mean_deltas, [100 * alpha / 2, 100 * (1 - alpha / 2)])
            aggregates.append(AggregateComparison(name, agg_tasks, float(np.mean(agg_b)), float(np.mean(agg_v)),
                                                  round(float(np.mean(agg_v) - np.mean(agg_b)), 12), float(low), float(high)))
    return Comparison(baseline=baseline.model, variants=list(variants), seed=seed, n_boot=n_boot, alpha=alpha,
                      rows=rows, aggregates=aggregates)


def _fmt_p(p: float | None) -> str:
    return "—" if p is None else (f"{p:.2g}" if p < 0.01 else f"{p:.3f}")


def markdown(comparison: Comparison, max_flips: int = 5) -> str:
    lines = [f"# Comparison against baseline `{comparison.baseline}`", "",
             f"Paired bootstrap ({comparison.n_boot} resamples, seed {comparison.seed}), "
             f"{100 * (1 - comparison.alpha):.0f}% CI of Δ = variant − baseline; exact McNemar on binary tasks. "
             "⚠ = significant regression on that task.", "",
             "| variant | task | metric | n | baseline | variant | Δ | 95% CI | McNemar p | right→wrong | wrong→right | |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |"]
    for r in comparison.rows:
        arrow = "↑" if r.higher_is_better else "↓"
        flips = (str(len(r.lost)), str(len(r.gained))) if r.binary else ("—", "—")
        lines.append(f"| {r.variant} | {r.task} | {r.metric} {arrow} | {r.n} | {r.baseline:.4f} | "
                     f"{r.variant_score:.4f} | {r.delta:+.4f} | [{r.ci_low:+.4f}, {r.ci_high:+.4f}] | "
                     f"{_fmt_p(r.mcnemar_p)} | {flips[0]} | {flips[1]} | {'⚠' if r.flagged else ''} |")
    for a in comparison.aggregates:
        lines.append(f"| {a.variant} | **mean of {len(a.tasks)} accuracy tasks** | mean ↑ | | {a.baseline:.4f} | "
                     f"{a.variant_score:.4f} | {a.delta:+.4f} | [{a.ci_low:+.4f}, {a.ci_high:+.4f}] | | | | |")
    flagged = comparison.flagged()
    lines += ["", f"**Flagged:** {len(flagged)} task(s)" + (": " if flagged else ".")]
    for r in flagged:
        lines.append(f"- `{r.variant}` / `{r.task}`: {r.reason}")
    for r in comparison.rows:
        if not r.lost and not r.gained:
            continue
        lines += ["", f"## {r.variant} / {r.task}: {len(r.lost)} right→wrong, {len(r.gained)} wrong→right", "",
                  "| direction | item | target | baseline output | variant output |", "| --- | --- | --- | --- | --- |"]
        for label, flips in (("right→wrong", r.lost), ("wrong→right", r.gained)):
            for f in flips[:max_flips]:
                lines.append(f"| {label} | {f.item_id} | {_cell(f.target)} | {_cell(f.baseline_response)} | "
                             f"{_cell(f.variant_response)} |")
    return "\n".join(lines) + "\n"


def _cell(text: str, limit: int = 80) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def load_results(dirs: list[Path | str]) -> dict[str, EvalResult]:
    """Eval directories → {name: result}; names are directory names, made unique if they collide."""
    out: dict[str, EvalResult] = {}
    for d in dirs:
        name = Path(d).resolve().name
        while name in out:
            name += "'"
        out[name] = EvalResult.load(d)
    return out


def write_report(comparison: Comparison, baseline: EvalResult, variants: dict[str, EvalResult],
                 out_dir: Path | str, seed: int = DEFAULT_SEED) -> dict[str, Path]:
    from evals.plots import plot_flips, plot_scores

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "compare.json",
        "markdown": out_dir / "compare.md",
        "scores_png": out_dir / "scores.png",
        "flips_png": out_dir / "flips.png",
    }
    plot_scores(baseline, variants, paths["scores_png"], seed=seed, flagged={r.task for r in comparison.flagged()})
    plot_flips(comparison, paths["flips_png"])
    paths["markdown"].write_text(markdown(comparison))
    paths["json"].write_text(json.dumps(comparison.to_json(), indent=2, ensure_ascii=False))  # last: complete
    return paths
