"""Stage progress: always in the Prefect run logs; also on stderr while `terminal_progress()` is active:
a rich progress bar on a terminal, one plain line per stage start and end on a pipe or CI log."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TextIO

_display: _Bars | _Lines | None = None  # set while `terminal_progress()` is active
_PREFIX = "[quantgate]"


class _Bars:
    """A rich progress line per stage: bar, count, elapsed time (a terminal is attached)."""

    def __init__(self, progress) -> None:
        self.progress = progress

    def start(self, description: str, total: int) -> int:
        return self.progress.add_task(description, total=total)

    def advance(self, task_id: int, n: int) -> None:
        self.progress.advance(task_id, n)

    def done(self, task_id: int, description: str, total: int, elapsed: float) -> None:
        self.progress.update(task_id, completed=total, description=f"[green]{description}")

    def failed(self, task_id: int, description: str, elapsed: float, exc: BaseException) -> None:
        self.progress.update(task_id, description=f"[red]{description}: failed")

    def note(self, message: str) -> None:
        self.progress.console.print(message)


class _Lines:
    """One plain line per stage start and end, flushed at once: what a pipe or CI log can show."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._lock = threading.Lock()  # stages run in several task threads at once

    def _write(self, line: str) -> None:
        with self._lock:
            self.stream.write(f"{_PREFIX} {line}\n")
            self.stream.flush()

    def start(self, description: str, total: int) -> None:
        self._write(f"{description} ...")

    def advance(self, task_id: None, n: int) -> None:
        pass

    def done(self, task_id: None, description: str, total: int, elapsed: float) -> None:
        self._write(f"{description} done in {elapsed:.1f} s")

    def failed(self, task_id: None, description: str, elapsed: float, exc: BaseException) -> None:
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        detail = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
        self._write(f"{description} FAILED after {elapsed:.1f} s: {detail}")

    def note(self, message: str) -> None:
        self._write(message)


def _logger() -> logging.Logger:
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()  # type: ignore[return-value]
    except MissingContextError:
        return logging.getLogger("quantgate.flows")


@contextmanager
def terminal_progress(log_file: Path | None = None, stream: TextIO | None = None) -> Iterator[None]:
    """Show every stage of the flows run in this process on `stream` (default stderr): a line with a
    bar and elapsed time on a terminal, plain start/end lines when the stream is not a terminal.

    With `log_file`, everything else written to stderr (library progress bars, warnings) goes to that
    file instead of the terminal, so the stage lines stay readable.
    """
    global _display

    with ExitStack() as stack:
        terminal = sys.stderr
        if log_file is not None:
            terminal = stack.enter_context(_stderr_to(log_file))
        terminal = stream or terminal
        if _is_tty(terminal):
            _display = _Bars(stack.enter_context(_rich_progress(terminal)))
        else:
            _display = _Lines(terminal)
        try:
            yield
        finally:
            _display = None


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _rich_progress(terminal: TextIO):
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    return Progress(*columns, console=Console(file=terminal), redirect_stderr=False)


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
    display = _display
    task_id = display.start(description, total) if display is not None else None
    start = time.perf_counter()

    def advance(n: int = 1) -> None:
        if display is not None:
            display.advance(task_id, n)

    try:
        yield advance
    except BaseException as exc:
        elapsed = time.perf_counter() - start
        if display is not None:
            display.failed(task_id, description, elapsed, exc)
        log.error("%s failed after %.1f s", description, elapsed)
        raise
    elapsed = time.perf_counter() - start
    if display is not None:
        display.done(task_id, description, total, elapsed)
    log.info("%s done in %.1f s", description, elapsed)


def note(message: str) -> None:
    """A line for the run log and, when attached, the terminal (above the bars)."""
    _logger().info(message)
    if _display is not None:
        _display.note(message)
