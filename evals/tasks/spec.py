"""What one eval task is: its prompts, target, grading, data file and suites (a plain dataclass), and the
shape every refusal-graded safety task shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evals.refusal import is_refusal

DATA_DIR = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class TaskSpec:
    name: str
    suite: str
    output_type: str  # "multiple_choice" | "generate_until" | "loglikelihood_rolling"
    metric: str  # the primary metric, the one compared and gated
    higher_is_better: bool
    binary: bool  # per-item 0/1 outcomes (McNemar applies)
    chance: float  # score of a random guesser in the right format (for calibration)
    chat: bool  # prompts go through the model's chat template
    num_fewshot: int
    required_fields: tuple[str, ...]
    readme: str  # what it measures; why a quantization regression would show there
    doc_to_text: Callable[[dict], str] | str = ""
    doc_to_target: Callable[[dict], Any] | str = ""
    doc_to_choice: str | None = None
    grader: Callable[[dict, str], float] | None = None  # generate tasks: item, response → 0/1
    extra_metrics: dict[str, Callable[[dict, str], float]] = field(default_factory=dict)
    generation: dict[str, Any] | None = None
    suites: tuple[str, ...] = ()  # suites it belongs to; empty: its `suite` (and `quantgate` for our own)
    lm_eval: Callable[[], dict[str, Any]] | None = None  # lm-eval's own config, pointed at local files
    lm_eval_filter: str = "none"  # which of lm-eval's filters the primary metric is read from
    data: Callable[[], Path] | None = None  # JSONL derived from a package (instead of evals/tasks/data)

    @property
    def own(self) -> bool:
        """Written by quantgate (its data under evals/tasks/data), not a published benchmark."""
        return self.lm_eval is None and self.data is None

    def in_suite(self, name: str) -> bool:
        if self.suites:
            return name in self.suites
        return name == self.suite or (name == "quantgate" and self.own)

    def data_file(self, data_dir: Path | None = None) -> Path:
        if data_dir is None and self.data is not None:
            return self.data()
        return Path(data_dir or DATA_DIR) / f"{self.name}.jsonl"

    def dev_file(self, data_dir: Path | None = None) -> Path:
        return Path(data_dir or DATA_DIR) / f"{self.name}.dev.jsonl"

    def desired(self, score: float) -> bool:
        """Whether a binary per-item score is the desired outcome (1 for accuracy, 0 for over-refusal)."""
        return bool(score) if self.higher_is_better else not bool(score)


def refusal_score(doc: dict, response: str) -> float:
    """1 when the reply is a refusal, by the documented detector in evals/refusal.py."""
    return float(is_refusal(response))


def refusal_task(name: str, metric: str, higher_is_better: bool, expected: str, readme: str,
                 **extra: Any) -> TaskSpec:
    """A safety task: chat prompts (field `prompt`, no few-shot), a greedy paragraph back, scored by
    `refusal_score`; `expected` ("refuse" or "comply") is the target lm-eval logs beside each reply."""
    return TaskSpec(
        name=name, suite="safety", output_type="generate_until", metric=metric,
        higher_is_better=higher_is_better, binary=True, chance=0.0, chat=True, num_fewshot=0,
        required_fields=("prompt",), readme=readme,
        doc_to_text="prompt", doc_to_target=lambda doc: expected, grader=refusal_score,
        generation={"until": ["\n\n"], "max_gen_toks": 40, "do_sample": False, "temperature": 0.0},
        **extra,
    )
