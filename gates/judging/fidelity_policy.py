"""The policy's `fidelity:`, `long_context:` and `deployment:` sections (read by `gates.judging.policy`).

A section that is absent, or whose threshold is null, switches its gates off; the measurement it drives
in the release flow (`flows.fidelity_stage`) is skipped with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator

from quantgate.config import StrictModel

LONG_CONTEXT_VARIANTS = ("kv", "all")  # kv: only variants with a quantized KV cache


@dataclass(frozen=True)
class FidelityGate:
    max_kl: float | None = None  # nats per token, on the CI's high end
    max_flip_rate: float | None = None  # top-1 flips per token, on the CI's high end
    chunks: int = 16
    chunk_tokens: int = 128

    @property
    def enabled(self) -> bool:
        return self.max_kl is not None or self.max_flip_rate is not None


@dataclass(frozen=True)
class LongContextGate:
    max_drop: float | None = None  # retrieval accuracy, variant - baseline, on the CI's low end
    lengths: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    probes_per_length: int = 6
    variants: str = "kv"
    min_baseline_accuracy: float = 0.5

    @property
    def enabled(self) -> bool:
        return self.max_drop is not None

    def probes(self, kv_cache_dtype: str) -> bool:
        """Whether a variant with this KV cache runs the probe."""
        return self.enabled and (self.variants == "all" or kv_cache_dtype != "auto")


@dataclass(frozen=True)
class Deployment:
    system_prompt: str | None = None  # the safety suites run baseline and variants with it
    chat_template: bool | None = None  # None: each task's own choice; true/false forces it for the safety suites


def _number(low: float | None, nullable: bool) -> BeforeValidator:
    def check(value: Any) -> float | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"expected a number{' or null' if nullable else ''}, got {value!r}")
        if low is not None and not float(value) >= low:
            raise ValueError(f"expected a number >= {low}, got {value!r}")
        return float(value)

    return BeforeValidator(check)


def _rate(nullable: bool) -> BeforeValidator:
    def check(value: Any) -> float | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"expected a fraction in [0, 1]{' or null' if nullable else ''}, got {value!r}")
        return float(value)

    return BeforeValidator(check)


def _count(minimum: int) -> BeforeValidator:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {value!r}")
        return value

    return BeforeValidator(check)


def _lengths(value: Any) -> list[int]:
    if not isinstance(value, list) or not value or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 64 for n in value):
        raise ValueError(f"expected a non-empty list of prompt lengths in tokens (integers >= 64), got {value!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"lengths repeat: {value!r}")
    return value


def _choice(value: Any) -> str:
    if value not in LONG_CONTEXT_VARIANTS:
        raise ValueError(f"expected one of {', '.join(LONG_CONTEXT_VARIANTS)}, got {value!r}")
    return value


def _text_or_null(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"expected a non-empty string or null, got {value!r}")
    return value


def _bool_or_null(value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"expected true, false or null, got {value!r}")
    return value


class FidelitySection(StrictModel):
    max_kl: Annotated[float | None, _number(0.0, True)] = None
    max_flip_rate: Annotated[float | None, _rate(True)] = None
    chunks: Annotated[int, _count(2)] = 16
    chunk_tokens: Annotated[int, _count(2)] = 128

    def gate(self) -> FidelityGate:
        return FidelityGate(self.max_kl, self.max_flip_rate, self.chunks, self.chunk_tokens)


class LongContextSection(StrictModel):
    max_drop: Annotated[float | None, _rate(True)] = None
    lengths: Annotated[list[int], BeforeValidator(_lengths)] = [512, 1024, 2048, 4096, 8192]
    probes_per_length: Annotated[int, _count(1)] = 6
    variants: Annotated[str, BeforeValidator(_choice)] = "kv"
    min_baseline_accuracy: Annotated[float, _rate(False)] = 0.5

    def gate(self) -> LongContextGate:
        return LongContextGate(self.max_drop, tuple(self.lengths), self.probes_per_length, self.variants,
                               self.min_baseline_accuracy)


class DeploymentSection(StrictModel):
    system_prompt: Annotated[str | None, BeforeValidator(_text_or_null)] = None
    chat_template: Annotated[bool | None, BeforeValidator(_bool_or_null)] = None

    def deployment(self) -> Deployment:
        return Deployment(self.system_prompt, self.chat_template)
