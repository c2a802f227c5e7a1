"""The release flow's records, as plain dataclasses: what each stage hands to the next (and Prefect
persists). Imports nothing from flows/, so every stage can use them."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

DEFAULT_SUITES = ("accuracy", "safety")  # suites or single task names, as `quantgate eval --suite` takes
BASELINE = "baseline"


@dataclass(frozen=True)
class Source:
    ref: str
    name: str  # MLflow experiment / registered model stem
    path: str
    content_hash: str


@dataclass(frozen=True)
class Variant:
    name: str  # "baseline" or the method, with its KV suffix ("int4wo+kv8")
    method: str | None
    path: str
    content_hash: str  # of the weights; the KV dtype is not in it (int4wo and int4wo+kv8 share one)
    manifest: dict | None = None
    kv_cache_dtype: str = "auto"  # the engine's cache for this variant: auto | int8 | fp8


@dataclass(frozen=True)
class MeasureConfig:
    suites: tuple[str, ...] = DEFAULT_SUITES
    limit: int | None = None
    bench_requests: int = 16
    bench_concurrency: int = 4
    bench_max_tokens: int = 32
    kv_cache_memory_gb: float = 0.5
    capacity_budget_gb: float = 2.0  # weights + KV cache: how many sequences fit beside each variant
    capacity_seq_len: int = 1024
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Measured:
    variant: Variant
    metrics: dict[str, float]
    eval_dir: str  # per-sample logs of every suite, read by the comparison
    bench_json: str
    artifacts: list[str] = field(default_factory=list)


@dataclass
class VariantResult:
    name: str
    method: str | None
    run_id: str
    version: str | None = None
    weight_bytes: float | None = None
    gates_passed: bool | None = None
    gates_total: int = 0
    gates_failed: list[str] = field(default_factory=list)
    gates_uninformative: list[str] = field(default_factory=list)  # could not have failed: no evidence
    decision: str = ""


@dataclass
class ReleaseSummary:
    model: str
    source_hash: str
    release_run_id: str
    flow_run_id: str
    tracking_uri: str
    registered_model: str
    rows: list[VariantResult]
    chosen: str | None = None
    challenger_version: str | None = None
    canary: dict = field(default_factory=dict)
    outcome: str = ""
    aliases: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)
