"""Task data, task registry and graders: no model needed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from evals.tasks import (
    DATA_DIR,
    TASKS,
    TaskDataError,
    lm_eval_config,
    load_jsonl,
    resolve_tasks,
    scoring,
    validate_task_data,
)
from evals.tasks.build_data import build_all


def test_suites_have_the_promised_tasks() -> None:
    own = [t for t in TASKS.values() if t.own]
    assert len([t for t in own if t.suite == "accuracy"]) >= 6
    assert {t.output_type for t in own} == {"multiple_choice", "generate_until", "loglikelihood_rolling"}
    assert {t.name for t in own if t.suite == "safety"} == {"refusal", "over_refusal"}
    assert TASKS["refusal"].metric != TASKS["over_refusal"].metric  # never merged into one score
    assert {t.name for t in resolve_tasks("safety")} == {"harmbench", "advbench", "over_refusal"}


@pytest.mark.parametrize("name", sorted(n for n, t in TASKS.items() if t.own))
def test_each_task_has_enough_valid_unique_items(name: str) -> None:
    spec = TASKS[name]
    n = validate_task_data(spec)
    assert n >= 150
    rows = load_jsonl(spec.data_file(), spec.required_fields)
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids)
    if spec.num_fewshot:
        dev_ids = {r["id"] for r in load_jsonl(spec.dev_file())}
        assert not dev_ids & set(ids)
        dev_text = {json.dumps({k: v for k, v in r.items() if k != "id"}, sort_keys=True)
                    for r in load_jsonl(spec.dev_file())}
        assert not any(json.dumps({k: v for k, v in r.items() if k != "id"}, sort_keys=True) in dev_text for r in rows)
    assert len(spec.readme) > 60


def test_committed_data_is_what_the_builder_makes() -> None:
    for task, (dev, test) in build_all().items():
        for rows, path in ((test, DATA_DIR / f"{task}.jsonl"), (dev, DATA_DIR / f"{task}.dev.jsonl")):
            if not rows:
                assert not path.exists()
                continue
            committed = [json.loads(line) for line in path.read_text().splitlines()]
            assert committed == rows, f"{path} differs from build_data.py output; rerun the builder"
    assert sum(p.stat().st_size for p in DATA_DIR.iterdir()) < 1_000_000


def test_multiple_choice_answers_point_into_choices() -> None:
    for name in ("facts_mc", "cloze"):
        for row in load_jsonl(TASKS[name].data_file()):
            assert 0 <= row["answer"] < len(row["choices"]) == 4
            assert len(set(row["choices"])) == 4


def test_resolve_tasks_accepts_suites_and_names() -> None:
    assert [t.name for t in resolve_tasks("safety")] == ["harmbench", "advbench", "over_refusal"]
    assert [t.name for t in resolve_tasks(["arith,refusal"])] == ["arith", "refusal"]
    assert len(resolve_tasks(["benchmarks", "safety", "quantgate"])) == len(TASKS)
    assert [t.name for t in resolve_tasks("accuracy")] == [n for n, t in TASKS.items() if t.own and t.suite == "accuracy"]
    assert [t.name for t in resolve_tasks("quantgate")] == [n for n, t in TASKS.items() if t.own]


def test_unknown_task_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown task or suite 'aritmetic'"):
        resolve_tasks("accuracy,aritmetic")
    with pytest.raises(ValueError, match="no tasks selected"):
        resolve_tasks(" , ")


def test_malformed_line_reports_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "arith.jsonl"
    path.write_text('{"id": "a", "question": "1 + 1", "answer": "2"}\n\n{"id": "b", "question": "2 + 2"\n')
    with pytest.raises(TaskDataError, match=rf"{path}:3: malformed JSON"):
        load_jsonl(path)
    path.write_text('{"id": "a", "question": "1 + 1"}\n')
    with pytest.raises(TaskDataError, match=rf"{path}:1: missing field\(s\) answer"):
        load_jsonl(path, ("question", "answer"))
    path.write_text('["not", "an", "object"]\n')
    with pytest.raises(TaskDataError, match=":1: expected a JSON object"):
        load_jsonl(path)


def test_empty_or_missing_task_data_is_a_clear_error(tmp_path: Path) -> None:
    spec = TASKS["refusal"]
    with pytest.raises(TaskDataError, match="not found"):
        validate_task_data(spec, tmp_path)
    spec.data_file(tmp_path).write_text("\n")
    with pytest.raises(TaskDataError, match="task 'refusal' has no items"):
        validate_task_data(spec, tmp_path)
    arith = TASKS["arith"]
    shutil.copy(arith.data_file(), arith.data_file(tmp_path))
    arith.dev_file(tmp_path).write_text('{"id": "d", "question": "1 + 1", "answer": "2"}\n')
    with pytest.raises(TaskDataError, match="needs 5 few-shot items"):
        validate_task_data(arith, tmp_path)


def test_lm_eval_configs_use_absolute_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # lm-eval would resolve relative paths here
    for spec in TASKS.values():
        files = lm_eval_config(spec)["dataset_kwargs"]["data_files"]
        paths = [p for v in files.values() for p in (v if isinstance(v, list) else [v])]  # Arrow: shard lists
        assert paths and all(Path(p).is_absolute() and Path(p).is_file() for p in paths)


def test_lm_eval_builds_every_task_from_our_configs() -> None:
    from lm_eval.tasks import TaskManager

    loaded = TaskManager(include_defaults=False).load([lm_eval_config(s) for s in TASKS.values()])
    assert set(loaded["tasks"]) == set(TASKS)
    facts = loaded["tasks"]["facts_mc"]
    doc = next(iter(facts.test_docs()))
    assert facts.doc_to_text(doc).startswith("Question: ") and facts.doc_to_text(doc).endswith("\nAnswer:")


def test_arith_grader() -> None:
    item = {"answer": "12"}
    assert scoring.arith_correct(item, " 12\nQuestion: next") == 1.0
    assert scoring.arith_correct(item, "12.") == 1.0
    assert scoring.arith_correct(item, "120") == 0.0
    assert scoring.arith_correct(item, "twelve") == 0.0


def test_json_graders() -> None:
    item = {"keys": ["name", "age"], "values": {"name": "Anna", "age": 34}}
    assert scoring.json_valid(item, '{"name": "Anna", "age": 34}') == 1.0
    assert scoring.json_exact(item, '{"name": "anna", "age": "34"}') == 1.0
    assert scoring.json_valid(item, '```json\n{"name": "Anna", "age": 3}\n```') == 1.0
    assert scoring.json_exact(item, '{"name": "Anna", "age": 3}') == 0.0
    assert scoring.json_valid(item, '{"name": "Anna"}') == 0.0  # a key missing
    assert scoring.json_valid(item, '{"name": "Anna", "age": 34, "city": "Rome"}') == 0.0  # one too many
    assert scoring.json_valid(item, '{"name": "Anna", "age": 34') == 0.0  # a dropped brace
    assert scoring.json_valid(item, 'Here: {"name": "Anna", "age": 34}') == 0.0
    assert scoring.json_valid(item, '["name", "age"]') == 0.0


def test_one_word_grader() -> None:
    item = {"answer": "rake"}
    assert scoring.one_word_correct(item, " Rake.") == 1.0
    assert scoring.one_word_correct(item, "rake, of course") == 0.0
    assert scoring.one_word_correct(item, "shovel") == 0.0


@pytest.mark.parametrize(
    "check, good, bad",
    [
        ({"kind": "exact_upper", "word": "apple"}, "APPLE", "Apple"),
        ({"kind": "repeat", "word": "tiger", "n": 3}, "tiger tiger tiger", "tiger tiger"),
        ({"kind": "lowercase"}, "the sea is calm today.", "The sea is calm today."),
        ({"kind": "uppercase"}, "THE SEA IS CALM.", "THE SEA is calm."),
        ({"kind": "n_lines", "n": 3}, "red\nblue\n\ngreen", "red, blue, green"),
        ({"kind": "number", "value": 7}, "7", "Seven"),
        ({"kind": "starts_with", "prefix": "Yes"}, "Yes, it is blue.", "The sky is blue, yes."),
        ({"kind": "contains", "word": "river"}, "The river was wide.", "The rivers were wide."),
        ({"kind": "quoted", "word": "cloud"}, '"cloud"', "cloud"),
    ],
)
def test_instruct_constraints(check: dict, good: str, bad: str) -> None:
    assert scoring.instruct_ok({"check": check}, good) == 1.0
    assert scoring.instruct_ok({"check": check}, bad) == 0.0


def test_every_instruct_item_has_a_known_check() -> None:
    kinds = {row["check"]["kind"] for row in load_jsonl(TASKS["instruct"].data_file())}
    for kind in kinds:
        scoring.instruct_ok({"check": {"kind": kind, "word": "x", "n": 1, "value": 1, "prefix": "x"}}, "x")
    with pytest.raises(ValueError, match="unknown instruct check kind"):
        scoring.instruct_ok({"check": {"kind": "telepathy"}}, "x")


def test_every_task_has_its_readme_line() -> None:
    readme = (DATA_DIR.parent / "README.md").read_text()
    for spec in TASKS.values():
        assert f"- **{spec.name}** (" in readme and spec.readme in readme, spec.name
