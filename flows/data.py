"""The release flow's records, as plain dataclasses: what each stage hands to the next (and Prefect
persists). Imports nothing from flows/, so every stage can use them."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from gates.time_plan import MeasureShape

# suites or single task names, as `quantgate eval --suite` takes: our own tasks, the safety suite, and the real
# benchmarks gates/policy.yaml requires (ARC-Easy, PIQA, HellaSwag, WinoGrande, the fixed MMLU subset)
DEFAULT_SUITES = ("accuracy", "safety", "arc_easy", "piqa", "hellaswag", "winogrande", "mmlu_marketing",
                  "mmlu_high_school_geography", "mmlu_high_school_psychology")
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
    # weights + KV cache: how many sequences fit beside each variant; the release sizes it from its memory plan
    # (flows/memory_plan.py: the baseline as served + 1 GiB of KV, whole GiB, never under this default)
    capacity_budget_gb: float = 2.0
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

    def time_shape(self) -> MeasureShape:
        """What each measure stage runs, for the time plan (gates/time_plan.py; the items per task it counts)."""
        return MeasureShape(items={}, bench_requests=self.bench_requests, bench_concurrency=self.bench_concurrency,
                            bench_max_tokens=self.bench_max_tokens,
                            fidelity_tokens=self.fidelity_chunks * self.fidelity_chunk_tokens,
                            probe_tokens=self.probes_per_length * sum(self.probe_lengths),
                            probe_models=self.probe_models)


@dataclass(frozen=True)
class SpeedPlan:
    """The paired speed measurement (flows.speed_rounds): the baseline paired with each variant in turn, both
    at every operating point in each round, at the lengths users serve (the policy's `speed` section), until
    each (variant, point) reaches a decision by the group-sequential rule (gates.judging.speed_verdicts) or the
    rounds or the time budget run out."""

    decode_batches: tuple[int, ...] = (1, 4, 16)  # the policy's decode operating points
    decode_tokens: int = 64  # timed decode steps per sequence
    decode_context: int = 384  # prompt tokens of each decoding sequence
    prefill_tokens: int = 512  # one prompt of this many tokens, timed to its first token
    prefill_calls: int = 3  # prompts timed at the prefill point each round (fresh ones), their median kept
    long_context: int = 0  # KV-quantized variants: decode at this context (0: no long-context point)
    long_tokens: int = 32
    long_batch: int = 1
    rounds: int = 20  # the most paired rounds a point gets
    look_every: int = 5  # a sequential look every this many rounds
    spending: str = "pocock"  # Lan-DeMets alpha-spending rule
    alpha: float = 0.05
    time_budget_s: float | None = None  # the timed rounds' wall clock, each pair its share (flows.speed_rounds
    # pair_budget; loading and warm-up not counted); None: no cap
    min_decode: float | None = None  # the gates' minimums: where a point's CI stops it (None: first look)
    min_prefill: float | None = None
    warmup_rounds: int = 1  # untimed: kernel builds, first-call packing, every batch shape once
    seed: int = 0
    device: str = "cpu"  # where every model is served (flows.machine.resolve_device)

    @classmethod
    def from_policy(cls, policy, device: str = "cpu") -> SpeedPlan:
        """The plan a policy (gates.judging.policy.Policy) names: its points, looks, budget and minimums."""
        s = policy.speed
        return cls(decode_batches=tuple(policy.decode_batches), decode_tokens=s.decode_steps,
                   decode_context=s.decode_context, prefill_tokens=s.prefill_tokens, prefill_calls=s.prefill_calls,
                   long_context=s.long_context,
                   long_tokens=s.long_steps, long_batch=s.long_batch, rounds=s.max_rounds, look_every=s.look_every,
                   spending=s.spending, alpha=s.alpha, time_budget_s=s.time_budget_s,
                   min_decode=policy.min_decode_speedup, min_prefill=policy.min_prefill_speedup, device=device)

    def points(self, kv: bool = False) -> list[str]:
        """The operating points; `kv`: with the long-context one (timed for KV-quantized variants only)."""
        long = [f"long_decode_b{self.long_batch}"] if kv and self.long_context else []
        return ["prefill"] + [f"decode_b{b}" for b in self.decode_batches] + long

    def shape(self, point: str) -> dict[str, int]:
        """A point's operating figures: prompt (context) tokens, timed steps, batch."""
        if point == "prefill":
            return {"prompt_tokens": self.prefill_tokens, "steps": 1, "batch": 1, "calls": self.prefill_calls}
        if point.startswith("long_decode_b"):
            return {"prompt_tokens": self.long_context, "steps": self.long_tokens, "batch": self.long_batch}
        return {"prompt_tokens": self.decode_context, "steps": self.decode_tokens, "batch": int(point[len("decode_b"):])}

    def minimum(self, point: str) -> float | None:
        return self.min_prefill if point == "prefill" else self.min_decode

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
