"""Helpers every benchmark shares: the results folder, plotting, timing, table cells (the load generator's
statistics, prompts and report helpers are in serving/loadgen)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from serving.loadgen.report import machine, write_json

RESULTS_DIR = Path(__file__).resolve().parent / "results"  # git-ignored


def token_range(text: str, lowest: int) -> tuple[int, int]:
    """An argparse type: `N` or `LO-HI` as (LO, HI), with lowest <= LO <= HI."""
    lo, _, hi = text.partition("-")
    try:
        pair = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI, got {text!r}") from None
    if not lowest <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected {lowest} <= LO <= HI, got {text!r}")
    return pair


def output_dir(path: str | Path | None, name: str) -> Path:
    """The folder a benchmark writes into: the one given, else benchmarks/results/<name>."""
    out = Path(path) if path else RESULTS_DIR / name
    out.mkdir(parents=True, exist_ok=True)
    return out


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (imported lazily: it is slow to import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not fig.get_layout_engine():
        fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def add_kernel_bench_options(parser: argparse.ArgumentParser) -> None:
    """--threads, --out-dir and --no-plots, as every kernel benchmark takes them."""
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--no-plots", dest="plots", action="store_false")


def mean_seconds(fn, reps: int) -> float:
    """Seconds per call of `fn` over `reps` calls, after one untimed warm-up call."""
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def write_rows_report(out_dir: str | Path | None, name: str, rows: list[dict], plot, plots: bool,
                      **fields: Any) -> Path:
    """<name>.json (the fields, the machine, the rows) and, with `plots`, <name>.png drawn by `plot`."""
    out = output_dir(out_dir, name)
    report = {**fields, "machine": machine(), "rows": rows}
    if plots:
        report["png"] = str(plot(rows, out / f"{name}.png"))
    return write_json(out / f"{name}.json", report)


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
