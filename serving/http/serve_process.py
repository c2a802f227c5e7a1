"""`quantgate serve` as a child process on a free loopback port: start it, wait for /health, stop it.

Shared by the soak benchmark and the tests that need a real server process (signals, overload).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from quantgate.ports import free_port


def spawn_serve(model: str | Path, log: Path, *extra: str, env: dict[str, str] | None = None
                ) -> tuple[subprocess.Popen, str]:
    """Start `quantgate serve --model MODEL EXTRA...` (not waiting for it); returns (process, base URL).
    Its output goes to `log`; `env` is added to this process's environment."""
    port = free_port()
    cmd = [sys.executable, "-m", "quantgate.cli", "serve", "--model", str(model), "--port", str(port), *extra]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return proc, f"http://127.0.0.1:{port}"


def wait_serve_up(proc: subprocess.Popen, url: str, log: Path, timeout: float = 240.0) -> None:
    """Until /health answers 200; RuntimeError (with the log's end) if the process exits or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"`quantgate serve` exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"`quantgate serve` on {url} did not come up within {timeout} s; see {log}")
        time.sleep(0.05)


def stop_serve(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 20.0) -> float | None:
    """Send `sig`, kill if it has not exited within `timeout` s; seconds it took (None if it had exited)."""
    if proc.poll() is not None:
        return None
    start = time.monotonic()
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    return time.monotonic() - start
