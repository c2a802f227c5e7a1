"""Throughput and p99 TPOT against the maximum batch size (and KV budget), for one workload.

Bigger batches raise throughput until the step gets compute-bound or the KV cache runs out (then
preemption recomputes work), while every request's TPOT grows with the batch: the best operating
point is a property of the workload and the machine, so measure it. Each point runs the same mixed
workload (the HOL lab's, continuous batching) through the real engine.

    quantgate bench sweep --batch-sizes 2,4,8,16,32 --kv-blocks auto,64
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

from benchmarks.common import output_dir, pyplot, save_figure
from benchmarks.hol_lab import kv_blocks_for, make_workload, run_workload, summarize_run
from serving.loadgen.report import machine, write_json

MARKERS = "osD^v<>"


def best_point(points: list[dict[str, Any]], slo_tpot_ms: float | None = None) -> dict[str, Any] | None:
    """The highest-throughput point whose p99 TPOT meets the SLO (any point when there is none)."""
    ok = [p for p in points if slo_tpot_ms is None or (p["tpot_p99_ms"] is not None and p["tpot_p99_ms"] <= slo_tpot_ms)]
    return max(ok, key=lambda p: p["throughput_tokens_per_s"], default=None)


def run_sweep(
    model: str = "smollm2-135m",
    *,
    batch_sizes: tuple[int, ...] = (2, 4, 8, 16, 32),
    kv_blocks: tuple[int | None, ...] = (None,),
    num_requests: int = 32,
    short_tokens: tuple[int, int] = (8, 32),
    long_tokens: tuple[int, int] = (64, 128),
    short_fraction: float = 0.8,
    rate: float | None = None,
    seed: int = 0,
    slo_tpot_ms: float | None = None,
    device: str | None = None,
    dtype: str | None = None,
    max_num_batched_tokens: int = 512,
    out_dir: str | Path | None = None,
    plots: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """`kv_blocks`: KV budgets in blocks; None means enough for the largest batch (no preemption)."""
    from serving import LLMEngine, SamplingParams

    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must be positive integers, got {batch_sizes}")
    if any(k is not None and k < 1 for k in kv_blocks):
        raise ValueError(f"KV budgets must be positive numbers of blocks, got {kv_blocks}")
    workload = make_workload(num_requests, short_fraction=short_fraction, short_tokens=short_tokens,
                             long_tokens=long_tokens, rate=rate, seed=seed)
    out = output_dir(out_dir, "sweep")
    base = LLMEngine.from_pretrained(model, device=device, dtype=dtype, num_kv_blocks=1, max_num_seqs=1)
    roomy = kv_blocks_for(base, workload, max(batch_sizes))
    points = []
    for budget in kv_blocks:
        blocks = budget or roomy
        for batch in batch_sizes:
            engine = LLMEngine(base.model, base.tokenizer, device=base.device, scheduler="continuous",
                               max_num_seqs=batch, num_kv_blocks=blocks,
                               max_num_batched_tokens=max_num_batched_tokens, model_name=str(model))
            engine.generate(["warm up"] * min(batch, 4), SamplingParams(max_tokens=3, temperature=0.0))
            try:
                run = run_workload(engine, workload, label=f"batch {batch:>3} kv {blocks:>5}", progress=progress)
            except ValueError as exc:  # a request longer than the whole budget: say which point
                raise ValueError(f"KV budget {blocks} blocks, batch {batch}: {exc}") from None
            s = summarize_run(run)
            points.append({
                "max_num_seqs": batch,
                "num_kv_blocks": blocks,
                "kv_budget": "auto" if budget is None else budget,
                "throughput_tokens_per_s": s["throughput_tokens_per_s"],
                "throughput_requests_per_s": s["throughput_requests_per_s"],
                "tpot_p50_ms": _ms(s["tpot_s"]["p50"]),
                "tpot_p99_ms": _ms(s["tpot_s"]["p99"]),
                "ttft_p99_s": s["ttft_s"]["p99"],
                "completion_p99_s": s["completion_all_s"]["p99"],
                "mean_batch_size": s["mean_batch_size"],
                "num_preemptions": s["num_preemptions"],
                "makespan_s": s["makespan_s"],
            })
            del engine
            gc.collect()
    best = best_point(points, slo_tpot_ms)
    report: dict[str, Any] = {
        "benchmark": "sweep",
        "config": {"model": str(model), "device": str(base.device), "num_requests": num_requests,
                   "short_tokens": list(short_tokens), "long_tokens": list(long_tokens),
                   "short_fraction": short_fraction, "arrivals": "all at once" if rate is None else f"{rate} req/s",
                   "seed": seed, "batch_sizes": list(batch_sizes), "block_size": base.block_size,
                   "slo_tpot_ms": slo_tpot_ms},
        "machine": machine(),
        "points": points,
        "best": best,
        "plots": {},
    }
    if plots:
        report["plots"] = {"sweep": str(plot_sweep(report, out / "sweep.png"))}
    report["json"] = str(write_json(out / "sweep.json", report))
    return report


def plot_sweep(report: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    budgets: dict[str, list[dict]] = {}
    for p in report["points"]:
        budgets.setdefault(str(p["kv_budget"]), []).append(p)
    for i, (budget, pts) in enumerate(budgets.items()):
        label = "KV: enough for all" if budget == "auto" else f"KV: {budget} blocks"
        xs = [p["max_num_seqs"] for p in pts]
        marker = MARKERS[i % len(MARKERS)]
        top.plot(xs, [p["throughput_tokens_per_s"] for p in pts], marker=marker, label=label)
        bottom.plot(xs, [p["tpot_p99_ms"] for p in pts], marker=marker, label=label)
    best = report["best"]
    if best:
        top.scatter([best["max_num_seqs"]], [best["throughput_tokens_per_s"]], s=220, facecolors="none",
                    edgecolors="red", linewidths=2, zorder=5, label="best operating point")
    slo = report["config"]["slo_tpot_ms"]
    if slo:
        bottom.axhline(slo, color="red", linestyle="--", linewidth=1, label=f"TPOT SLO {slo:g} ms")
    top.set_ylabel("output tokens/s")
    bottom.set_ylabel("p99 TPOT (ms)")
    bottom.set_xlabel("max batch size (max_num_seqs)")
    bottom.set_xscale("log", base=2)
    bottom.set_xticks(report["config"]["batch_sizes"], [str(b) for b in report["config"]["batch_sizes"]])
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    top.set_title(f"{report['config']['model']}: throughput and p99 TPOT vs batch size", fontsize=10)
    return save_figure(fig, path)


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="sweep: continuous batching, one workload")
    for col in ("batch", "KV blocks", "tok/s", "p50 TPOT ms", "p99 TPOT ms", "p99 TTFT s", "mean batch",
                "preemptions"):
        table.add_column(col, justify="right")
    best = report["best"]
    for p in report["points"]:
        mark = " ★" if p is best or p == best else ""
        table.add_row(f"{p['max_num_seqs']}{mark}", str(p["num_kv_blocks"]), f"{p['throughput_tokens_per_s']:.1f}",
                      _f(p["tpot_p50_ms"]), _f(p["tpot_p99_ms"]), _f(p["ttft_p99_s"], 2),
                      _f(p["mean_batch_size"]), str(p["num_preemptions"]))
    console = Console()
    console.print(table)
    if best:
        console.print(f"best operating point: batch {best['max_num_seqs']}, {best['num_kv_blocks']} KV blocks "
                      f"({best['throughput_tokens_per_s']:.1f} tok/s, p99 TPOT {_f(best['tpot_p99_ms'])} ms)")
    console.print(f"report: {report['json']}")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
