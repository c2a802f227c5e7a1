"""Prometheus metrics of one server, in a registry of its own (two apps in one process don't collide).

Every series carries the model `version`; request-level series also carry the `tenant`. TTFT,
inter-token latency and time per output token are separate histograms: there is no single "latency".
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from serving.core.engine_interface import EngineStats, RequestOutput
from serving.http.metric_buckets import LATENCY_BUCKETS, TOKEN_BUCKETS


class ServerMetrics:
    def __init__(self, version: str, tenants: list[str]):
        disable_created_metrics()  # the `_created` twin of every series is noise for our dashboards
        self.version = version
        self.registry = CollectorRegistry(auto_describe=True)
        r, req, eng = self.registry, ["version", "tenant"], ["version"]
        self.ttft = Histogram("quantgate:time_to_first_token_seconds", "Time from arrival to the first output token.",
                              req, registry=r, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("quantgate:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             req, registry=r, buckets=TOKEN_BUCKETS)
        self.tpot = Histogram("quantgate:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              req, registry=r, buckets=TOKEN_BUCKETS)
        self.e2e = Histogram("quantgate:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             req, registry=r, buckets=LATENCY_BUCKETS)
        self.queue = Histogram("quantgate:request_queue_time_seconds", "Time from arrival to first scheduled.",
                               req, registry=r, buckets=LATENCY_BUCKETS)
        self.kv_usage = Gauge("quantgate:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                              eng, registry=r)
        self.tenant_blocks = Gauge("quantgate:tenant_kv_blocks", "KV blocks held by a tenant's running requests.",
                                   req, registry=r)
        self.running = Gauge("quantgate:num_requests_running", "Requests in the running batch.", req, registry=r)
        self.waiting = Gauge("quantgate:num_requests_waiting", "Requests waiting for admission.", req, registry=r)
        self.preemptions = Counter("quantgate:num_preemptions", "Sequences preempted (recomputed later).",
                                   eng, registry=r)
        self.prefix_hits = Counter("quantgate:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                                   eng, registry=r)
        self.prompt_tokens = Counter("quantgate:prompt_tokens", "Prompt tokens of finished requests.", req,
                                     registry=r)
        self.generation_tokens = Counter("quantgate:generation_tokens", "Generated tokens.", req, registry=r)
        self.requests = Counter("quantgate:request_success", "Finished requests by finish reason.",
                                [*req, "finish_reason"], registry=r)
        self.rejected = Counter("quantgate:request_rejected", "Requests refused before admission (429).",
                                [*req, "reason"], registry=r)
        self._tenants = set(tenants)
        self._last_preemptions = 0
        self._last_prefix_hits = 0
        for tenant in tenants:
            self._touch(tenant)
        self.kv_usage.labels(version).set(0)
        self.preemptions.labels(version)
        self.prefix_hits.labels(version)

    def _touch(self, tenant: str) -> None:
        """Create a tenant's series at zero so dashboards and scrapers see them before any traffic."""
        self._tenants.add(tenant)
        for gauge in (self.running, self.waiting, self.tenant_blocks):
            gauge.labels(self.version, tenant).set(0)
        for counter in (self.prompt_tokens, self.generation_tokens):
            counter.labels(self.version, tenant)

    def on_output(self, out: RequestOutput) -> None:
        """Called by the engine thread for every output; observes a request's timings when it ends."""
        v, t = self.version, out.tenant
        if out.new_token_ids:
            self.generation_tokens.labels(v, t).inc(len(out.new_token_ids))
        if not out.finished:
            return
        m = out.metrics
        self.prompt_tokens.labels(v, t).inc(len(out.prompt_token_ids))
        self.requests.labels(v, t, out.finish_reason or "unknown").inc()
        if m.queue_time is not None:
            self.queue.labels(v, t).observe(m.queue_time)
        if m.ttft is not None:
            self.ttft.labels(v, t).observe(m.ttft)
        for gap in m.itls:
            self.itl.labels(v, t).observe(gap)
        if m.tpot is not None:
            self.tpot.labels(v, t).observe(m.tpot)
        if m.e2e is not None:
            self.e2e.labels(v, t).observe(m.e2e)

    def on_stats(self, stats: EngineStats) -> None:
        """Engine-wide gauges and counters, from a snapshot taken on the engine thread."""
        v, waiting, blocks = self.version, stats.waiting_by_tenant, stats.kv_blocks_by_tenant
        self.kv_usage.labels(v).set(stats.kv_cache_usage)
        for tenant in (set(stats.running_by_tenant) | set(waiting) | set(blocks)) - self._tenants:
            self._touch(tenant)
        for tenant in self._tenants:
            self.running.labels(v, tenant).set(stats.running_by_tenant.get(tenant, 0))
            self.waiting.labels(v, tenant).set(waiting.get(tenant, 0))
            self.tenant_blocks.labels(v, tenant).set(blocks.get(tenant, 0))
        if stats.num_preemptions > self._last_preemptions:
            self.preemptions.labels(v).inc(stats.num_preemptions - self._last_preemptions)
            self._last_preemptions = stats.num_preemptions
        if stats.prefix_cache_hit_tokens > self._last_prefix_hits:
            self.prefix_hits.labels(v).inc(stats.prefix_cache_hit_tokens - self._last_prefix_hits)
            self._last_prefix_hits = stats.prefix_cache_hit_tokens

    def reject(self, tenant: str, reason: str) -> None:
        self.rejected.labels(self.version, tenant, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
