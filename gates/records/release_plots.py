"""PNG figures logged next to the verdicts, coloured by the verdict each point got (pass / fail /
uninformative / underpowered) with the gate's threshold drawn: per-task paired deltas, per-point paired speed
ratios, and a release's variants side by side. Every title says what is shown and its n."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from gates import metric_names as M
from gates.judging.policy import Policy
from gates.judging.verdicts import UNINFORMATIVE, GateResult
from gates.records.run_notes import gate_ci, metric_of

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# One colour per verdict in every figure: a refused variant can never look all green.
VERDICT_COLOURS = {"pass": "tab:green", "fail": "tab:red", UNINFORMATIVE: "tab:grey", "underpowered": "tab:orange"}
THRESHOLD_COLOUR = "black"


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def verdict_class(result: GateResult | None, ok: bool) -> str:
    """The colour key of a gate: its recorded verdict; `ok` (CI vs threshold) only where none was recorded."""
    if result is None:
        return "pass" if ok else "fail"
    if result.verdict in ("fail", UNINFORMATIVE):
        return result.verdict
    return "underpowered" if result.underpowered else "pass"


def _legend(ax: Axes, shown: set[str]) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, marker="o", linestyle="", label=k) for k, c in VERDICT_COLOURS.items()
               if k in shown]
    handles.append(Line2D([], [], color=THRESHOLD_COLOUR, linestyle="--", label="threshold"))
    ax.legend(handles=handles, fontsize="small", loc="best")


def task_delta_figure(metrics: Mapping[str, float], policy: Policy, title: str,
                      verdicts: Mapping[str, GateResult] | None = None) -> Figure | None:
    """Point delta and CI per task against the tolerated drop (dashed), coloured by the task gate's verdict."""
    tasks = sorted(t for t in M.tasks_in(metrics) if M.task_delta(t) in metrics)
    if not tasks:
        return None
    verdicts = verdicts or {}
    fig = _figure(8, 0.5 * len(tasks) + 1.8)
    ax = fig.add_subplot()
    shown, labels = set(), []
    for i, task in enumerate(tasks):
        delta = metrics[M.task_delta(task)]
        low = metrics.get(M.task_delta_ci_low(task), delta)
        high = metrics.get(M.task_delta_ci_high(task), delta)
        gate = policy.task_gate(task)
        limit = -gate.max_drop if gate.higher_is_better else gate.max_drop
        ok = low >= limit if gate.higher_is_better else high <= limit
        kind = verdict_class(verdicts.get(f"task/{task}/max_drop"), ok)
        shown.add(kind)
        ax.errorbar([delta], [i], xerr=[[delta - low], [high - delta]], fmt="o", capsize=4,
                    color=VERDICT_COLOURS[kind], gid=f"task:{task}:{kind}")
        ax.plot([limit, limit], [i - 0.4, i + 0.4], color=THRESHOLD_COLOUR, linestyle="--", linewidth=1.5)
        n = metrics.get(M.task_key(task, "n"))
        labels.append(f"{task} (n={n:.0f}) {kind}" if n is not None else f"{task} {kind}")
    ax.axvline(0.0, color="grey", linewidth=0.8)
    ax.set_yticks(range(len(tasks)), labels)
    ax.set_xlabel("variant − baseline (paired delta, 95 % CI); dashed = tolerated change")
    ax.set_title(f"{title}\n{len(tasks)} task gates, colour = verdict")
    _legend(ax, shown)
    return fig


def _speed_point(gate: str) -> str:
    """The operating point a speed gate judges (`decode_b16`, `long_decode_b1`, `prefill`)."""
    tail = gate.rsplit("/", 1)[1]
    return "prefill" if tail == "min_prefill_speedup" else ("long_decode_" if tail.startswith("long_") else "decode_") \
        + tail.removeprefix("long_")


def _point_order(gate: str) -> tuple[int, int]:
    point = _speed_point(gate)
    digits = "".join(ch for ch in point if ch.isdigit())
    return (0 if point == "prefill" else 2 if point.startswith("long") else 1, int(digits or 0))


def speed_figure(metrics: Mapping[str, float], results: Sequence[GateResult], title: str) -> Figure | None:
    """Each speed gate's paired ratio (variant / baseline tok/s) and CI against its minimum, per operating
    point, coloured by verdict; a FAIL is written beside its point."""
    gates = sorted((r for r in results if r.name.startswith("serve/min_") and metric_of(r.name)), key=lambda r:
                   _point_order(r.name))
    if not gates:
        return None
    fig = _figure(8, 0.55 * len(gates) + 1.8)
    ax = fig.add_subplot()
    shown, labels = set(), []
    for i, r in enumerate(gates):
        key = metric_of(r.name)
        estimate = metrics.get(key, r.observed)
        ci = gate_ci(r.name, dict(metrics))
        kind = verdict_class(r, r.passed)
        shown.add(kind)
        if estimate is not None:
            low, high = ci or (estimate, estimate)
            ax.errorbar([estimate], [i], xerr=[[estimate - low], [high - estimate]], fmt="o", capsize=4,
                        color=VERDICT_COLOURS[kind], gid=f"speed:{r.name}:{kind}")
            if kind == "fail":
                ax.annotate(f"FAIL {estimate:.3g}×", (high, i), xytext=(6, -3), textcoords="offset points",
                            color=VERDICT_COLOURS["fail"], fontweight="bold")
        ax.plot([r.threshold, r.threshold], [i - 0.4, i + 0.4], color=THRESHOLD_COLOUR, linestyle="--", linewidth=1.5)
        point = _speed_point(r.name)
        rounds = metrics.get(M.speed_point(point, "rounds"), metrics.get(M.SERVE_SPEED_ROUNDS))
        labels.append(f"{point} (n={rounds:.0f} rounds) {kind}" if rounds is not None else f"{point} {kind}")
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_yticks(range(len(gates)), labels)
    ax.set_xlabel("variant / baseline tok/s (geometric mean of paired per-round ratios, CI); dashed = minimum")
    ax.set_title(f"{title}\n{len(gates)} speed gates, colour = verdict")
    _legend(ax, shown)
    return fig


def comparison_figure(variants: Sequence[tuple[str, Mapping[str, float]]], baseline: Mapping[str, float],
                      verdicts: Mapping[str, Sequence[GateResult]] | None = None) -> Figure:
    """Side by side: task deltas (with CI) per variant, weight MB, and each variant's paired decode speedups
    per batch with CI against the minimum (a failed point drawn red): the paired ratio, not raw tok/s, is
    what the speed gates judge."""
    verdicts = verdicts or {}
    fig = _figure(13, 4.2)
    axes = fig.subplots(1, 3)
    _comparison_tasks(axes[0], variants)
    rows = [("baseline", baseline), *variants]
    names = [n for n, m in rows if M.WEIGHTS_BYTES in m]
    axes[1].bar(names, [m[M.WEIGHTS_BYTES] / 1e6 for n, m in rows if M.WEIGHTS_BYTES in m],
                color=["grey" if n == "baseline" else "tab:blue" for n in names])
    axes[1].set_title("weight MB (served)" if names else "weight MB: not measured")
    axes[1].tick_params(axis="x", labelrotation=30)
    _comparison_speed(axes[2], variants, verdicts)
    fig.suptitle(f"{len(variants)} variants vs baseline")
    return fig


def _comparison_tasks(ax: Axes, variants: Sequence[tuple[str, Mapping[str, float]]]) -> None:
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
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=name)
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ns = sorted({int(m[M.task_key(t, "n")]) for _, m in variants for t in tasks if M.task_key(t, "n") in m})
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))], tasks, rotation=30, ha="right")
    ax.set_title(f"task delta vs baseline (95 % CI), n={'/'.join(map(str, ns)) or '?'} items")
    if variants:
        ax.legend(fontsize="small")


def _comparison_speed(ax: Axes, variants: Sequence[tuple[str, Mapping[str, float]]],
                      verdicts: Mapping[str, Sequence[GateResult]]) -> None:
    width = 0.8 / max(1, len(variants))
    points: list[str] = []
    for j, (name, m) in enumerate(variants):
        gates = sorted((r for r in verdicts.get(name, ()) if r.name.startswith("serve/min_decode_speedup/b")),
                       key=lambda r: _point_order(r.name))
        for r in gates:
            point = _speed_point(r.name)
            points += [point] if point not in points else []
            estimate, ci = m.get(metric_of(r.name) or ""), gate_ci(r.name, dict(m))
            if estimate is None:
                continue
            low, high = ci or (estimate, estimate)
            x = points.index(point) + j * width
            ax.errorbar([x], [estimate], yerr=[[estimate - low], [high - estimate]], fmt="o", capsize=3,
                        color=f"C{j}", markeredgecolor=VERDICT_COLOURS["fail"] if r.verdict == "fail" else f"C{j}",
                        markersize=9 if r.verdict == "fail" else 6, label=name if r is gates[0] else None)
            if r.verdict == "fail":
                ax.annotate("FAIL", (x, high), xytext=(0, 4), textcoords="offset points", ha="center",
                            color=VERDICT_COLOURS["fail"], fontweight="bold", fontsize="small")
            ax.plot([x - width / 2, x + width / 2], [r.threshold] * 2, color=THRESHOLD_COLOUR, linestyle="--")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(points))], points, rotation=30, ha="right")
    ax.set_title("paired decode speedup per batch (CI); dashed = minimum" if points
                 else "paired decode speedup: no speed gates recorded")
    if points:
        ax.legend(fontsize="small")
