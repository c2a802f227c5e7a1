"""A gate's verdict and a stage's evaluation, as judged (gates.records.evaluation), recorded on the run and read back
from its tags (gates.records.evaluation), rendered (gates.judging.gate_report) and re-checked (gates.evidence.verify)."""

from __future__ import annotations

from dataclasses import dataclass, field

NOT_MEASURED = "not measured"
UNINFORMATIVE = "uninformative"


@dataclass(frozen=True)
class GateResult:
    name: str
    stage: str
    rule: str  # "observed >= threshold" in words, e.g. "delta CI low >= -max_drop"
    threshold: float
    observed: float | None
    passed: bool  # does not stop the variant (an uninformative gate passes only if the policy lets it)
    reason: str
    verdict: str = ""  # "pass" | "fail" | "uninformative"; empty: from `passed`
    harmless_pass: float | None = None  # task gates (gates.judging.power): P(a variant equal to the baseline passes)
    refusal80_drop: float | None = None  # the drop this gate refuses with 80 % probability
    underpowered: bool = False  # harmless_pass below the policy's min_harmless_pass; never changes the verdict

    def __post_init__(self) -> None:
        if not self.verdict:
            object.__setattr__(self, "verdict", "pass" if self.passed else "fail")


@dataclass
class Evaluation:
    run_id: str
    stage: str
    results: list[GateResult]
    evaluated_at: str = ""
    policy_sha256: str = ""
    policy_source: str = ""
    baseline_run_id: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failed(self) -> list[GateResult]:
        return [r for r in self.results if not r.passed]

    @property
    def uninformative(self) -> list[GateResult]:
        return [r for r in self.results if r.verdict == UNINFORMATIVE]
