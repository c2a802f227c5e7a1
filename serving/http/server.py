"""The OpenAI-compatible HTTP server: the engine loop (`serving.http.engine_loop`) behind the routes
(`serving.http.routes`), with OpenAI-shaped errors and a drain on SIGTERM.

A client that goes away aborts its requests, and the engine frees their KV blocks on its next step.
"""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI

from serving.core.engine import LLMEngine
from serving.http.context import ServingContext
from serving.http.engine_loop import DRAIN_TIMEOUT_S, EngineLoop, drain_on_signals
from serving.http.http_errors import install_error_handlers
from serving.http.metrics import ServerMetrics
from serving.http.routes import router
from serving.http.server_thread import ServerThread
from serving.http.tenants import DEFAULT_TENANT, TenantTable

__all__ = ["ServerThread", "build_app"]  # ServerThread: its old home, for callers that import it from here

log = logging.getLogger("quantgate.server")


def build_app(
    engine: LLMEngine,
    *,
    served_model_name: str | None = None,
    version: str | None = None,
    tenants: TenantTable | None = None,
    max_waiting: int = 256,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
    metrics_key: str | None = None,
    engine_thread: bool = True,
) -> FastAPI:
    """The ASGI app over `engine`. With `tenants`, every request needs an API key of a tenant, and
    /metrics the metrics key (`metrics_key`, else the keys file's); without tenants /metrics is open
    unless a `metrics_key` is given. The tenants' KV quotas and fairness are the engine's
    (`LLMEngine(tenant_fairness=...)`). With `engine_thread=False` the caller steps the engine itself
    (`app.state.engine_loop.run_here`, as `quantgate serve` does on its main thread)."""
    if tenants is not None:
        tenants = tenants.with_metrics_key(metrics_key)
        metrics_key = tenants.metrics_key
        if metrics_key is None:
            log.warning("tenants are configured but no metrics key: /metrics will answer 401 to everyone")
    model_name = served_model_name or engine.model_name.rstrip("/").rsplit("/", 1)[-1]
    version = version or model_name
    metrics = ServerMetrics(version, sorted(tenants.tenants) if tenants else [DEFAULT_TENANT])
    waiting_limits = {n: t.max_waiting for n, t in (tenants.tenants if tenants else {}).items()
                      if t.max_waiting is not None}
    if tenants and tenants.quotas(engine.config.num_kv_blocks) != engine.tenant_kv_quotas:
        raise ValueError("the tenants' KV quotas are the scheduler's: build the engine with "
                         "tenant_fairness=TenantFairness.for_tenants(tenants)")
    loop = EngineLoop(engine, metrics, max_waiting, waiting_limits)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_thread:
            loop.start()
        restore = drain_on_signals(loop, drain_timeout_s)
        try:
            yield
        finally:
            restore()
            loop.stop()

    app = FastAPI(title="quantgate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine_loop = loop
    app.state.serving = ServingContext(engine, loop, metrics, model_name, version, tenants, metrics_key)
    install_error_handlers(app, log)
    app.include_router(router)
    return app
