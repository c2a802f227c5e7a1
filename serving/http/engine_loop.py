"""The engine loop: one LLMEngine stepping on a background thread, outputs handed to asyncio queues.

Requests from every connection join the engine's running batch as they arrive (admission: 429 when a
waiting queue is full, 503 while draining); the engine thread hands each request's outputs to that
request's asyncio queue. After SIGTERM the loop drains: nothing new is admitted and what is still in
flight after the drain timeout is aborted with a clear error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from serving.core.engine import LLMEngine, RequestOutput
from serving.core.sampling_params import SamplingParams
from serving.http.metrics import ServerMetrics
from serving.http.protocol import APIError

log = logging.getLogger("quantgate.server")

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.5
ENGINE_STOPPED = APIError(503, "the engine loop is not running; retry on another replica", "engine_stopped",
                          {"Retry-After": str(RETRY_AFTER_S)})
DRAIN_TIMEOUT_S = 3.0  # after SIGTERM, in-flight requests get this long; `quantgate serve` gives uvicorn 5 s


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int


class EngineLoop:
    """Steps the engine on a background thread and delivers outputs to asyncio queues."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_waiting: int,
                 tenant_limits: dict[str, int] | None = None):
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.tenant_limits = tenant_limits or {}  # tenant -> max waiting requests
        self._streams: dict[str, _Stream] = {}
        self._queued: dict[str, str] = {}  # request id -> tenant, until first scheduled
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.draining = False
        self._drain_deadline: float | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="quantgate-engine", daemon=True)
        self._thread.start()

    def run_here(self, keep_going: Callable[[], bool]) -> None:
        """Step the engine on the calling thread while `keep_going()` holds (`quantgate serve`: the main
        thread, with the HTTP server on another). torch's OpenMP ops run slower from a thread other than
        the one that started the process (libgomp's thread pool; docs/results/design-figures.md)."""
        self._stop.clear()
        self._thread = threading.current_thread()
        try:
            while keep_going() and not self._stop.is_set():
                self._tick_safely()
        finally:
            self._thread = None

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread() and self._thread.daemon:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def drain(self, timeout: float) -> None:
        """Admit nothing new (503); what is still in flight after `timeout` s is aborted with a clear error."""
        if not self.draining:
            self.draining = True
            self._drain_deadline = time.monotonic() + timeout
            log.warning("draining: no new requests; in-flight ones get %.1f s to finish", timeout)
        self._wake.set()

    def submit(self, prompts: list[list[int]], params: SamplingParams, tenant: str,
               queue: asyncio.Queue, cache_salt: str | None = None) -> list[str]:
        """Queue one engine request per prompt, all or none. 429 when a waiting queue is full."""
        loop = asyncio.get_running_loop()
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica", "server_shutting_down",
                           {"Retry-After": str(RETRY_AFTER_S)})
        if len(prompts) > self.max_waiting:  # it could never fit the queue: no retry would help
            raise APIError(400, f"{len(prompts)} prompts in one request; this server queues at most "
                           f"{self.max_waiting} prompts (its max_waiting)", "too_many_prompts")
        with self._lock:
            if len(self._queued) + len(prompts) > self.max_waiting:  # every prompt is a queued request
                self.metrics.reject(tenant, "server_queue_full")
                raise APIError(429, f"the server's waiting queue is full ({self.max_waiting} requests); retry later",
                               "queue_full", {"Retry-After": str(RETRY_AFTER_S)})
            limit = self.tenant_limits.get(tenant)
            if limit is not None and sum(1 for t in self._queued.values() if t == tenant) + len(prompts) > limit:
                self.metrics.reject(tenant, "tenant_queue_full")
                raise APIError(429, f"tenant {tenant!r} already has {limit} requests waiting (its max_waiting); "
                               "retry later", "tenant_queue_full", {"Retry-After": str(RETRY_AFTER_S)})
            rids: list[str] = []
            try:
                for index, ids in enumerate(prompts):
                    rid = f"cmpl-{uuid.uuid4().hex}"
                    self._streams[rid] = _Stream(loop, queue, index)
                    rids.append(rid)
                    self.engine.add_request(ids, params, request_id=rid, tenant=tenant, cache_salt=cache_salt,
                                            stream_text=True)
                    self._queued[rid] = tenant
            except ValueError as exc:
                for rid in rids:
                    self._streams.pop(rid, None)
                    self._queued.pop(rid, None)
                    self.engine.abort(rid)
                code = "context_length_exceeded" if "context length" in str(exc) else None
                raise APIError(400, str(exc), code) from exc
        self._wake.set()
        return rids

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort(rid)
        self._wake.set()

    # ---- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._tick_safely()

    def _tick_safely(self) -> None:
        try:
            self._tick()
        except Exception as exc:  # an engine bug must fail its requests, not stop the loop (they would hang)
            log.exception("engine step failed")
            self._fail_all(APIError(500, f"the engine failed: {exc}", "engine_error"))
            time.sleep(0.05)

    def _tick(self) -> None:
        if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline and self._streams:
            self._fail_all(APIError(503, "the server shut down before this request finished; it was aborted, "
                                    "retry on another replica", "server_shutting_down",
                                    {"Retry-After": str(RETRY_AFTER_S)}))
        if not self.engine.has_unfinished():
            self._snapshot()
            self._wake.wait(0.1)
            self._wake.clear()
            return
        outputs = self.engine.step()
        self.steps += 1
        for out in outputs:
            self.metrics.on_output(out)
            self._deliver(out)
        self._mark_scheduled()
        self._snapshot()

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self._queued.pop(out.request_id, None)
        if stream is None:
            return
        item: RequestOutput | APIError = out
        if out.finish_reason == "error":  # this request alone: the others of its step went on
            item = APIError(500, "the model produced non-finite logits (NaN/inf) for this request; the variant "
                            "may be broken", "engine_error")
        with contextlib.suppress(RuntimeError):  # the client's event loop is gone
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, (stream.index, item))

    def _mark_scheduled(self) -> None:
        with self._lock:
            for rid in list(self._queued):
                seq = self.engine.sequences.get(rid)
                if seq is not None and seq.metrics.first_scheduled_time is not None:
                    del self._queued[rid]

    def _snapshot(self) -> None:
        self.metrics.on_stats(self.engine.stats())

    def _fail_all(self, error: APIError) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            self._queued.clear()
        for rid, stream in streams.items():
            self.engine.abort(rid)
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, (stream.index, error))

    async def next_output(self, queue: asyncio.Queue) -> tuple[int, RequestOutput | APIError]:
        """The next (index, output) for a stream; an error instead of waiting forever on a dead loop."""
        while True:
            try:
                return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if not self.alive:
                    return 0, ENGINE_STOPPED


def drain_on_signals(loop: EngineLoop, timeout: float) -> Callable[[], None]:
    """Put a drain in front of the SIGTERM/SIGINT handlers the ASGI server installed (uvicorn's start its
    graceful shutdown: close the socket, wait for open responses). Only the main thread can handle signals;
    elsewhere (tests' ServerThread) nothing changes. Returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    installed: dict[int, tuple[Callable, Callable]] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)
        if not callable(previous):
            continue

        def handler(signum, frame, previous=previous):
            loop.drain(timeout)
            previous(signum, frame)

        signal.signal(sig, handler)
        installed[sig] = (handler, previous)

    def restore() -> None:
        for sig, (handler, previous) in installed.items():
            if signal.getsignal(sig) is handler:
                signal.signal(sig, previous)

    return restore
