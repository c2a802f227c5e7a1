"""The canary router: one OpenAI-compatible front over several `quantgate serve` backends.

Each request goes to a *version* (weighted, sticky per `user` or request-id hash), then to the
least-loaded healthy *replica* of that version, judged by the KV-cache usage and waiting queue the
router reads from every backend's /metrics. Promote (the canary takes 100 %) and rollback (it takes
0 %, the other versions keep their weights, or get their configured ones back after a promote) swap
the weights atomically and are recorded with time and reason. A backend that stops
answering is taken out; requests that were on it fail with 502, new ones with 503 if no replica is left.

The config file is described in serving/routing/router_config.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
from typing import Annotated

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from serving.http.http_body import parse_json_object, read_body
from serving.http.http_errors import install_error_handlers
from serving.http.metric_buckets import CONTENT_TYPE
from serving.http.protocol import APIError, error_body
from serving.routing.router_config import RouterConfig, load_router_config, parse_router_config
from serving.routing.router_state import Backend, RouterMetrics, RouterState, backend_load

__all__ = ["build_router_app", "load_router_config", "parse_router_config"]

log = logging.getLogger("quantgate.router")

FORWARD_HEADERS = ("authorization", "content-type", "x-request-id", "accept")


class Proxy:
    """Forwards requests to the backends `state` picks, and polls their load."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.state = RouterState(config)
        self.metrics = RouterMetrics(self.state)
        self.clients: dict[str, httpx.AsyncClient] = {}

    # ---- polling -------------------------------------------------------------------------------
    async def poll_once(self) -> None:
        async def one(b: Backend) -> None:
            try:
                r = await self.clients["poll"].get(f"{b.url}/metrics")
                r.raise_for_status()
                b.kv_usage, b.waiting, b.running = backend_load(r.text)
                b.healthy, b.last_error = True, None
            except (httpx.HTTPError, ValueError) as exc:
                if b.healthy:
                    log.warning("backend %s is down: %s", b.url, exc)
                b.healthy, b.last_error = False, f"{type(exc).__name__}: {exc}"
            b.last_poll = time.monotonic()

        await asyncio.gather(*(one(b) for b in self.state.backends))

    async def poll_forever(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.config.poll_interval_s)

    @contextlib.asynccontextmanager
    async def running(self):
        """The HTTP clients open and the poller running, for the app's lifespan."""
        timeout = httpx.Timeout(connect=2.0, read=self.config.timeout_s, write=10.0, pool=5.0)
        self.clients["proxy"] = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1000))
        self.clients["poll"] = httpx.AsyncClient(timeout=httpx.Timeout(2.0))
        await self.poll_once()
        task = asyncio.create_task(self.poll_forever())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            for c in self.clients.values():
                await c.aclose()

    # ---- forwarding ----------------------------------------------------------------------------
    def _version_for(self, request: Request, body: dict) -> str:
        model = self.config.model
        if model is not None and body.get("model") not in (None, model):
            raise APIError(404, f"the model `{body.get('model')}` does not exist; this router serves `{model}`",
                           "model_not_found")
        body.pop("model", None)  # each backend serves exactly one model, under its own name
        user = body.get("user")
        return self.state.pick_version(user if isinstance(user, str) and user else request.headers.get("x-request-id"))

    async def _open(self, request: Request, path: str, version: str, content: bytes) -> tuple[Backend, httpx.Response]:
        """A streaming response from a replica of `version`; one that refuses the connection is skipped."""
        tried: set[str] = set()
        while True:
            backend = self.state.pick_backend(version, tried)
            tried.add(backend.url)
            req = self.clients["proxy"].build_request("POST", f"{backend.url}{path}", content=content,
                                                      headers={**headers_of(request), "content-type": "application/json"})
            backend.inflight += 1
            try:
                return backend, await self.clients["proxy"].send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached it: try another replica
                backend.inflight -= 1
                backend.healthy, backend.last_error = False, f"{type(exc).__name__}: {exc}"
                log.warning("backend %s refused a connection: %s", backend.url, exc)
            except httpx.HTTPError as exc:
                backend.inflight -= 1
                self.metrics.requests.labels(version, "502").inc()
                raise APIError(502, f"backend {backend.url} ({version}) failed: {type(exc).__name__}",
                               "backend_failed") from exc

    async def forward(self, request: Request, path: str) -> Response:
        body = await json_body(request)
        version = self._version_for(request, body)
        start = time.perf_counter()
        backend, resp = await self._open(request, path, version, json.dumps(body).encode())
        route = {"X-Quantgate-Version": version, "X-Quantgate-Backend": backend.url}
        if body.get("stream") and resp.status_code == 200:
            return StreamingResponse(self._relay(resp, backend, version, start), status_code=200,
                                     media_type=resp.headers.get("content-type"), headers=route)
        try:
            data = await resp.aread()
        except httpx.HTTPError as exc:
            self.metrics.requests.labels(version, "502").inc()
            raise APIError(502, f"backend {backend.url} ({version}) failed mid-request: {type(exc).__name__}",
                           "backend_failed") from exc
        finally:
            backend.inflight -= 1
            await resp.aclose()
        self.metrics.requests.labels(version, str(resp.status_code)).inc()
        if resp.status_code == 200:
            self.metrics.e2e.labels(version).observe(time.perf_counter() - start)
        extra = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
        return Response(data, resp.status_code, media_type=resp.headers.get("content-type"),
                        headers={**route, **extra})

    async def _relay(self, resp: httpx.Response, backend: Backend, version: str, start: float):
        first, code = True, "200"
        try:
            async for chunk in resp.aiter_raw():
                if first:
                    self.metrics.ttft.labels(version).observe(time.perf_counter() - start)
                    first = False
                yield chunk
            self.metrics.e2e.labels(version).observe(time.perf_counter() - start)
        except httpx.HTTPError as exc:  # headers are out: say so in the stream, then end it
            code = "502"
            err = error_body(502, f"backend {backend.url} ({version}) failed mid-stream: {type(exc).__name__}",
                             "backend_failed")
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            backend.inflight -= 1
            self.metrics.requests.labels(version, code).inc()
            await resp.aclose()

    async def to_any(self, request: Request, method: str, path: str) -> Response:
        """Tokenizer endpoints: any healthy backend of the heaviest version answers."""
        weights = self.state.weights
        version = max(weights, key=lambda v: weights[v])
        healthy = [b for b in self.state.backends if b.healthy]
        if not healthy:
            raise APIError(503, "no healthy backend", "backend_unavailable", {"Retry-After": "1"})
        backend = next((b for b in healthy if b.version == version), healthy[0])
        try:
            resp = await self.clients["proxy"].request(method, f"{backend.url}{path}", content=await request.body(),
                                                       headers=headers_of(request))
        except httpx.HTTPError as exc:
            raise APIError(502, f"backend {backend.url} failed: {type(exc).__name__}", "backend_failed") from exc
        return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))


async def json_body(request: Request) -> dict:
    return parse_json_object(await read_body(request), empty_ok=True)


def headers_of(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}


def reason_of(body: dict) -> str:
    reason = body.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise APIError(400, "say why: a non-empty `reason` is required and recorded")
    return reason.strip()


async def proxy_of(request: Request) -> Proxy:
    return request.app.state.proxy


async def admin(request: Request) -> Proxy:
    """The proxy, for a request bearing the admin key (401 otherwise)."""
    proxy = request.app.state.proxy
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), proxy.config.admin_key.encode()):
        raise APIError(401, "admin endpoints need `Authorization: Bearer <admin key>`", "invalid_admin_key")
    return proxy


ProxyDep = Annotated[Proxy, Depends(proxy_of)]
Admin = Annotated[Proxy, Depends(admin)]
routes = APIRouter()


@routes.post("/v1/completions")
async def completions(request: Request, proxy: ProxyDep):
    return await proxy.forward(request, "/v1/completions")


@routes.post("/v1/chat/completions")
async def chat_completions(request: Request, proxy: ProxyDep):
    return await proxy.forward(request, "/v1/chat/completions")


@routes.post("/tokenize")
async def tokenize(request: Request, proxy: ProxyDep):
    return await proxy.to_any(request, "POST", "/tokenize")


@routes.post("/detokenize")
async def detokenize(request: Request, proxy: ProxyDep):
    return await proxy.to_any(request, "POST", "/detokenize")


@routes.get("/tokenizer_info")
async def tokenizer_info(request: Request, proxy: ProxyDep):
    return await proxy.to_any(request, "GET", "/tokenizer_info")


@routes.get("/v1/models")
async def models(proxy: ProxyDep):
    return {"object": "list", "data": [{"id": proxy.config.model or "quantgate", "object": "model",
                                        "owned_by": "quantgate", "versions": dict(proxy.state.weights)}]}


@routes.get("/health")
async def health(proxy: ProxyDep):
    healthy = sum(b.healthy for b in proxy.state.backends)
    if not healthy:
        raise APIError(503, "no backend is healthy", "backend_unavailable")
    return {"status": "ok", "healthy_backends": healthy, "backends": len(proxy.state.backends)}


@routes.get("/metrics")
async def prometheus_metrics(proxy: ProxyDep):
    return Response(proxy.metrics.render(), media_type=CONTENT_TYPE)


# ---- admin -------------------------------------------------------------------------------------
@routes.get("/admin/state")
async def admin_state(proxy: Admin):
    state = proxy.state
    return {"canary": proxy.config.canary, "weights": state.weights, "history": state.history,
            "backends": [b.state() for b in state.backends]}


@routes.post("/admin/promote")
async def promote(request: Request, proxy: Admin):
    return proxy.state.promote(reason_of(await json_body(request)))


@routes.post("/admin/rollback")
async def rollback(request: Request, proxy: Admin):
    return proxy.state.rollback(reason_of(await json_body(request)))


@routes.post("/admin/weights")
async def set_weights(request: Request, proxy: Admin):
    body = await json_body(request)
    weights = body.get("weights")
    names = {v.name for v in proxy.config.versions}
    if not isinstance(weights, dict) or set(weights) != names or any(
            isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w < math.inf
            for w in weights.values()):
        raise APIError(400, f"`weights` must give a finite number >= 0 for each of {sorted(names)}")
    if not 0 < sum(weights.values()) < math.inf:
        raise APIError(400, "`weights` must not all be 0, and their sum must be finite")
    return proxy.state.set_weights({k: float(v) for k, v in weights.items()}, "weights", reason_of(body))


def build_router_app(config: RouterConfig) -> FastAPI:
    proxy = Proxy(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with proxy.running():
            yield

    app = FastAPI(title="quantgate router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router, app.state.proxy = proxy.state, proxy
    install_error_handlers(app, log)
    app.include_router(routes)
    return app
