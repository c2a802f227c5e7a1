"""Helpers every benchmark shares: percentiles, summaries, JSON output, the results folder, plotting."""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"  # git-ignored


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    data = sorted(values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summarize(values: Iterable[float | None], scale: float = 1.0) -> dict[str, float | int | None]:
    """count, mean, median, p50/p95/p99, min, max of the non-None values, each multiplied by `scale`."""
    data = [v * scale for v in values if v is not None]
    if not data:
        return {"count": 0, "mean": None, "median": None, "p50": None, "p95": None, "p99": None,
                "min": None, "max": None}
    median = percentile(data, 50)
    return {
        "count": len(data),
        "mean": sum(data) / len(data),
        "median": median,
        "p50": median,
        "p95": percentile(data, 95),
        "p99": percentile(data, 99),
        "min": min(data),
        "max": max(data),
    }


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


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def machine() -> dict[str, Any]:
    import os

    from quantgate.kernels import isa

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **isa.describe(),  # the CPU model, its SIMD flags and the kernel path in force
    }


def output_dir(path: str | Path | None, name: str) -> Path:
    """The folder a benchmark writes into: the one given, else benchmarks/results/<name>."""
    out = Path(path) if path else RESULTS_DIR / name
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_json(path: str | Path, obj: Any) -> Path:
    """Write atomically (temp file then rename), so a crash never leaves a half-written report."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_jsonable) + "\n")
    tmp.replace(path)
    return path


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


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


PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.jsonl"


def load_prompts(path: str | Path | None = None) -> list[str]:
    """The shipped prompt set (benchmarks/prompts.jsonl: one {"prompt": ...} per line) or another one."""
    path = Path(path) if path else PROMPTS_FILE
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f'{path}:{n}: expected an object with a non-empty "prompt" string')
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


class ProgressBar:
    """A rich progress bar counting finished items (rich is imported only when one is made)."""

    def __init__(self, total: int, label: str):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self._task = self._bar.add_task(label, total=total)
        self._bar.start()

    def advance(self, n: int = 1) -> None:
        self._bar.advance(self._task, n)

    def stop(self) -> None:
        self._bar.stop()
