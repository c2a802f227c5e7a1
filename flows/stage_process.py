"""A memory-heavy stage in a child process, so that a kill by the OS is a failure the flow records.

The out-of-memory killer sends SIGKILL: no handler, no `finally`, no MLflow call runs. A stage run in the
flow's own process takes the flow with it and leaves the release run RUNNING until the next release's orphan
sweep (gates/records/orphans.py). Run in a child (a fresh interpreter, `python -c`, never a fork of the flow's
threads; it is handed the stage pickled on stdin and writes its outcome to a pipe), its death is news the
parent can act on: `run_stage_in_child` raises `StageKilled(stage, signal, peak_bytes)`, and the release flow
marks its run FAILED, naming the stage and the peak, before anything moves an alias (flows/release.py).

The child's peak resident memory is its VmHWM (/proc/<pid>/status, a high-water mark), read while it runs;
a child killed between two reads is covered by `getrusage(RUSAGE_CHILDREN).ru_maxrss` once it is reaped, where
that grew (it is the largest reaped child's peak, this process's life long). The child's result comes back
pickled, its exception too (with the child's traceback as a note; one that cannot be pickled as its nearest
built-in class), so retry rules that read the exception's type see the same type as in-process.

This module imports nothing heavy: the child imports it to run the stage.
"""

from __future__ import annotations

import os
import pickle
import resource
import select
import signal as signals
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any

TAG_FAILED_STAGE = "quantgate.failed_stage"
TAG_FAILED_PEAK_RSS_MB = "quantgate.failed_peak_rss_mb"
TAG_FAILED_SIGNAL = "quantgate.failed_signal"
POLL_S = 0.1  # how often the parent reads the child's VmHWM while it waits


def signal_name(signum: int) -> str:
    try:
        return signals.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StageKilled(RuntimeError):
    """A stage's child process was killed by a signal (SIGKILL with no sender is usually the OOM killer)."""

    def __init__(self, stage: str, signal: int, peak_bytes: int):
        self.stage, self.signal, self.peak_bytes = stage, signal, peak_bytes
        cause = " (a SIGKILL nobody sent is the OS's out-of-memory killer)" if signal == signals.SIGKILL else ""
        super().__init__(f"stage {stage!r}: its process was killed by {signal_name(signal)}{cause}; peak resident "
                         f"memory {self.peak_mb:.0f} MB")

    def __reduce__(self):
        return (StageKilled, (self.stage, self.signal, self.peak_bytes))

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / 1e6

    def tags(self) -> dict[str, str]:
        """What the release run records (flows/release.py)."""
        return {TAG_FAILED_STAGE: self.stage, TAG_FAILED_PEAK_RSS_MB: f"{self.peak_mb:.1f}",
                TAG_FAILED_SIGNAL: signal_name(self.signal)}


def run_stage_in_child(stage: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a child Python process: its result, or its exception raised here, or
    `StageKilled` when a signal ended it. `fn`, the arguments and the result must pickle (`fn` by its module
    and name: a module-level function). The child imports `fn`'s module, never the parent's `__main__` (a
    script without a main guard is not run again, as multiprocessing's spawn would)."""
    payload = pickle.dumps((stage, fn, args, kwargs))
    read_fd, write_fd = os.pipe()
    code = (f"import sys; sys.path[:] = {sys.path!r}; from flows.stage_process import _child_main; "
            f"_child_main({write_fd})")
    before = _children_peak()
    try:
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, pass_fds=(write_fd,))
    finally:
        os.close(write_fd)
    try:
        _send(child, payload)
        peak, data = _wait(child, read_fd)
        child.wait()
    finally:
        os.close(read_fd)
        if child.poll() is None:  # the parent was interrupted: the stage goes with it
            child.kill()
            child.wait()
    after = _children_peak()
    peak = max(peak, after if after > before else 0)
    if data:
        kind, value = pickle.loads(data)
        if kind == "error":
            raise value
        return value
    if child.returncode < 0:
        raise StageKilled(stage, -child.returncode, peak)
    raise RuntimeError(f"stage {stage!r}: its process exited with code {child.returncode} and sent no result")


def _send(child: subprocess.Popen, payload: bytes) -> None:
    try:
        child.stdin.write(payload)
        child.stdin.close()
    except BrokenPipeError:  # it died before reading: its exit status says why
        pass


def _wait(child: subprocess.Popen, fd: int) -> tuple[int, bytes]:
    """The child's peak VmHWM read while it ran, and what it wrote before it closed the pipe (b"": nothing)."""
    peak, chunks = 0, []
    while True:
        peak = max(peak, _vm_hwm(child.pid))
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if ready:
            chunk = os.read(fd, 1 << 20)
            if not chunk:  # every write end is closed: it finished or died
                return peak, b"".join(chunks)
            chunks.append(chunk)
        elif child.poll() is not None and not select.select([fd], [], [], 0)[0]:
            return peak, b"".join(chunks)  # gone, its pipe held open by a process it left behind


def _vm_hwm(pid: int | None) -> int:
    """A live process's peak resident bytes so far (0 where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _children_peak() -> int:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux


def _child_main(fd: int) -> None:
    """The child: read the stage from stdin, run it, write its pickled outcome to `fd`."""
    _die_with_parent()
    stage, fn, args, kwargs = pickle.loads(sys.stdin.buffer.read())
    try:
        message: tuple[str, Any] = ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent, which raises it
        message = ("error", _portable(exc, stage, traceback.format_exc()))
    try:
        data = pickle.dumps(message)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        data = pickle.dumps(("error", RuntimeError(f"stage {stage!r}: its result could not be sent back ({exc})")))
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _portable(exc: BaseException, stage: str, trace: str) -> BaseException:
    """The exception as it will unpickle in the parent, the child's traceback attached as a note."""
    note = f"in the child process of stage {stage!r}:\n{trace}"
    try:
        exc.add_note(note)
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - an exception that does not survive pickling: its nearest built-in class
        pass
    text = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}\n{note}"
    for cls in type(exc).__mro__:
        if cls.__module__ == "builtins" and issubclass(cls, Exception):
            try:
                return cls(text)
            except Exception:  # noqa: BLE001, S112 - constructors that want other arguments
                continue
    return RuntimeError(text)


def _die_with_parent() -> None:
    """Linux: the kernel kills this child when the thread that started it dies (a flow killed mid-stage leaves
    no stage running on; PR_SET_PDEATHSIG). Elsewhere nothing."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signals.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
