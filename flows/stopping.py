"""What SIGINT and SIGTERM do to `quantgate deploy`: stop within seconds, every run in flight ended with
a clear state.

The flow-run processes get SIGTERM (the flow records its failure: Prefect Crashed, MLflow FAILED) and
`STOP_GRACE_S` to exit; what is left of their process trees is then killed (Prefect's runner reports
those runs Crashed), the release runs they left RUNNING are marked FAILED in MLflow (`gates.records.orphans`),
and the runner stops (deployment paused, as Prefect's `serve` does). Nothing outlives
`STOP_DEADLINE_S`; a second signal stops at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

STOP_GRACE_S = 2.0  # after a stop signal, how long a flow run in flight has to record its end
STOP_DEADLINE_S = 8.0  # after a stop signal, everything still running is killed and the process exits


@dataclass
class Stopper:
    api_server_pid: int | None = None  # ours: it must outlive the runs, so their states get recorded
    interruptible: bool = False  # a stop may interrupt what runs now (KeyboardInterrupt)
    signum: int | None = None
    runner: Any = None  # set once the runner serves
    in_flight: list = field(default_factory=list)  # psutil.Process: the flow-run processes and below
    _once: list = field(default_factory=lambda: [True])
    _swept: threading.Event = field(default_factory=threading.Event)
    _since: float = 0.0

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: self.request(signum))

    def request(self, signum: int) -> None:
        """The signal handler (main thread)."""
        if self.signum is not None:
            self._force(f"{signal.Signals(signum).name} again")
        self.signum, self._since = signum, time.monotonic()
        if self.runner is not None:
            self._begin()
            return
        _say(f"{signal.Signals(signum).name} received: stopping as soon as startup allows")
        if self.interruptible:
            raise KeyboardInterrupt

    def serving(self, runner: Any) -> None:
        """The runner runs: a stop asked for during startup happens now."""
        self.runner = runner
        if self.signum is not None:
            self._begin()

    def _begin(self) -> None:
        try:
            self._once.pop()  # atomic, even against the signal handler interrupting this thread
        except IndexError:
            return
        self.in_flight = _descendants(exclude=self.api_server_pid)
        _say(f"{signal.Signals(self.signum).name} received: stopping"
             + (", ending the flow runs in flight" if self.in_flight else ""))
        for process in self.in_flight:
            if _parent_pid(process) == os.getpid():
                _signal(process, signal.SIGTERM)
        threading.Thread(target=self._stop, name="quantgate-stop", daemon=True).start()

    def _stop(self) -> None:
        """Runs first (so that the runner finds nothing left to cancel), then the runner, then MLflow."""
        if self.in_flight:
            _wait_gone(self.in_flight, STOP_GRACE_S - (time.monotonic() - self._since))
            everything = _descendants(exclude=self.api_server_pid)  # a run started meanwhile too
            for process in everything:
                _signal(process, signal.SIGKILL)
            _wait_gone(everything, 1.0)
        self.runner.execute_in_background(self.runner.astop)
        if self.in_flight:
            _fail_orphaned_releases(self.signum)
        self._swept.set()
        time.sleep(max(0.0, STOP_DEADLINE_S - (time.monotonic() - self._since)))
        self._force(f"still running {STOP_DEADLINE_S:.0f} s after the signal")

    def _force(self, why: str) -> None:
        _say(f"{why}: killing the flow runs and exiting")
        for process in _descendants():
            _signal(process, signal.SIGKILL)
        os._exit(1)

    def finish(self) -> None:
        if self.signum is None:
            return
        if self.in_flight:
            self._swept.wait(timeout=STOP_DEADLINE_S)
        _say(f"stopped {time.monotonic() - self._since:.1f} s after {signal.Signals(self.signum).name}")


def _descendants(exclude: int | None = None) -> list:
    """Every process below this one (psutil.Process), but `exclude` and what runs below it."""
    import psutil

    everything = psutil.Process().children(recursive=True)
    if exclude is None:
        return everything
    try:
        spared = {exclude} | {p.pid for p in psutil.Process(exclude).children(recursive=True)}
    except psutil.NoSuchProcess:
        spared = {exclude}
    return [p for p in everything if p.pid not in spared]


def _parent_pid(process) -> int | None:
    """None once it has exited: a process listed a moment ago may be gone by now."""
    import psutil

    try:
        return process.ppid()
    except psutil.NoSuchProcess:
        return None


def _signal(process, sig: int) -> None:
    import psutil

    try:
        process.send_signal(sig)  # psutil checks it is still the same process (pid reuse)
    except psutil.NoSuchProcess:
        pass


def _wait_gone(processes: list, timeout_s: float) -> None:
    """Without reaping them: the runner waits on its own children and reads their exit codes."""
    import psutil

    def running(process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    while any(running(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)


def _fail_orphaned_releases(signum: int | None) -> None:
    from gates.records.orphans import fail_orphaned_releases

    name = signal.Signals(signum).name if signum is not None else "a signal"
    try:
        for run_id in fail_orphaned_releases(found_by=f"quantgate deploy (pid {os.getpid()}) stopping on {name}"):
            _say(f"MLflow release run {run_id}: FAILED (its flow run was stopped)")
    except Exception as exc:  # the store may be what failed; the runs stay for the next release to sweep
        _say(f"could not mark the stopped releases FAILED in MLflow: {exc}")


def _say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} quantgate deploy: {message}", file=sys.stderr, flush=True)
