"""The scheduler's contract with the engine (the way vLLM's v1/core/sched/interface.py states one): what a
batching policy is asked each step and what it reports. The engine talks to its scheduler through these
methods only; servers, fleets and benchmarks read the engine's stats, never the scheduler's queues."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from serving.core.sequence import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def is_prefill(self) -> bool:
        """Prompt tokens (or a preempted sequence's recompute), not the one token of a decode."""
        return self.num_new_tokens > 1 or self.seq.num_computed_tokens == 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    shared_step: bool = False  # several tenants had work (the time allowance is charged for this step)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.is_prefill)


@dataclass
class TenantLoad:
    """Per tenant: sequences running, sequences waiting, KV blocks held by the running ones."""

    running: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    kv_blocks: dict[str, int] = field(default_factory=dict)


class SchedulerInterface(ABC):
    """A batching policy. Called from the engine's thread only, in this order each step: `add` for new
    requests, `abort` for cancelled ones, `schedule`, then (after the forward) `step_done` and `finish`
    for every sequence that ended. `num_preemptions` counts preemptions since the start."""

    num_preemptions: int

    @abstractmethod
    def add(self, seq: Sequence) -> None:
        """Queue a new request."""

    @abstractmethod
    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is (its KV blocks freed); None if the scheduler does not hold it."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """The sequences of the next forward pass and how many tokens each computes; may preempt."""

    @abstractmethod
    def step_done(self, plan: SchedulerOutput, seconds: float) -> None:
        """The time the forward of `plan` took (policies that budget time read it)."""

    @abstractmethod
    def finish(self, seq: Sequence) -> None:
        """Evict a finished sequence now, so its blocks are free for the next admission."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""

    @property
    @abstractmethod
    def tenant_max_kv_blocks(self) -> dict[str, int]:
        """Each tenant's KV-block quota (the engine refuses a request no quota could ever admit)."""

    @abstractmethod
    def tenant_load(self) -> TenantLoad:
        """Running and waiting sequences and held KV blocks, per tenant (what the engine's stats report)."""
