"""What one eval task is: its prompts, target, grading, data file and suites (a plain dataclass)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
