"""The canary router's state: versions' weights (promote, rollback, recorded), backends' health and load,
and the router's own Prometheus metrics."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from serving.http.metric_buckets import LATENCY_BUCKETS
from serving.http.protocol import APIError
from serving.routing.router_config import RouterConfig
from serving.routing.traffic_split import Change, NoVersion, TrafficError, TrafficSplit

log = logging.getLogger("quantgate.router")


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


class RouterState:
    """The router's versions and backends. Its traffic split (serving/routing/traffic_split.py) lays versions out in
    the config's order, canary last; its one canary is the version a rollback takes out."""

    def __init__(self, config: RouterConfig):
        self.config = config
        names = [v.name for v in config.versions]
        champion = next((n for n in names if n != config.canary), config.canary)
        self.split = TrafficSplit(config.weights, champion=champion, canaries=[config.canary], order=names)
        self.backends = [Backend(url, v.name) for v in config.versions for url in v.backends]

    @property
    def weights(self) -> dict[str, float]:
        return self.split.weights

    @property
    def history(self) -> list[dict]:
        return [self._record(c) for c in self.split.history]

    def pick_version(self, key: str | None) -> str:
        try:
            return self.split.pick(key)
        except NoVersion as exc:
            raise APIError(503, str(exc), "no_version") from None

    def pick_backend(self, version: str, exclude: set[str] = frozenset()) -> Backend:
        candidates = [b for b in self.backends if b.version == version and b.healthy and b.url not in exclude]
        if not candidates:
            raise APIError(503, f"no healthy backend for version {version!r}; retry later", "backend_unavailable",
                           {"Retry-After": "1"})
        return min(candidates, key=lambda b: (b.load, b.inflight))

    def set_weights(self, weights: dict[str, float], action: str, reason: str) -> dict:
        return self._logged(lambda: self.split.set_weights(weights, reason, action))

    def promote(self, reason: str) -> dict:
        return self._logged(lambda: self.split.promote(self.config.canary, reason, weight=100.0))

    def rollback(self, reason: str) -> dict:
        return self._logged(lambda: self.split.rollback(reason))

    def _logged(self, change: Callable[[], Change]) -> dict:
        try:
            record = self._record(change())
        except TrafficError as exc:
            raise APIError(400, str(exc)) from None
        if self.config.decisions_log is not None:
            self.config.decisions_log.parent.mkdir(parents=True, exist_ok=True)
            with self.config.decisions_log.open("a") as f:
                f.write(json.dumps(record) + "\n")
        log.warning("router %s: %s (weights %s -> %s)", record["action"], record["reason"],
                    record["weights_before"], record["weights_after"])
        return record

    def _record(self, change: Change) -> dict:
        return {"time": datetime.fromtimestamp(change.time, UTC).isoformat(timespec="milliseconds"),
                "action": change.action, "reason": change.reason, "canary": self.config.canary,
                "weights_before": change.weights_before, "weights_after": change.weights}


def backend_load(text: str) -> tuple[float, float, float]:
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
