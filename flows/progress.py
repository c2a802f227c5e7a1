"""Stage progress: always in the Prefect run logs; also a rich progress bar when a terminal is attached."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TextIO

_progress = None  # rich.progress.Progress while `terminal_progress()` is active


def _logger() -> logging.Logger:
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()  # type: ignore[return-value]
    except MissingContextError:
        return logging.getLogger("quantgate.flows")


@contextmanager
def terminal_progress(log_file: Path | None = None) -> Iterator[None]:
    """Show every stage of the flows run in this process as a line with a bar and elapsed time.

    With `log_file`, everything else written to stderr (library progress bars, warnings) goes to that
    file instead of the terminal, so the stage bars stay readable.
    """
    global _progress
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    with ExitStack() as stack:
        terminal = sys.stderr
        if log_file is not None:
            terminal = stack.enter_context(_stderr_to(log_file))
        columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        progress = stack.enter_context(Progress(*columns, console=Console(file=terminal), redirect_stderr=False))
        _progress = progress
        try:
            yield
        finally:
            _progress = None


@contextmanager
def _stderr_to(log_file: Path) -> Iterator[TextIO]:
    """Point file descriptor 2 at `log_file`; yield a stream on the real terminal."""
    sys.stderr.flush()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    saved = os.dup(2)
    terminal = os.fdopen(os.dup(saved), "w", buffering=1)
    with open(log_file, "a") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield terminal
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            terminal.close()


@contextmanager
def stage(description: str, total: int = 1) -> Iterator[Callable[[int], None]]:
    """A stage of the release: logged when it starts and ends; yields `advance(n=1)`."""
    log = _logger()
    log.info("%s ...", description)
    progress = _progress
    task_id = progress.add_task(description, total=total) if progress is not None else None
    start = time.perf_counter()

    def advance(n: int = 1) -> None:
        if progress is not None:
            progress.advance(task_id, n)

    try:
        yield advance
    except BaseException:
        if progress is not None:
            progress.update(task_id, description=f"[red]{description}: failed")
        log.error("%s failed after %.1f s", description, time.perf_counter() - start)
        raise
    if progress is not None:
        progress.update(task_id, completed=total, description=f"[green]{description}")
    log.info("%s done in %.1f s", description, time.perf_counter() - start)


def note(message: str) -> None:
    """A line for the run log and, when attached, the terminal (above the bars)."""
    _logger().info(message)
    if _progress is not None:
        _progress.console.print(message)
