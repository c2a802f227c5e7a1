"""The process that runs a release, as recorded in its MLflow run's tags (see gates/records/orphans.py)."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

TAG_HOST = "quantgate.host"
TAG_PID = "quantgate.pid"
TAG_PID_STARTED = "quantgate.pid_started"  # the process's start time, epoch seconds
TAG_MACHINE = "quantgate.pid_namespace"  # kernel boot id + pid namespace: where the pid means something
_START_TOLERANCE_S = 1.0


def _machine() -> str:
    """This kernel boot and pid namespace ("" where Linux's /proc does not tell)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{namespace}"


@dataclass(frozen=True)
class ReleaseProcess:
    host: str
    pid: int
    started: float
    machine: str

    @classmethod
    def current(cls) -> ReleaseProcess:
        import psutil

        return cls(socket.gethostname(), os.getpid(), psutil.Process().create_time(), _machine())

    @classmethod
    def from_tags(cls, tags: dict[str, str]) -> ReleaseProcess | None:
        try:
            return cls(tags[TAG_HOST], int(tags[TAG_PID]), float(tags[TAG_PID_STARTED]), tags[TAG_MACHINE])
        except (KeyError, ValueError):
            return None

    def tags(self) -> dict[str, str]:
        return {TAG_HOST: self.host, TAG_PID: str(self.pid), TAG_PID_STARTED: f"{self.started:.3f}",
                TAG_MACHINE: self.machine}

    def judged_here(self) -> bool:
        """Whether this machine can tell if the process is alive."""
        here = ReleaseProcess.current()
        return bool(self.machine) and (self.host, self.machine) == (here.host, here.machine)

    def is_alive(self) -> bool:
        import psutil

        try:
            process = psutil.Process(self.pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                return False
            return abs(process.create_time() - self.started) < _START_TOLERANCE_S
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:
            return True

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"pid {self.pid} on {self.host}, started {started}"
