"""Declarative release gates (`gates/policy.yaml`), parsed strictly: unknown keys and wrong types are
errors naming the key and the file, so a typo never silently switches a gate off."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gates.metrics import check_task_name

DEFAULT_POLICY = Path(__file__).with_name("policy.yaml")


class PolicyError(ValueError):
    """A policy file that does not say exactly what the schema allows."""


@dataclass(frozen=True)
class TaskGate:
    max_drop: float
    higher_is_better: bool = True


@dataclass(frozen=True)
class Policy:
    tasks: TaskGate
    task_overrides: dict[str, TaskGate] = field(default_factory=dict)
    required_tasks: tuple[str, ...] = ()
    refusal_rate_max_fall: float | None = None
    over_refusal_rate_max_rise: float | None = None
    min_weight_reduction: float | None = None
    min_decode_speedup: float | None = None
    min_capacity_gain: float | None = None
    max_tpot_p99_s: float | None = None
    canary_max_error_rate: float | None = None
    canary_max_tpot_p99_s: float | None = None
    # What an `uninformative` gate (gates.sensitivity) does, per family: "block" or "report".
    uninformative_tasks: str = "report"
    uninformative_safety: str = "block"
    min_baseline_refusal_rate: float = 0.10
    source: str = "<dict>"
    text: str = field(default="", repr=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def task_gate(self, task: str) -> TaskGate:
        return self.task_overrides.get(task, self.tasks)

    def uninformative_blocks(self, family: str) -> bool:
        return (self.uninformative_safety if family == "safety" else self.uninformative_tasks) == "block"


# (section, key) -> (kind, Policy field). Kinds: "rate" [0, 1] or null, "positive" > 0 or null.
_SCALARS: dict[tuple[str, str], tuple[str, str]] = {
    ("safety", "refusal_rate_max_fall"): ("rate", "refusal_rate_max_fall"),
    ("safety", "over_refusal_rate_max_rise"): ("rate", "over_refusal_rate_max_rise"),
    ("weights", "min_reduction"): ("rate", "min_weight_reduction"),
    ("serving", "min_decode_speedup"): ("positive", "min_decode_speedup"),
    ("serving", "min_capacity_gain"): ("positive", "min_capacity_gain"),
    ("serving", "max_tpot_p99_s"): ("positive", "max_tpot_p99_s"),
    ("canary", "max_error_rate"): ("rate", "canary_max_error_rate"),
    ("canary", "max_tpot_p99_s"): ("positive", "canary_max_tpot_p99_s"),
}
_SECTIONS = ("version", "tasks", "safety", "weights", "serving", "canary", "sensitivity")
_SENSITIVITY_KEYS = ("tasks", "safety", "min_baseline_refusal_rate")
_UNINFORMATIVE_ACTIONS = ("block", "report")
_TASK_KEYS = ("max_drop", "higher_is_better", "required", "overrides")
_OVERRIDE_KEYS = ("max_drop", "higher_is_better")


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


def parse_policy(data: Any, source: str = "<dict>", text: str | None = None) -> Policy:
    if text is None:
        import yaml

        text = yaml.safe_dump(data, sort_keys=True)
    where = source

    def fail(key: str, problem: str) -> PolicyError:
        return PolicyError(f"{where}: {key}: {problem}")

    if not isinstance(data, dict):
        raise PolicyError(f"{where}: a policy is a mapping of sections ({', '.join(_SECTIONS)})")
    _unknown(data, _SECTIONS, "", where)
    if data.get("version", 1) != 1:
        raise fail("version", f"unsupported policy version {data.get('version')!r} (this quantgate reads 1)")

    tasks = _section(data, "tasks", where)
    _unknown(tasks, _TASK_KEYS, "tasks.", where)
    if "max_drop" not in tasks:
        raise fail("tasks.max_drop", "required (the largest tolerated drop of any task score)")
    default = TaskGate(
        max_drop=_number(tasks["max_drop"], "tasks.max_drop", where, nullable=False, kind="nonneg"),
        higher_is_better=_bool(tasks.get("higher_is_better", True), "tasks.higher_is_better", where),
    )
    required = tasks.get("required") or []
    if not isinstance(required, list) or not all(isinstance(t, str) for t in required):
        raise fail("tasks.required", f"expected a list of task names, got {required!r}")
    overrides_raw = tasks.get("overrides") or {}
    if not isinstance(overrides_raw, dict):
        raise fail("tasks.overrides", f"expected a mapping task -> {{max_drop: ...}}, got {overrides_raw!r}")
    overrides: dict[str, TaskGate] = {}
    for task, spec in overrides_raw.items():
        key = f"tasks.overrides.{task}"
        try:
            check_task_name(str(task))
        except ValueError as exc:
            raise fail(key, str(exc)) from None
        if not isinstance(spec, dict):
            raise fail(key, f"expected a mapping like {{max_drop: 0.05}}, got {spec!r}")
        _unknown(spec, _OVERRIDE_KEYS, f"{key}.", where)
        max_drop = spec.get("max_drop", default.max_drop)
        overrides[str(task)] = TaskGate(
            max_drop=_number(max_drop, f"{key}.max_drop", where, nullable=False, kind="nonneg"),
            higher_is_better=_bool(spec.get("higher_is_better", default.higher_is_better), f"{key}.higher_is_better", where),
        )
    for task in required:
        try:
            check_task_name(task)
        except ValueError as exc:
            raise fail("tasks.required", str(exc)) from None

    values: dict[str, float | None] = {}
    for section in ("safety", "weights", "serving", "canary"):
        body = _section(data, section, where)
        allowed = [k for (s, k) in _SCALARS if s == section]
        _unknown(body, allowed, f"{section}.", where)
        for key in allowed:
            kind, attr = _SCALARS[(section, key)]
            values[attr] = _number(body.get(key), f"{section}.{key}", where, nullable=True, kind=kind)
    values.update(_sensitivity(data, where))
    return Policy(
        tasks=default,
        task_overrides=overrides,
        required_tasks=tuple(required),
        source=source,
        text=text,
        **values,
    )


def _sensitivity(data: dict, where: str) -> dict[str, object]:
    """`sensitivity: {tasks: report, safety: block, min_baseline_refusal_rate: 0.10}` (these are the defaults)."""
    body = _section(data, "sensitivity", where)
    _unknown(body, _SENSITIVITY_KEYS, "sensitivity.", where)
    out: dict[str, object] = {}
    for family in ("tasks", "safety"):
        if family in body:
            action = body[family]
            if action not in _UNINFORMATIVE_ACTIONS:
                raise PolicyError(f"{where}: sensitivity.{family}: expected one of {', '.join(_UNINFORMATIVE_ACTIONS)} "
                                  f"(what an uninformative gate does), got {action!r}")
            out[f"uninformative_{family}"] = action
    if "min_baseline_refusal_rate" in body:
        out["min_baseline_refusal_rate"] = _number(body["min_baseline_refusal_rate"],
                                                   "sensitivity.min_baseline_refusal_rate", where, nullable=False,
                                                   kind="rate")
    return out


def _section(data: dict, name: str, where: str) -> dict:
    body = data.get(name)
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise PolicyError(f"{where}: {name}: expected a mapping, got {type(body).__name__} {body!r}")
    return body


def _unknown(body: dict, allowed: tuple[str, ...] | list[str], prefix: str, where: str) -> None:
    for key in body:
        if key not in allowed:
            raise PolicyError(f"{where}: unknown key {prefix + str(key)!r} (allowed here: {', '.join(allowed)})")


def _bool(value: Any, key: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise PolicyError(f"{where}: {key}: expected true or false, got {value!r}")
    return value


def _number(value: Any, key: str, where: str, nullable: bool, kind: str) -> float | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PolicyError(f"{where}: {key}: expected a number{' or null' if nullable else ''}, got {value!r}")
    number = float(value)
    if kind == "rate" and not 0.0 <= number <= 1.0:
        raise PolicyError(f"{where}: {key}: expected a fraction in [0, 1], got {number}")
    if kind == "positive" and not number > 0.0:
        raise PolicyError(f"{where}: {key}: expected a number > 0, got {number}")
    if kind == "nonneg" and not number >= 0.0:
        raise PolicyError(f"{where}: {key}: expected a number >= 0, got {number}")
    return number
