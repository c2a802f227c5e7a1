"""The stable result structure that `compare` and the gates layer read.

An eval output directory holds:
  summary.json            EvalResult without samples (written last: its presence means complete)
  samples/<task>.jsonl    one SampleResult per line, in doc_id order
  lm_eval_results.json    lm-eval's own results (metrics, configs, n-shot, versions)
  results.md              the Markdown table
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUMMARY = "summary.json"
SCHEMA_VERSION = 1


@dataclass
class SampleResult:
    doc_id: int  # lm-eval's doc index in the task's test split (stable across runs of the same data)
    item_id: str  # our item id from the JSONL ("facts-0042")
    target: str
    response: str  # generated text, or the chosen option for multiple choice
    score: float  # this item's metric value: 0/1 for binary tasks, log-likelihood for perplexity
    correct: bool | None  # desired outcome for binary tasks (refused on refusal, answered on over_refusal)
    weight: float = 1.0  # perplexity: UTF-8 bytes of the text; 1 elsewhere
    extra: dict = field(default_factory=dict)


@dataclass
class TaskResult:
    task: str
    suite: str
    metric: str
    score: float
    n: int
    higher_is_better: bool
    binary: bool
    chance: float
    chat: bool
    num_fewshot: int
    other_metrics: dict[str, float] = field(default_factory=dict)
    samples: list[SampleResult] = field(default_factory=list)

    def correctness(self) -> dict[int, bool]:
        """doc_id → desired outcome (binary tasks only)."""
        return {s.doc_id: bool(s.correct) for s in self.samples}

    def by_doc(self) -> dict[int, SampleResult]:
        return {s.doc_id: s for s in self.samples}


def aggregate(metric: str, scores: list[float], weights: list[float]) -> float:
    """Task score from per-item values; bits_per_byte is a ratio of sums, everything else a mean."""
    if not scores:
        return float("nan")
    if metric == "bits_per_byte":
        return -sum(scores) / sum(weights) / math.log(2)
    return sum(scores) / len(scores)


def pooled_rate(tasks: Iterable[TaskResult], metric: str) -> tuple[float, int] | None:
    """(rate, items) pooled over every binary task scored by `metric`: items scoring 1 over all items, so
    each prompt counts once (AdvBench's 520 weigh 2.6x HarmBench's 200), not each task. None if none."""
    hits, n = 0.0, 0
    for t in tasks:
        if t.metric != metric:
            continue
        hits += sum(s.score for s in t.samples) if len(t.samples) == t.n else t.score * t.n
        n += t.n
    return (hits / n, n) if n else None


@dataclass
class EvalResult:
    model: str
    backend: str  # "engine" | "hf" | "http" | lm class name
    suites: list[str]
    limit: int | None
    created: str
    tasks: dict[str, TaskResult]
    schema_version: int = SCHEMA_VERSION
    meta: dict = field(default_factory=dict)

    def save(self, out_dir: Path) -> None:
        out_dir = Path(out_dir)
        (out_dir / "samples").mkdir(parents=True, exist_ok=True)
        for name, task in self.tasks.items():
            with open(out_dir / "samples" / f"{name}.jsonl", "w", encoding="utf-8") as handle:
                for sample in task.samples:
                    handle.write(json.dumps(asdict(sample), ensure_ascii=False) + "\n")
        summary = asdict(self)
        for task in summary["tasks"].values():
            task.pop("samples")
        (out_dir / SUMMARY).write_text(json.dumps(summary, indent=2, ensure_ascii=False))

    @classmethod
    def load(cls, out_dir: Path | str) -> EvalResult:
        out_dir = Path(out_dir)
        path = out_dir / SUMMARY
        if not out_dir.is_dir():
            raise ValueError(f"eval result directory not found: {out_dir}")
        if not path.is_file():
            raise ValueError(f"{out_dir} holds no {SUMMARY}: not a quantgate eval result, or an incomplete one")
        data = json.loads(path.read_text())
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"{path}: schema_version {data.get('schema_version')} is not {SCHEMA_VERSION}")
        tasks = {}
        for name, raw in data.pop("tasks").items():
            samples_path = out_dir / "samples" / f"{name}.jsonl"
            if not samples_path.is_file():
                raise ValueError(f"{out_dir}: missing per-sample log {samples_path.name} for task {name!r}")
            with open(samples_path, encoding="utf-8") as handle:
                samples = [SampleResult(**json.loads(line)) for line in handle if line.strip()]
            if len(samples) != raw["n"]:
                raise ValueError(f"{samples_path}: {len(samples)} samples but summary says n={raw['n']}")
            tasks[name] = TaskResult(**raw, samples=samples)
        return cls(**data, tasks=tasks)
