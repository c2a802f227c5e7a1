"""PNG plots for comparisons: per-task scores with bootstrap CI bars, and flips per task."""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import numpy as np

from evals.results import EvalResult, TaskResult


def score_ci(task: TaskResult, seed: int, n_boot: int = 1000, alpha: float = 0.05) -> tuple[float, float]:
    """Bootstrap CI of one run's task score (unpaired; for error bars)."""
    scores = np.array([s.score for s in task.samples], dtype=float)
    weights = np.array([s.weight for s in task.samples], dtype=float)
    rng = np.random.default_rng((seed + zlib.crc32(task.task.encode())) % 2**32)
    idx = rng.integers(0, len(scores), size=(n_boot, len(scores)))
    if task.metric == "bits_per_byte":
        boots = -scores[idx].sum(axis=1) / weights[idx].sum(axis=1) / math.log(2)
    else:
        boots = scores[idx].mean(axis=1)
    low, high = np.percentile(boots, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return float(low), float(high)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scores(baseline: EvalResult, variants: dict[str, EvalResult], path: Path, seed: int = 0,
                flagged: set[str] | None = None) -> None:
    """Small multiples, one panel per task; a red title marks a task flagged for some variant."""
    plt = _pyplot()
    runs = {"baseline": baseline, **variants}
    tasks = [t for t in baseline.tasks if all(t in r.tasks for r in variants.values())]
    cols = min(3, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, task in zip(axes.flat, tasks, strict=False):
        names = list(runs)
        scores = [runs[n].tasks[task].score for n in names]
        cis = [score_ci(runs[n].tasks[task], seed) for n in names]
        err = np.array([[s - lo for s, (lo, _) in zip(scores, cis, strict=True)],
                        [hi - s for s, (_, hi) in zip(scores, cis, strict=True)]])
        ax.bar(range(len(names)), scores, yerr=err, capsize=4, color=[colors[i % len(colors)] for i in range(len(names))])
        meta = baseline.tasks[task]
        bad = task in (flagged or set())
        ax.set_title(f"{'⚠ ' if bad else ''}{task} ({meta.metric} {'↑' if meta.higher_is_better else '↓'})",
                     fontsize=10, color="tab:red" if bad else "black")
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        if meta.metric != "bits_per_byte":
            ax.set_ylim(0, 1.05)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.suptitle("Per-task scores, 95% bootstrap CI", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_flips(comparison, path: Path) -> None:
    plt = _pyplot()
    rows = [r for r in comparison.rows if r.binary]
    tasks = list(dict.fromkeys(r.task for r in rows))
    variants = comparison.variants
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(tasks) * max(1, len(variants))), 4.0))
    width = 0.8 / max(1, len(variants))
    x = np.arange(len(tasks))
    for i, variant in enumerate(variants):
        by_task = {r.task: r for r in rows if r.variant == variant}
        lost = [len(by_task[t].lost) if t in by_task else 0 for t in tasks]
        gained = [len(by_task[t].gained) if t in by_task else 0 for t in tasks]
        pos = x - 0.4 + width * (i + 0.5)
        ax.bar(pos, lost, width * 0.9, color="tab:red", alpha=0.5 + 0.5 * (i + 1) / len(variants),
               label=f"{variant}: right→wrong")
        ax.bar(pos, [-g for g in gained], width * 0.9, color="tab:green", alpha=0.5 + 0.5 * (i + 1) / len(variants),
               label=f"{variant}: wrong→right")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(x, tasks, rotation=20)
    ax.set_ylabel("items (lost up, gained down)")
    ax.set_title("Flipped items per task vs baseline")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
