"""A memory-heavy stage in a child process, so that a kill by the OS is a failure the flow records.

The out-of-memory killer sends SIGKILL: no handler, no `finally`, no MLflow call runs. A stage run in the
flow's own process takes the flow with it and leaves the release run RUNNING until the next release's orphan
sweep (gates/records/orphans.py). Run in a child (multiprocessing's spawn context: a fresh interpreter, never
a fork of the flow's threads), its death is news the parent can act on: `run_stage_in_child` raises
`StageKilled(stage, signal, peak_bytes)`, and the release flow marks its run FAILED, naming the stage and the
peak, before anything moves an alias (flows/release.py).

The child's peak resident memory is its VmHWM (/proc/<pid>/status, a high-water mark), read while it runs;
a child killed between two reads is covered by `getrusage(RUSAGE_CHILDREN).ru_maxrss` once it is reaped, where
that grew (it is the largest reaped child's peak, this process's life long). The child's result comes back
pickled, its exception too (with the child's traceback as a note; one that cannot be pickled as its nearest
built-in class), so retry rules that read the exception's type see the same type as in-process.

This module imports nothing heavy: the child imports it to run the stage.
"""

from __future__ import annotations

import multiprocessing
import pickle
import resource
import signal as signals
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
    """`fn(*args, **kwargs)` in a spawned child process: its result, or its exception raised here, or
    `StageKilled` when a signal ended it. `fn`, the arguments and the result must pickle (`fn` by its module
    and name: a module-level function)."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, stage, fn, args, kwargs), name=f"quantgate-{stage}")
    before = _children_peak()
    child.start()
    send.close()
    peak, message = 0, None
    try:
        peak, message = _wait(child, receive)
        child.join()
    finally:
        if child.is_alive():  # the parent was interrupted: the stage goes with it
            child.kill()
            child.join()
        receive.close()
    after = _children_peak()
    peak = max(peak, after if after > before else 0)
    if message is not None:
        kind, value = message
        if kind == "error":
            raise value
        return value
    if child.exitcode is not None and child.exitcode < 0:
        raise StageKilled(stage, -child.exitcode, peak)
    raise RuntimeError(f"stage {stage!r}: its process exited with code {child.exitcode} and sent no result")


def _wait(child, receive) -> tuple[int, tuple[str, Any] | None]:
    """The child's peak VmHWM read so far and its message (None: it ended without one)."""
    peak = 0
    while True:
        peak = max(peak, _vm_hwm(child.pid))
        ended = not child.is_alive()
        if receive.poll(0 if ended else POLL_S):
            try:
                return max(peak, _vm_hwm(child.pid)), receive.recv()
            except EOFError:  # it closed the pipe by dying
                return peak, None
        if ended:
            return peak, None


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


def _child(send, stage: str, fn: Callable, args: tuple, kwargs: dict) -> None:
    _die_with_parent()
    try:
        message: tuple[str, Any] = ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent, which raises it
        message = ("error", _portable(exc, stage, traceback.format_exc()))
    try:
        send.send(message)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        send.send(("error", RuntimeError(f"stage {stage!r}: its result could not be sent back ({exc})")))
    send.close()


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
