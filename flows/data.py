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
    # flows.fidelity_stage, from the policy's fidelity / long_context / deployment sections
    fidelity_chunks: int = 0  # held-text chunks teacher-forced for the fidelity gates (0: none)
    fidelity_chunk_tokens: int = 128
    probe_lengths: tuple[int, ...] = ()  # long-context probe lengths in tokens
    probes_per_length: int = 0
    probe_models: tuple[str, ...] = ()  # the models (baseline, variant names) that run the probe
    system_prompt: str | None = None  # the deployment's: the safety suites run with it
    chat_template: bool | None = None  # None: each task's own
    # Which disjoint split of the items (`quantgate tune`): 0 the first `limit` items of every task and the
    # first `fidelity_chunks` windows of the held text; 1 the next ones (held out), and so on.
    split: int = 0
    device: str = "cpu"  # where every model is served (flows.machine.resolve_device)

    def key(self) -> str:
        fields = asdict(self)
        if not self.split:
            del fields["split"]  # split 0 keeps the key it had before splits existed
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    def eval_docs(self) -> range | None:
        """The items of every task this split takes (None: split 0, the first `limit`, as lm-eval's limit)."""
        if not self.split:
            return None
        if self.limit is None:
            raise ValueError("a held-out split needs a limit (items per task in each split)")
        return range(self.split * self.limit, (self.split + 1) * self.limit)


@dataclass(frozen=True)
class SpeedPlan:
    """The paired speed measurement (flows.speed_rounds): every model at every operating point in each round.
    Small token counts, so that every round of every model fits in a release's time on a small CPU (how long
    they took: docs/results/design-figures.md)."""

    decode_batches: tuple[int, ...] = (1, 4, 16)  # the policy's decode operating points
    decode_tokens: int = 8  # timed decode steps per sequence
    decode_context: int = 8  # prompt tokens of each decoding sequence
    prefill_tokens: int = 64  # one prompt of this many tokens, timed to its first token
    rounds: int = 5
    warmup_rounds: int = 1  # untimed: kernel builds, first-call packing, every batch shape once
    seed: int = 0
    device: str = "cpu"  # where every model is served (flows.machine.resolve_device)

    def points(self) -> list[str]:
        return ["prefill"] + [f"decode_b{b}" for b in self.decode_batches]

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class SpeedResult:
    metrics: dict[str, dict[str, float]]  # model name -> its paired speed metrics (gates.metric_names names)
    machine: str  # the machine, in words (flows.machine.describe_line)
    report: str = ""  # the JSON file of every round's figures


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
    gates_reasons: dict[str, str] = field(default_factory=dict)  # each stopping gate's reason, with its figures


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
    machine: str = ""  # where the speeds were measured (a verdict on one machine is not another's)

    def as_dict(self) -> dict:
        return asdict(self)
