"""What a load run's report carries besides its numbers: the machine, an atomic JSON file, a progress bar."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    import os

    from serving.kernels.cpu import isa

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **isa.describe(),  # the CPU model, its SIMD flags and the kernel path in force
    }


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
