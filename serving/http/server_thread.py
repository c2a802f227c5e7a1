"""Run an ASGI app with uvicorn on a free loopback port in a background thread (tests, benchmarks, the
release flow's serving harness and canary); `run_beside_engine` steps an app's engine on the calling
thread while a client runs on another."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class ServerThread:
    """Run an ASGI app with uvicorn on a free loopback port in a background thread (tests, benchmarks)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        # log_config=None: uvicorn's own dictConfig would shut down the host process's handlers (the release
        # flow's Prefect API log handler, whose flush then waited ~4 s on the logging lock at each first server)
        config = uvicorn.Config(app, log_level=log_level, log_config=None, timeout_graceful_shutdown=2, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start within {timeout} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_beside_engine(engine_loop, client: Callable[[], T], timeout: float = 30.0) -> T:
    """`client()` on a thread while this thread steps the engine (an app built with `engine_thread=False`)
    until the client returns; its result, or its exception. torch's OpenMP ops run slower from a thread
    other than the process's first one (libgomp's thread pool; docs/results/design-figures.md), so a
    measurement taken on the main thread this way sees the engine's own speed."""
    outcome: dict[str, object] = {}

    def run_client() -> None:
        deadline = time.monotonic() + timeout
        while not engine_loop.alive:  # requests before the loop runs would be refused (503)
            if time.monotonic() > deadline:
                outcome["error"] = RuntimeError(f"the engine loop did not start within {timeout} s")
                return
            time.sleep(0.005)
        try:
            outcome["value"] = client()
        except BaseException as err:  # handed to the caller's thread
            outcome["error"] = err

    thread = threading.Thread(target=run_client, name="quantgate-client", daemon=True)
    thread.start()
    engine_loop.run_here(thread.is_alive)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
