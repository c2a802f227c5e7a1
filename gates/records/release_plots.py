"""PNG figures logged next to the verdicts: per-task paired deltas with their CIs against the gate
threshold, and a release's variants side by side."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from gates import metric_names as M
from gates.judging.policy import Policy

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def task_delta_figure(metrics: Mapping[str, float], policy: Policy, title: str) -> Figure | None:
    """Point delta and CI per task; the tolerated drop as a red tick; green when the gate passes."""
    tasks = sorted(t for t in M.tasks_in(metrics) if M.task_delta(t) in metrics)
    if not tasks:
        return None
    fig = _figure(7, 0.5 * len(tasks) + 1.6)
    ax = fig.add_subplot()
    for i, task in enumerate(tasks):
        delta = metrics[M.task_delta(task)]
        low = metrics.get(M.task_delta_ci_low(task), delta)
        high = metrics.get(M.task_delta_ci_high(task), delta)
        gate = policy.task_gate(task)
        limit = -gate.max_drop if gate.higher_is_better else gate.max_drop
        ok = low >= limit if gate.higher_is_better else high <= limit
        ax.errorbar([delta], [i], xerr=[[delta - low], [high - delta]], fmt="o", capsize=4,
                    color="tab:green" if ok else "tab:red")
        ax.plot([limit, limit], [i - 0.35, i + 0.35], color="tab:red", linewidth=2)
    ax.axvline(0.0, color="grey", linewidth=0.8)
    ax.set_yticks(range(len(tasks)), tasks)
    ax.set_xlabel("variant - baseline (paired delta, CI); red tick = tolerated drop")
    ax.set_title(title)
    return fig


def comparison_figure(variants: Sequence[tuple[str, Mapping[str, float]]], baseline: Mapping[str, float]) -> Figure:
    """Side by side: task deltas (with CI) per variant, weight bytes, decode tok/s, p99 TPOT."""
    fig = _figure(12, 4)
    axes = fig.subplots(1, 4)
    tasks = sorted(set().union(*(M.tasks_in(m) for _, m in variants)) if variants else set())
    width = 0.8 / max(1, len(variants))
    for j, (name, m) in enumerate(variants):
        xs, ys, lo, hi = [], [], [], []
        for i, task in enumerate(tasks):
            if M.task_delta(task) not in m:
                continue
            d = m[M.task_delta(task)]
            xs.append(i + j * width)
            ys.append(d)
            lo.append(d - m.get(M.task_delta_ci_low(task), d))
            hi.append(m.get(M.task_delta_ci_high(task), d) - d)
        axes[0].errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=name)
    axes[0].axhline(0.0, color="grey", linewidth=0.8)
    axes[0].set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))], tasks, rotation=30, ha="right")
    axes[0].set_title("task delta vs baseline (CI)")
    if variants:
        axes[0].legend(fontsize="small")
    rows = [("baseline", baseline), *variants]
    for ax, key, label in (
        (axes[1], M.WEIGHTS_BYTES, "weight MB"),
        (axes[2], M.SERVE_DECODE_TPS, "decode tok/s"),
        (axes[3], M.SERVE_TPOT_P99_S, "p99 TPOT (s)"),
    ):
        names = [n for n, m in rows if key in m]
        values = [m[key] / (1e6 if key == M.WEIGHTS_BYTES else 1.0) for n, m in rows if key in m]
        ax.bar(names, values, color=["grey" if n == "baseline" else "tab:blue" for n in names])
        ax.set_title(label if names else f"{label}: not measured")
        ax.tick_params(axis="x", labelrotation=30)
    return fig
