"""The canary router: one OpenAI-compatible front over several `quantgate serve` backends.

Each request goes to a *version* (weighted, sticky per `user` or request-id hash), then to the
least-loaded healthy *replica* of that version, judged by the KV-cache usage and waiting queue the
router reads from every backend's /metrics. Promote (the canary takes 100 %) and rollback (it takes
0 %, the other versions keep their weights, or get their configured ones back after a promote) swap
the weights atomically and are recorded with time and reason. A backend that stops
answering is taken out; requests that were on it fail with 502, new ones with 503 if no replica is left.

The config file (YAML):

    model: smollm2-135m          # the name clients ask for (optional; any name if absent)
    admin_key: change-me-please  # or admin_key_env: NAME_OF_ENV_VAR
    canary: int8
    versions:                    # the canary is placed last, so users in it stay in it as it grows
      baseline: {weight: 95, backends: [http://127.0.0.1:8001, http://127.0.0.1:8002]}
      int8:     {weight: 5,  backends: [http://127.0.0.1:8003]}
    poll_interval_s: 0.5         # optional
    timeout_s: 300               # optional: the longest a backend may take to answer
    decisions_log: /path/decisions.jsonl   # optional: promote/rollback records, one JSON per line
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import random
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlparse

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BeforeValidator, Field, model_validator

from quantgate.config import StrictModel, validate_config
from quantgate.files import read_yaml
from serving.http_body import parse_json_object, read_body
from serving.http_errors import install_error_handlers
from serving.metrics import CONTENT_TYPE, LATENCY_BUCKETS
from serving.protocol import APIError, error_body

log = logging.getLogger("quantgate.router")

FORWARD_HEADERS = ("authorization", "content-type", "x-request-id", "accept")


# ---- config ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VersionConfig:
    name: str
    weight: float
    backends: tuple[str, ...]


@dataclass(frozen=True)
class RouterConfig:
    versions: tuple[VersionConfig, ...]
    admin_key: str
    canary: str
    model: str | None = None
    poll_interval_s: float = 0.5
    timeout_s: float = 300.0
    decisions_log: Path | None = None
    host: str = "127.0.0.1"
    port: int = 9000

    @property
    def weights(self) -> dict[str, float]:
        return {v.name: v.weight for v in self.versions}


def load_router_config(path: str | Path) -> RouterConfig:
    data = read_yaml(path, "router config")
    return parse_router_config(data, str(path))


def _positive(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"must be a positive number, got {value!r}")
    return value


def _weight(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"weight must be a number >= 0, got {value!r}")
    return float(value)


def _backends(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("`backends` must be a non-empty list of URLs")
    for url in value:
        parts = urlparse(str(url))
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(f"backend {url!r} is not a base URL like http://127.0.0.1:8001")
    return tuple(str(u).rstrip("/") for u in value)


Positive = Annotated[float, BeforeValidator(_positive)]


class _Version(StrictModel):
    weight: Annotated[float, BeforeValidator(_weight)] = Field(None, validate_default=True)
    backends: Annotated[tuple[str, ...], BeforeValidator(_backends)] = Field(None, validate_default=True)


class RouterFile(StrictModel):
    """The router config file's schema (see the module's docstring)."""

    versions: dict[str, _Version] = Field(min_length=1)
    canary: Any = None
    admin_key: Any = None
    admin_key_env: str | None = None
    model: Any = None
    poll_interval_s: Positive = 0.5
    timeout_s: Positive = 300.0
    decisions_log: Any = None
    host: Any = "127.0.0.1"
    port: Annotated[int, BeforeValidator(_positive)] = 9000

    @model_validator(mode="after")
    def _consistent(self) -> RouterFile:
        if self.canary not in self.versions:
            raise ValueError(f"`canary` must name one of the versions {sorted(self.versions)}, got {self.canary!r}")
        seen: set[str] = set()
        for v in self.versions.values():
            for url in v.backends:
                if url in seen:
                    raise ValueError(f"backend {url} is listed twice")
                seen.add(url)
        if sum(v.weight for v in self.versions.values()) <= 0:
            raise ValueError("at least one version needs a weight > 0")
        return self

    def key(self) -> str:
        key = self.admin_key
        if key is None and self.admin_key_env:
            key = os.environ.get(self.admin_key_env)
            if not key:
                raise ValueError(f"admin_key_env {self.admin_key_env!r} is not set in the environment")
        if not isinstance(key, str) or len(key) < 8:
            raise ValueError("`admin_key` (or `admin_key_env`) must give a key of at least 8 characters")
        return key


def parse_router_config(data: object, source: str = "router config") -> RouterConfig:
    f = validate_config(RouterFile, data, source)
    try:
        key = f.key()
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    versions = sorted((VersionConfig(str(n), v.weight, v.backends) for n, v in f.versions.items()),
                      key=lambda v: v.name == f.canary)  # the canary last (stable otherwise)
    log_path = Path(str(f.decisions_log)).expanduser() if f.decisions_log else None
    return RouterConfig(tuple(versions), key, str(f.canary), str(f.model) if f.model else None,
                        float(f.poll_interval_s), float(f.timeout_s), log_path, str(f.host), int(f.port))


# ---- state -------------------------------------------------------------------------------------
@dataclass
class Backend:
    url: str
    version: str
    healthy: bool = True  # until a poll or a request says otherwise
    kv_usage: float = 0.0
    waiting: float = 0.0
    running: float = 0.0
    inflight: int = 0  # requests this router has open on it
    last_error: str | None = None
    last_poll: float | None = None

    @property
    def load(self) -> float:
        """What replica choice minimises: KV-cache usage first, then queued and in-flight requests."""
        return self.kv_usage + 0.02 * self.waiting + 0.01 * self.inflight

    def state(self) -> dict:
        return {"url": self.url, "version": self.version, "healthy": self.healthy, "kv_usage": self.kv_usage,
                "waiting": self.waiting, "running": self.running, "inflight": self.inflight,
                "last_error": self.last_error}


@dataclass
class RouterState:
    config: RouterConfig
    weights: dict[str, float] = field(default_factory=dict)
    backends: list[Backend] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.weights = dict(self.config.weights)
        self.backends = [Backend(url, v.name) for v in self.config.versions for url in v.backends]

    def pick_version(self, key: str | None) -> str:
        weights = self.weights  # one atomic read: a promote between requests takes effect on the next one
        total = sum(weights.values())
        if total <= 0:
            raise APIError(503, "every version has weight 0", "no_version")
        u = _unit_hash(key) if key else random.random()
        acc = 0.0
        for version in self.config.versions:  # canary last
            acc += weights.get(version.name, 0.0) / total
            if u < acc and weights.get(version.name, 0.0) > 0:
                return version.name
        return next(v.name for v in reversed(self.config.versions) if weights.get(v.name, 0.0) > 0)

    def pick_backend(self, version: str, exclude: set[str] = frozenset()) -> Backend:
        candidates = [b for b in self.backends if b.version == version and b.healthy and b.url not in exclude]
        if not candidates:
            raise APIError(503, f"no healthy backend for version {version!r}; retry later", "backend_unavailable",
                           {"Retry-After": "1"})
        return min(candidates, key=lambda b: (b.load, b.inflight))

    def set_weights(self, weights: dict[str, float], action: str, reason: str) -> dict:
        with self.lock:
            before = dict(self.weights)
            self.weights = dict(weights)  # replaced, never mutated: readers see old or new, never half
            record = {"time": datetime.now(UTC).isoformat(timespec="milliseconds"), "action": action,
                      "reason": reason, "canary": self.config.canary, "weights_before": before,
                      "weights_after": dict(weights)}
            self.history.append(record)
        if self.config.decisions_log is not None:
            self.config.decisions_log.parent.mkdir(parents=True, exist_ok=True)
            with self.config.decisions_log.open("a") as f:
                f.write(json.dumps(record) + "\n")
        log.warning("router %s: %s (weights %s -> %s)", action, reason, before, weights)
        return record

    def promote(self, reason: str) -> dict:
        canary = self.config.canary
        return self.set_weights({v.name: 100.0 if v.name == canary else 0.0 for v in self.config.versions},
                                "promote", reason)

    def rollback(self, reason: str) -> dict:
        canary = self.config.canary
        others = {v.name: self.weights.get(v.name, 0.0) for v in self.config.versions if v.name != canary}
        if not others:
            raise APIError(400, "rollback needs a version other than the canary")
        if sum(others.values()) <= 0:  # after a promote: back to the configured weights
            others = {v.name: v.weight for v in self.config.versions if v.name != canary}
        if sum(others.values()) <= 0:
            others = dict.fromkeys(others, 1.0)
        return self.set_weights({**others, canary: 0.0}, "rollback", reason)


def _unit_hash(key: str) -> float:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def _backend_load(text: str) -> tuple[float, float, float]:
    kv = waiting = running = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "quantgate:kv_cache_usage_perc":
                kv = max(kv, s.value)
            elif s.name == "quantgate:num_requests_waiting":
                waiting += s.value
            elif s.name == "quantgate:num_requests_running":
                running += s.value
    return kv, waiting, running


# ---- metrics -----------------------------------------------------------------------------------
class RouterMetrics:
    def __init__(self, state: RouterState):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("quantgate:router_requests", "Requests routed, by version and HTTP status.",
                                ["version", "code"], registry=r)
        self.ttft = Histogram("quantgate:time_to_first_token_seconds", "Router-side time to the first streamed "
                              "chunk.", ["version"], registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("quantgate:e2e_request_latency_seconds", "Router-side time to the whole answer.",
                             ["version"], registry=r, buckets=LATENCY_BUCKETS)
        self.weight = Gauge("quantgate:router_version_weight", "Current routing weight of each version.",
                            ["version"], registry=r)
        self.up = Gauge("quantgate:backend_up", "1 while a backend answers its /metrics.", ["version", "backend"],
                        registry=r)
        self.kv = Gauge("quantgate:kv_cache_usage_perc", "KV-cache usage of each backend, as last polled.",
                        ["version", "backend"], registry=r)
        self.running = Gauge("quantgate:num_requests_running", "Running requests of each backend.",
                             ["version", "backend"], registry=r)
        self.waiting = Gauge("quantgate:num_requests_waiting", "Waiting requests of each backend.",
                             ["version", "backend"], registry=r)
        self.state = state

    def render(self) -> bytes:
        for version, weight in self.state.weights.items():
            self.weight.labels(version).set(weight)
        for b in self.state.backends:
            self.up.labels(b.version, b.url).set(1 if b.healthy else 0)
            self.kv.labels(b.version, b.url).set(b.kv_usage)
            self.running.labels(b.version, b.url).set(b.running)
            self.waiting.labels(b.version, b.url).set(b.waiting)
        return generate_latest(self.registry)


# ---- the app -----------------------------------------------------------------------------------
def build_router_app(config: RouterConfig) -> FastAPI:
    state = RouterState(config)
    metrics = RouterMetrics(state)
    clients: dict[str, httpx.AsyncClient] = {}

    async def poll_once() -> None:
        async def one(b: Backend) -> None:
            try:
                r = await clients["poll"].get(f"{b.url}/metrics")
                r.raise_for_status()
                b.kv_usage, b.waiting, b.running = _backend_load(r.text)
                b.healthy, b.last_error = True, None
            except (httpx.HTTPError, ValueError) as exc:
                if b.healthy:
                    log.warning("backend %s is down: %s", b.url, exc)
                b.healthy, b.last_error = False, f"{type(exc).__name__}: {exc}"
            b.last_poll = time.monotonic()

        await asyncio.gather(*(one(b) for b in state.backends))

    async def poll_forever() -> None:
        while True:
            await poll_once()
            await asyncio.sleep(config.poll_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = httpx.Timeout(connect=2.0, read=config.timeout_s, write=10.0, pool=5.0)
        clients["proxy"] = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1000))
        clients["poll"] = httpx.AsyncClient(timeout=httpx.Timeout(2.0))
        await poll_once()
        task = asyncio.create_task(poll_forever())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            for c in clients.values():
                await c.aclose()

    app = FastAPI(title="quantgate router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = state

    install_error_handlers(app, log)

    def check_admin(request: Request) -> None:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), config.admin_key.encode()):
            raise APIError(401, "admin endpoints need `Authorization: Bearer <admin key>`", "invalid_admin_key")

    async def json_body(request: Request) -> dict:
        return parse_json_object(await read_body(request), empty_ok=True)

    def headers_of(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}

    async def forward(request: Request, path: str):
        body = await json_body(request)
        if config.model is not None and body.get("model") not in (None, config.model):
            raise APIError(404, f"the model `{body.get('model')}` does not exist; this router serves "
                           f"`{config.model}`", "model_not_found")
        body.pop("model", None)  # each backend serves exactly one model, under its own name
        user = body.get("user")
        key = user if isinstance(user, str) and user else request.headers.get("x-request-id")
        version = state.pick_version(key)
        content = json.dumps(body).encode()
        tried: set[str] = set()
        start = time.perf_counter()
        while True:
            backend = state.pick_backend(version, tried)
            tried.add(backend.url)
            req = clients["proxy"].build_request("POST", f"{backend.url}{path}", content=content,
                                                 headers={**headers_of(request), "content-type": "application/json"})
            backend.inflight += 1
            try:
                resp = await clients["proxy"].send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached it: try another replica
                backend.inflight -= 1
                backend.healthy, backend.last_error = False, f"{type(exc).__name__}: {exc}"
                log.warning("backend %s refused a connection: %s", backend.url, exc)
                continue
            except httpx.HTTPError as exc:
                backend.inflight -= 1
                metrics.requests.labels(version, "502").inc()
                raise APIError(502, f"backend {backend.url} ({version}) failed: {type(exc).__name__}",
                               "backend_failed") from exc
            break
        route = {"X-Quantgate-Version": version, "X-Quantgate-Backend": backend.url}
        if body.get("stream") and resp.status_code == 200:
            return StreamingResponse(relay(resp, backend, version, start), status_code=200,
                                     media_type=resp.headers.get("content-type"), headers=route)
        try:
            data = await resp.aread()
        except httpx.HTTPError as exc:
            metrics.requests.labels(version, "502").inc()
            raise APIError(502, f"backend {backend.url} ({version}) failed mid-request: {type(exc).__name__}",
                           "backend_failed") from exc
        finally:
            backend.inflight -= 1
            await resp.aclose()
        metrics.requests.labels(version, str(resp.status_code)).inc()
        if resp.status_code == 200:
            metrics.e2e.labels(version).observe(time.perf_counter() - start)
        extra = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
        return Response(data, resp.status_code, media_type=resp.headers.get("content-type"),
                        headers={**route, **extra})

    async def relay(resp: httpx.Response, backend: Backend, version: str, start: float):
        first, code = True, "200"
        try:
            async for chunk in resp.aiter_raw():
                if first:
                    metrics.ttft.labels(version).observe(time.perf_counter() - start)
                    first = False
                yield chunk
            metrics.e2e.labels(version).observe(time.perf_counter() - start)
        except httpx.HTTPError as exc:  # headers are out: say so in the stream, then end it
            code = "502"
            err = error_body(502, f"backend {backend.url} ({version}) failed mid-stream: {type(exc).__name__}",
                             "backend_failed")
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            backend.inflight -= 1
            metrics.requests.labels(version, code).inc()
            await resp.aclose()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await forward(request, "/v1/chat/completions")

    async def to_any(request: Request, method: str, path: str):
        """Tokenizer endpoints: any healthy backend of the heaviest version answers."""
        version = max(state.weights, key=lambda v: state.weights[v])
        healthy = [b for b in state.backends if b.healthy]
        if not healthy:
            raise APIError(503, "no healthy backend", "backend_unavailable", {"Retry-After": "1"})
        backend = next((b for b in healthy if b.version == version), healthy[0])
        try:
            resp = await clients["proxy"].request(method, f"{backend.url}{path}", content=await request.body(),
                                                  headers=headers_of(request))
        except httpx.HTTPError as exc:
            raise APIError(502, f"backend {backend.url} failed: {type(exc).__name__}", "backend_failed") from exc
        return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await to_any(request, "POST", "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await to_any(request, "POST", "/detokenize")

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        return await to_any(request, "GET", "/tokenizer_info")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model or "quantgate", "object": "model",
                                            "owned_by": "quantgate", "versions": dict(state.weights)}]}

    @app.get("/health")
    async def health():
        healthy = sum(b.healthy for b in state.backends)
        if not healthy:
            raise APIError(503, "no backend is healthy", "backend_unavailable")
        return {"status": "ok", "healthy_backends": healthy, "backends": len(state.backends)}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    # ---- admin ---------------------------------------------------------------------------------
    def reason_of(body: dict) -> str:
        reason = body.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise APIError(400, "say why: a non-empty `reason` is required and recorded")
        return reason.strip()

    @app.get("/admin/state")
    async def admin_state(request: Request):
        check_admin(request)
        return {"canary": config.canary, "weights": state.weights, "history": state.history,
                "backends": [b.state() for b in state.backends]}

    @app.post("/admin/promote")
    async def promote(request: Request):
        check_admin(request)
        return state.promote(reason_of(await json_body(request)))

    @app.post("/admin/rollback")
    async def rollback(request: Request):
        check_admin(request)
        return state.rollback(reason_of(await json_body(request)))

    @app.post("/admin/weights")
    async def set_weights(request: Request):
        check_admin(request)
        body = await json_body(request)
        weights = body.get("weights")
        names = {v.name for v in config.versions}
        if not isinstance(weights, dict) or set(weights) != names or any(
                isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w < math.inf
                for w in weights.values()):
            raise APIError(400, f"`weights` must give a finite number >= 0 for each of {sorted(names)}")
        if not 0 < sum(weights.values()) < math.inf:
            raise APIError(400, "`weights` must not all be 0, and their sum must be finite")
        return state.set_weights({k: float(v) for k, v in weights.items()}, "weights", reason_of(body))

    return app
