"""The canary router's state: versions' weights (promote, rollback, recorded), backends' health and load,
and the router's own Prometheus metrics."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from serving.metrics import LATENCY_BUCKETS
from serving.protocol import APIError
from serving.router_config import RouterConfig

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
