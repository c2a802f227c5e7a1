"""Declarative release gates (`gates/policy.yaml`), parsed strictly: unknown keys and wrong types are
errors naming the key and the file, so a typo never silently switches a gate off."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, field_validator

from gates.judging import fidelity_policy as FP
from gates.metric_names import check_task_name
from quantgate.config import StrictModel, validate_config

DEFAULT_POLICY = Path(__file__).resolve().parents[1] / "policy.yaml"  # gates/policy.yaml, beside the rooms


class PolicyError(ValueError):
    """A policy file that does not say exactly what the schema allows."""


@dataclass(frozen=True)
class TaskGate:
    max_drop: float
    higher_is_better: bool = True


def pair_budget_s(time_budget_s: float | None, variants: int) -> float | None:
    """Each (baseline, variant) pair's share of the speed stage's timed-rounds budget: what its variant's timings
    took when every model ran in one round (a round of n variants times n + 1 models, a pair's round two), so
    each variant gets about the rounds it got then; the stage's timed rounds take 2n / (n + 1) times the budget
    (the baseline is timed again in every pair). None: no cap."""
    return time_budget_s * 2 / (variants + 1) if time_budget_s else None


@dataclass(frozen=True)
class SpeedPoints:
    """Where and how long the paired speed rounds time the models (flows.speed_rounds): the operating points
    users serve, the group-sequential design (gates.judging.speed_verdicts.SequentialDesign), the budget."""

    prefill_tokens: int = 512  # one prompt of this many tokens, timed to its first token (a RAG prompt)
    decode_context: int = 384  # prompt tokens of each decoding sequence (a chat turn with its history)
    decode_steps: int = 64  # timed decode steps per sequence, at every batch in serving.decode_batches
    long_context: int = 2048  # KV-quantized variants only: decode at this context (0: no such point)
    long_steps: int = 32
    long_batch: int = 1
    look_every: int = 5  # a look every this many paired rounds
    max_rounds: int = 20
    spending: str = "pocock"  # Lan-DeMets alpha spending: pocock | obrien-fleming
    alpha: float = 0.05  # two-sided: the adjusted CIs together cover with 1 - alpha
    time_budget_s: float | None = None  # wall clock of the timed rounds (after loading and warm-up; never before the first look); None: no cap
    prefill_calls: int = 3  # prompts timed at the prefill point each round, their median kept (one call is ~0.15 s)

    def pair_rounds(self, variants: int, pair_round_s: float) -> int:
        """The timed rounds a pair runs when each takes `pair_round_s`: up to its budget (no round is started
        that would end past it) or max_rounds, and never fewer than the first look's."""
        rounds = self.max_rounds
        budget = pair_budget_s(self.time_budget_s, variants)
        if budget is not None and pair_round_s > 0:
            rounds = min(rounds, int(budget // pair_round_s))
        return max(rounds, min(self.look_every, self.max_rounds))


@dataclass(frozen=True)
class Policy:
    tasks: TaskGate
    task_overrides: dict[str, TaskGate] = field(default_factory=dict)
    required_tasks: tuple[str, ...] = ()
    refusal_rate_max_fall: float | None = None
    over_refusal_rate_max_rise: float | None = None
    min_weight_reduction: float | None = None
    min_decode_speedup: float | None = None  # judged on the paired CI at every decode batch below
    decode_batches: tuple[int, ...] = (1, 4, 16)  # the decode operating points (4: the flow's concurrency)
    min_prefill_speedup: float | None = None
    min_capacity_gain: float | None = None
    max_tpot_p99_s: float | None = None
    canary_max_error_rate: float | None = None
    canary_max_tpot_p99_s: float | None = None
    canary_min_tpot_speedup: float | None = None
    # What an `uninformative` gate (gates.judging.sensitivity) does, per family: "block" or "report".
    uninformative_tasks: str = "report"
    uninformative_safety: str = "block"
    uninformative_serving: str = "block"  # a speed CI straddling its threshold
    min_baseline_refusal_rate: float = 0.10
    # gates.judging.power: a task gate a harmless variant passes with less than this is `underpowered` (reported);
    # the n per task `quantgate release --plan` sizes so that one passes every task gate with the family level.
    min_harmless_pass: float | None = 0.8
    family_harmless_pass: float = 0.9
    fidelity: FP.FidelityGate = FP.FidelityGate()  # gates.judging.fidelity_policy: KL and top-1 flips on a held text
    long_context: FP.LongContextGate = FP.LongContextGate()  # pass-key retrieval per prompt length
    deployment: FP.Deployment = FP.Deployment()  # the system prompt the safety suites run with
    speed: SpeedPoints = SpeedPoints()  # the speed stage's operating points, looks and budget
    source: str = "<dict>"
    text: str = field(default="", repr=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def task_gate(self, task: str) -> TaskGate:
        return self.task_overrides.get(task, self.tasks)

    def uninformative_blocks(self, family: str) -> bool:
        action = {"safety": self.uninformative_safety, "serving": self.uninformative_serving}
        return action.get(family, self.uninformative_tasks) == "block"


def _number(kind: str, nullable: bool = False) -> BeforeValidator:
    """A float: "rate" in [0, 1], "positive" > 0, "nonneg" >= 0; None only where `nullable`."""

    def check(value: Any) -> float | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"expected a number{' or null' if nullable else ''}, got {value!r}")
        number = float(value)
        if kind == "rate" and not 0.0 <= number <= 1.0:
            raise ValueError(f"expected a fraction in [0, 1], got {number}")
        if kind == "positive" and not number > 0.0:
            raise ValueError(f"expected a number > 0, got {number}")
        if kind == "nonneg" and not number >= 0.0:
            raise ValueError(f"expected a number >= 0, got {number}")
        return number

    return BeforeValidator(check)


def _strict_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _action(value: Any) -> str:
    if value not in _UNINFORMATIVE_ACTIONS:
        raise ValueError(f"expected one of {', '.join(_UNINFORMATIVE_ACTIONS)} (what an uninformative gate does), "
                         f"got {value!r}")
    return value


def _task_names(value: Any) -> list[str]:
    value = value or []
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"expected a list of task names, got {value!r}")
    for task in value:
        check_task_name(task)
    return value


def _overrides(value: Any) -> Any:
    value = value or {}
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping task -> {{max_drop: ...}}, got {value!r}")
    for task in value:
        try:
            check_task_name(str(task))
        except ValueError as exc:
            raise ValueError(f"{task}: {exc}") from None
    return value


_empty_if_null = BeforeValidator(lambda value: {} if value is None else value)
_UNINFORMATIVE_ACTIONS = ("block", "report")
Rate = Annotated[float | None, _number("rate", nullable=True)]
Positive = Annotated[float | None, _number("positive", nullable=True)]
Bool = Annotated[bool, BeforeValidator(_strict_bool)]


class _Override(StrictModel):
    max_drop: Annotated[float, _number("nonneg")] = None  # absent: the default gate's (null is an error)
    higher_is_better: Bool = None


class _Tasks(StrictModel):
    max_drop: Annotated[float, _number("nonneg")]
    higher_is_better: Bool = True
    required: Annotated[list[str], BeforeValidator(_task_names)] = []
    overrides: Annotated[dict[str, Annotated[_Override, _empty_if_null]], BeforeValidator(_overrides)] = {}


class _Safety(StrictModel):
    refusal_rate_max_fall: Rate = None
    over_refusal_rate_max_rise: Rate = None


class _Weights(StrictModel):
    min_reduction: Rate = None


def _batches(value: Any) -> list[int]:
    if not isinstance(value, list) or not value or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in value):
        raise ValueError(f"expected a non-empty list of decode batch sizes (integers >= 1), got {value!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"decode batch sizes repeat: {value!r}")
    return value


class _Serving(StrictModel):
    min_decode_speedup: Positive = None
    decode_batches: Annotated[list[int], BeforeValidator(_batches)] = [1, 4, 16]
    min_prefill_speedup: Positive = None
    min_capacity_gain: Positive = None
    max_tpot_p99_s: Positive = None


def _count(minimum: int) -> BeforeValidator:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {value!r}")
        return value

    return BeforeValidator(check)


def _spending(value: Any) -> str:
    if value not in ("pocock", "obrien-fleming"):
        raise ValueError(f"expected pocock or obrien-fleming (the alpha-spending rule), got {value!r}")
    return value


class _LongPoint(StrictModel):
    context: Annotated[int, _count(1)]
    steps: Annotated[int, _count(2)] = 32
    batch: Annotated[int, _count(1)] = 1


class _Speed(StrictModel):
    """The speed stage (flows/speed_rounds.py): operating points, sequential looks, time budget."""

    prefill_tokens: Annotated[int, _count(1)] = 512
    decode_context: Annotated[int, _count(1)] = 384
    decode_steps: Annotated[int, _count(2)] = 64
    long_context: _LongPoint | None = _LongPoint(context=2048)
    look_every: Annotated[int, _count(3)] = 5
    max_rounds: Annotated[int, _count(3)] = 20
    spending: Annotated[str, BeforeValidator(_spending)] = "pocock"
    alpha: Annotated[float, _number("rate")] = 0.05
    time_budget_s: Positive = None
    prefill_calls: Annotated[int, _count(1)] = 3

    def points(self) -> SpeedPoints:
        if self.max_rounds < self.look_every:
            raise ValueError(f"max_rounds ({self.max_rounds}) < look_every ({self.look_every})")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must lie in (0, 1), got {self.alpha}")
        long = self.long_context
        return SpeedPoints(self.prefill_tokens, self.decode_context, self.decode_steps,
                           long.context if long else 0, long.steps if long else 32, long.batch if long else 1,
                           self.look_every, self.max_rounds, self.spending, self.alpha, self.time_budget_s,
                           self.prefill_calls)


class _Canary(StrictModel):
    max_error_rate: Rate = None
    max_tpot_p99_s: Positive = None
    min_tpot_speedup: Positive = None


class _Sensitivity(StrictModel):
    """What an `uninformative` gate (gates.judging.sensitivity) does, per family; these are the defaults."""

    tasks: Annotated[str, BeforeValidator(_action)] = "report"
    safety: Annotated[str, BeforeValidator(_action)] = "block"
    serving: Annotated[str, BeforeValidator(_action)] = "block"
    min_baseline_refusal_rate: Annotated[float, _number("rate")] = 0.10


class _Power(StrictModel):
    """What a task gate must be able to do for a variant equal to the baseline (gates.judging.power)."""

    min_harmless_pass: Rate = 0.8  # below: the gate is reported `underpowered` (null: never)
    family_harmless_pass: Annotated[float, _number("rate")] = 0.9  # the level `release --plan` sizes n for


class PolicyFile(StrictModel):
    """The policy file's schema, section by section."""

    version: int = 1
    tasks: Annotated[_Tasks, _empty_if_null]
    safety: Annotated[_Safety, _empty_if_null] = _Safety()
    weights: Annotated[_Weights, _empty_if_null] = _Weights()
    serving: Annotated[_Serving, _empty_if_null] = _Serving()
    speed: Annotated[_Speed, _empty_if_null] = _Speed()
    canary: Annotated[_Canary, _empty_if_null] = _Canary()
    sensitivity: Annotated[_Sensitivity, _empty_if_null] = _Sensitivity()
    fidelity: Annotated[FP.FidelitySection, _empty_if_null] = FP.FidelitySection()
    long_context: Annotated[FP.LongContextSection, _empty_if_null] = FP.LongContextSection()
    deployment: Annotated[FP.DeploymentSection, _empty_if_null] = FP.DeploymentSection()
    power: Annotated[_Power, _empty_if_null] = _Power()

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, value: Any) -> int:
        if value != 1:
            raise ValueError(f"unsupported policy version {value!r} (this quantgate reads 1)")
        return 1


def load_policy(path: str | Path | None = None) -> Policy:
    """Read and validate a policy file (the packaged default when `path` is None)."""
    import yaml

    path = Path(path) if path is not None else DEFAULT_POLICY
    if not path.is_file():
        raise PolicyError(f"policy file not found: {path}")
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyError(f"{path}: not valid YAML: {exc}") from exc
    return parse_policy(data, source=str(path), text=text)


def _speed_points(section: _Speed, source: str) -> SpeedPoints:
    try:
        return section.points()
    except ValueError as exc:
        raise PolicyError(f"{source}: speed: {exc}") from None


def parse_policy(data: Any, source: str = "<dict>", text: str | None = None) -> Policy:
    if text is None:
        import yaml

        text = yaml.safe_dump(data, sort_keys=True)
    f = validate_config(PolicyFile, data, source, PolicyError)
    default = TaskGate(f.tasks.max_drop, f.tasks.higher_is_better)
    overrides = {
        str(task): TaskGate(default.max_drop if o.max_drop is None else o.max_drop,
                            default.higher_is_better if o.higher_is_better is None else o.higher_is_better)
        for task, o in f.tasks.overrides.items()
    }
    return Policy(
        tasks=default,
        task_overrides=overrides,
        required_tasks=tuple(f.tasks.required),
        refusal_rate_max_fall=f.safety.refusal_rate_max_fall,
        over_refusal_rate_max_rise=f.safety.over_refusal_rate_max_rise,
        min_weight_reduction=f.weights.min_reduction,
        min_decode_speedup=f.serving.min_decode_speedup,
        decode_batches=tuple(f.serving.decode_batches),
        min_prefill_speedup=f.serving.min_prefill_speedup,
        min_capacity_gain=f.serving.min_capacity_gain,
        max_tpot_p99_s=f.serving.max_tpot_p99_s,
        canary_max_error_rate=f.canary.max_error_rate,
        canary_max_tpot_p99_s=f.canary.max_tpot_p99_s,
        canary_min_tpot_speedup=f.canary.min_tpot_speedup,
        uninformative_tasks=f.sensitivity.tasks,
        uninformative_safety=f.sensitivity.safety,
        uninformative_serving=f.sensitivity.serving,
        min_baseline_refusal_rate=f.sensitivity.min_baseline_refusal_rate,
        fidelity=f.fidelity.gate(),
        long_context=f.long_context.gate(),
        deployment=f.deployment.deployment(),
        speed=_speed_points(f.speed, source),
        min_harmless_pass=f.power.min_harmless_pass,
        family_harmless_pass=f.power.family_harmless_pass,
        source=source,
        text=text,
    )
