"""The engine's contract with the code around it (servers, the fleet, evals, benchmarks): its configuration,
fixed at construction (`EngineConfig`), what each step returns (`RequestOutput`), and what it reports
(`EngineStats`). Callers use these and the methods of `EngineClient`; they never reach into the engine's
scheduler or block manager. Imports neither torch nor the model code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from serving.core.sampling_params import SamplingParams
from serving.core.sequence import RequestMetrics, TokenLogprob


@dataclass(frozen=True)
class EngineConfig:
    """An engine's settings as resolved at construction (a budget in GB resolved to blocks, and so on)."""

    model_name: str
    device: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    scheduler: str  # continuous | static | dynamic (serving/core/schedulers.py)
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    prefix_cache_scope: str
    kv_cache_dtype: str  # auto | int8 | fp8
    attention: str  # torch | triton, as resolved from `auto`
    kernel_isa: str  # the CPU kernel path, or the device type off the CPU
    cuda_graphs: bool
    batch_timeout_s: float | None = None  # the dynamic scheduler's batch timeout; None for the others


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    tenant: str = "default"


@dataclass
class EngineStats:
    """A snapshot of the engine's load. Safe to take from another thread (the fleet's router does)."""

    num_blocks: int
    used_blocks: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_cache_hit_tokens: int
    prompt_tokens: int
    generation_tokens: int
    block_size: int = 16
    running_by_tenant: dict[str, int] = field(default_factory=dict)
    waiting_by_tenant: dict[str, int] = field(default_factory=dict)  # in the scheduler's queue
    kv_blocks_by_tenant: dict[str, int] = field(default_factory=dict)  # held by running sequences
    reserved_blocks: int = 0  # what unfinished requests hold or will hold (prompt + max_tokens each)

    @property
    def kv_cache_usage(self) -> float:
        return self.used_blocks / self.num_blocks


class EngineClient(Protocol):
    """What servers and fleets call. `add_request` and `abort` are thread-safe; `step` runs on one thread
    (the engine loop's); `stats` may be read from any thread."""

    config: EngineConfig

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, tenant: str = "default", cache_salt: str | None = None,
                    stream_text: bool = False, arrival_time: float | None = None) -> str:
        """Validate and queue a request; ValueError names what is wrong. Returns its id."""
        ...

    def abort(self, request_id: str) -> None:
        """The request ends with finish_reason 'abort' at the next step."""
        ...

    def has_unfinished(self) -> bool:
        ...

    def step(self) -> list[RequestOutput]:
        """One forward pass; an output for every request that gained tokens or ended."""
        ...

    def stats(self) -> EngineStats:
        ...

    @property
    def tenant_kv_quotas(self) -> dict[str, int]:
        """Each tenant's KV-block quota, as the engine's tenant fairness enforces it."""
        ...
