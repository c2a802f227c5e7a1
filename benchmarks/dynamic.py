"""The dynamic-batching lab: batch size B × timeout T on the HOL lab's mixed workload.

Each (B, T) runs the same workload (80 % short, 20 % long requests at a fixed rate) through the real
engine with the dynamic policy: a static batch closes when B requests wait or the oldest has waited T.
Reports, per point, the short requests' completion p99 and the padding waste a padded batch would carry
(padded token slots / useful ones, see serving/core/dynamic_batching.py), and plots both against B for each T:
a larger B amortises the weights over more rows but makes more short requests wait behind (and pad up
to) a long one, so the best B depends on the workload's mix of lengths, not on the hardware alone.

    quantgate bench dynamic --batch-sizes 1,2,4,8,16 --timeouts-ms 10,100,500
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

from benchmarks.common import fmt, output_dir, pyplot, save_figure
from benchmarks.hol_lab import (
    full_batch_step_time,
    kv_blocks_for,
    make_workload,
    run_workload,
    summarize_run,
)
from serving.loadgen.report import machine, write_json


def run_dynamic_sweep(
    model: str = "smollm2-135m",
    *,
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16),
    timeouts_ms: tuple[float, ...] = (10.0, 100.0, 500.0),
    num_requests: int = 32,
    steps_per_arrival: float = 4.0,
    short_tokens: tuple[int, int] = (8, 32),
    long_tokens: tuple[int, int] = (128, 256),
    short_fraction: float = 0.8,
    seed: int = 0,
    device: str | None = None,
    dtype: str | None = None,
    max_num_batched_tokens: int = 512,
    out_dir: str | Path | None = None,
    plots: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Sweep B × T; write `dynamic.json` (+ `dynamic_sweep.png`) into `out_dir` and return the report.

    Arrivals: one request every `steps_per_arrival` decode steps of a batch of max(B), timed at warm-up,
    so the load relative to the engine's speed is the same on any machine."""
    from serving import LLMEngine

    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch sizes must be positive integers, got {batch_sizes}")
    if not timeouts_ms or min(timeouts_ms) < 0:
        raise ValueError(f"timeouts must be >= 0 ms, got {timeouts_ms}")
    shape = dict(short_fraction=short_fraction, short_tokens=short_tokens, long_tokens=long_tokens, seed=seed)
    workload = make_workload(num_requests, **shape)
    out = output_dir(out_dir, "dynamic")
    base = LLMEngine.from_pretrained(model, device=device, dtype=dtype, num_kv_blocks=1, max_num_seqs=1)
    biggest = max(batch_sizes)
    blocks = kv_blocks_for(base, workload, biggest)

    def engine_for(b: int, timeout_s: float | None = None) -> LLMEngine:
        return LLMEngine(base.model, base.tokenizer, device=base.device, scheduler="dynamic", max_num_seqs=b,
                         num_kv_blocks=blocks, max_num_batched_tokens=max_num_batched_tokens, model_name=str(model),
                         batch_timeout_s=timeout_s)

    step_time = full_batch_step_time(engine_for(biggest), biggest)
    rate = 1.0 / (steps_per_arrival * step_time)
    workload = make_workload(num_requests, rate=rate, **shape)
    points = []
    for t_ms in timeouts_ms:
        for b in sorted(batch_sizes):
            engine = engine_for(b, t_ms / 1000)
            run = run_workload(engine, workload, label=f"B={b:<3} T={t_ms:g} ms", progress=progress)
            points.append(_point(b, t_ms, engine.scheduler, summarize_run(run)))
            del engine
            gc.collect()
    report: dict[str, Any] = {
        "benchmark": "dynamic_batching",
        "config": {
            "model": str(model), "device": str(base.device), "dtype": str(base.model.dtype).removeprefix("torch."),
            "num_requests": num_requests, "short_fraction": short_fraction, "short_tokens": list(short_tokens),
            "long_tokens": list(long_tokens), "rate_requests_per_s": rate, "steps_per_arrival": steps_per_arrival,
            "full_batch_step_s": step_time, "batch_sizes": sorted(batch_sizes), "timeouts_ms": list(timeouts_ms),
            "num_kv_blocks": blocks, "max_num_batched_tokens": max_num_batched_tokens, "seed": seed,
        },
        "machine": machine(),
        "points": points,
        "best_batch_size_by_short_p99": _best(points),
        "plots": {},
    }
    if plots:
        report["plots"]["sweep"] = str(plot_sweep(points, out / "dynamic_sweep.png"))
    report["json"] = str(write_json(out / "dynamic.json", report))
    return report


def _point(b: int, t_ms: float, scheduler, summary: dict[str, Any]) -> dict[str, Any]:
    batches = [x for x in scheduler.batches if x.done]
    return {
        "batch_size": b,
        "timeout_ms": t_ms,
        "short_p99_s": summary["completion_short_s"]["p99"],
        "short_p99_steps": summary["completion_short_steps"]["p99"],
        "all_p99_s": summary["completion_all_s"]["p99"],
        "throughput_tokens_per_s": summary["throughput_tokens_per_s"],
        "padding_waste": scheduler.padding_waste(),
        "num_batches": len(batches),
        "mean_closed_batch_size": sum(x.size for x in batches) / len(batches) if batches else None,
        "closed_on_timeout": sum(x.reason == "timeout" for x in batches) / len(batches) if batches else None,
        "makespan_s": summary["makespan_s"],
    }


def _best(points: list[dict[str, Any]]) -> dict[str, int]:
    """Per timeout, the batch size with the lowest short-request p99."""
    best: dict[str, int] = {}
    for t in sorted({p["timeout_ms"] for p in points}):
        row = [p for p in points if p["timeout_ms"] == t and p["short_p99_s"] is not None]
        if row:
            best[f"{t:g}"] = min(row, key=lambda p: p["short_p99_s"])["batch_size"]
    return best


def plot_sweep(points: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    fig, (ax_p99, ax_pad) = plt.subplots(1, 2, figsize=(11, 4))
    for t in sorted({p["timeout_ms"] for p in points}):
        row = sorted((p for p in points if p["timeout_ms"] == t), key=lambda p: p["batch_size"])
        xs = [p["batch_size"] for p in row]
        ax_p99.plot(xs, [p["short_p99_s"] for p in row], marker="o", label=f"T = {t:g} ms")
        ax_pad.plot(xs, [p["padding_waste"] for p in row], marker="o", label=f"T = {t:g} ms")
    for ax, label in ((ax_p99, "short-request completion p99 (s)"), (ax_pad, "padding waste (padded / useful slots)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max batch size B")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    ax_p99.set_title("Short requests wait for the batch to fill and to finish")
    ax_pad.set_title("A long request pads the whole batch")
    return save_figure(fig, path)


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = report["config"]
    table = Table(title=f"dynamic batching: {cfg['num_requests']} requests at {cfg['rate_requests_per_s']:.3g} req/s, "
                        f"{cfg['model']} on {cfg['device']}")
    for col in ("T (ms)", "B", "short p99 (s)", "short p99 (steps)", "padding waste", "mean batch",
                "closed on timeout", "tok/s"):
        table.add_column(col, justify="right")
    for p in report["points"]:
        table.add_row(f"{p['timeout_ms']:g}", str(p["batch_size"]), fmt(p["short_p99_s"], 2),
                      fmt(p["short_p99_steps"], 0), fmt(p["padding_waste"], 2), fmt(p["mean_closed_batch_size"], 1),
                      fmt(p["closed_on_timeout"] and p["closed_on_timeout"] * 100, 0) + " %",
                      fmt(p["throughput_tokens_per_s"], 1))
    console = Console()
    console.print(table)
    console.print(f"best B by short p99, per T (ms): {report['best_batch_size_by_short_p99']}")
    console.print(f"report: {report['json']}")
    for name, p in report["plots"].items():
        console.print(f"{name}: {p}")
