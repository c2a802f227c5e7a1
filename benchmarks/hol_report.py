"""The HOL lab's pictures and table: short-request completion CDF, slot Gantt chart, the printed report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import fmt, pyplot, save_figure
from serving.loadgen.stats import ratio, summarize

SCHEDULERS = ("static", "continuous", "dynamic")
COLORS = {"short": "#1f77b4", "long": "#ff7f0e", "static": "#d62728", "continuous": "#2ca02c",
          "dynamic": "#9467bd"}


def plot_short_cdf(runs: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in runs.items():
        times = sorted(d["completion"] for d in run.requests if d["kind"] == "short")
        if not times:
            continue
        ys = [(i + 1) / len(times) for i in range(len(times))]
        p99 = summarize(times)["p99"]
        ax.step([times[0]] + times, [0.0] + ys, where="post", color=COLORS[name],
                label=f"{name} batching (p99 {p99:.2f} s)")
        ax.axvline(p99, color=COLORS[name], linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("completion time of short requests (s, arrival → last token)")
    ax.set_ylabel("fraction of short requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("Head-of-line blocking: short-request latency CDF")
    return save_figure(fig, path)


def plot_gantt(runs: dict[str, Any], path: Path) -> Path:
    """Which request held which batch slot when; a grey line is a request waiting for a slot."""
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 + 2.2 * len(runs)), sharex=True, squeeze=False)
    for ax, (name, run) in zip(axes[:, 0], runs.items(), strict=True):
        info = {d["request_id"]: d for d in run.requests}
        admitted: set[str] = set()
        for iv in run.intervals:
            req = info.get(iv.request_id, {})
            if iv.request_id not in admitted and req:  # waiting from arrival to the first admission
                admitted.add(iv.request_id)
                if iv.start - req["arrival"] > 0:
                    ax.hlines(iv.slot, req["arrival"], iv.start, color="#888888", linewidth=1, alpha=0.7, zorder=0.5)
            ax.barh(iv.slot, iv.end - iv.start, left=iv.start, height=0.8,
                    color=COLORS[req.get("kind", "short")], edgecolor="white", linewidth=0.5)
        ax.set_ylabel("batch slot")
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.set_title(f"{name} batching: {len(run.requests)} requests, done at {run.makespan:.1f} s", fontsize=10)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time since the start (s)")
    handles = [Patch(color=COLORS["short"], label="short request"), Patch(color=COLORS["long"], label="long request"),
               Line2D([], [], color="#888888", label="waiting for a slot (arrival → admission)")]
    fig.legend(handles=handles, loc="upper center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return save_figure(fig, path)


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    cfg = report["config"]
    runs = report["schedulers"]
    s, c = runs["static"], runs["continuous"]
    d = runs.get("dynamic")  # reports saved before the dynamic policy have two columns
    names = [n for n in SCHEDULERS if n in runs]
    table = Table(title=f"HOL lab: {cfg['num_requests']} requests ({cfg['arrivals']}), "
                        f"batch {cfg['max_num_seqs']}, {cfg['model']} on {cfg['device']}")
    table.add_column("metric")
    for name in names:
        title = f"dynamic ({fmt(cfg.get('batch_timeout_ms'), 0)} ms)" if name == "dynamic" else name
        table.add_column(title, justify="right")
    table.add_column("static / continuous", justify="right")
    rows = [
        ("short completion p50 (s)", "completion_short_s", "p50"),
        ("short completion p95 (s)", "completion_short_s", "p95"),
        ("short completion p99 (s)", "completion_short_s", "p99"),
        ("all completion p50 (s)", "completion_all_s", "p50"),
        ("all completion p99 (s)", "completion_all_s", "p99"),
        ("TTFT p50 (s)", "ttft_s", "p50"),
        ("TTFT p99 (s)", "ttft_s", "p99"),
        ("TPOT p50 (ms)", "tpot_s", "p50"),
        ("TPOT p99 (ms)", "tpot_s", "p99"),
    ]
    for label, key, stat in rows:
        scale = 1000 if "ms" in label else 1
        values = [runs[n][key][stat] for n in names]
        table.add_row(label, *(fmt(v and v * scale, 2) for v in values),
                      fmt(ratio(s[key][stat], c[key][stat]), 2) + "×")
    plain = [("throughput (tok/s)", "throughput_tokens_per_s", 1), ("makespan (s)", "makespan_s", 1),
             ("mean batch size", "mean_batch_size", 1)]
    for label, key, digits in plain:
        ratio_text = fmt(ratio(s[key], c[key]), 2) + "×" if key == "throughput_tokens_per_s" else ""
        table.add_row(label, *(fmt(runs[n][key], digits) for n in names), ratio_text)
    table.add_row("short completion p99 (steps)", *(fmt(runs[n]["completion_short_steps"]["p99"], 0) for n in names),
                  fmt(report["short_p99_speedup_steps"], 2) + "×")
    if d is not None:
        table.add_row("padding waste (padded / useful slots)", *("" for _ in names[:-1]),
                      fmt(d.get("padding_waste"), 2), "")
    console.print(table)
    console.print(
        f"short-request p99: continuous/static = {fmt(report['short_p99_continuous_over_static'], 3)} → "
        f"[bold]{fmt(report['short_p99_speedup'], 1)}× better[/bold] with continuous batching"
    )
    console.print(f"report: {report['json']}")
    for name, p in report["plots"].items():
        console.print(f"{name}: {p}")

