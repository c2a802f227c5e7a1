"""What a reviewer clicks through in the MLflow UI, derived from what the store already holds.

- `flips.json` (an MLflow table, `log_table`) on each variant run: every item that went right→wrong or
  wrong→right against the baseline, with both outputs (from the run's `evidence/compare.json`).
- Dataset inputs (`mlflow.data` + `log_inputs`, context `eval`) on every run of a release: one dataset
  per eval task, the items it was scored on (doc id, item id, target), its source the task's data file.

Both read the runs' evidence back from the tracking store (a server's too), never the worker's disk.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from gates.metric_names import EVIDENCE_DIR
from gates.records.tracking import BASELINE, TAG_ROLE, TAG_VARIANT

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

FLIPS_TABLE = "flips.json"
FLIP_COLUMNS = ("task", "direction", "item_id", "doc_id", "target", "baseline_response", "variant_response")
DATASET_CONTEXT = "eval"


def flip_rows(comparison: dict) -> list[dict]:
    """One row per flipped item of a `compare.json` (evals.compare.Comparison.to_json())."""
    rows = []
    for task in comparison.get("rows", []):
        for direction, key in (("right→wrong", "lost"), ("wrong→right", "gained")):
            for flip in task.get(key, []):
                rows.append({"task": task["task"], "direction": direction, "item_id": flip["item_id"],
                             "doc_id": flip["doc_id"], "target": flip["target"],
                             "baseline_response": flip["baseline_response"],
                             "variant_response": flip["variant_response"]})
    return rows


def log_flips_table(client: MlflowClient, run_id: str, comparison: dict) -> int:
    """Log the flips as the run's `flips.json` table (columns present even when nothing flipped)."""
    rows = flip_rows(comparison)
    client.log_table(run_id, {c: [r[c] for r in rows] for c in FLIP_COLUMNS}, FLIPS_TABLE)
    return len(rows)


def _task_sources(suite_dir: Path) -> dict[str, str]:
    """Task name -> the data file lm-eval read its test items from (its own results record the config)."""
    try:
        configs = json.loads((suite_dir / "lm_eval_results.json").read_text()).get("configs", {})
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    sources = {}
    for task, config in configs.items():
        files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
        split = config.get("test_split") or "test"
        chosen = files.get(split) if isinstance(files, dict) else files
        if isinstance(chosen, list):
            chosen = chosen[0] if chosen else None
        sources[task] = str(chosen or config.get("dataset_path") or task)
    return sources


def eval_datasets(evidence: Path) -> list:
    """mlflow.data datasets, one per task, from a run's downloaded `evidence/<suite>/samples/*.jsonl`."""
    import warnings

    import mlflow.data
    import pandas as pd

    datasets = []
    with warnings.catch_warnings():  # MLflow's hints about ambiguous local sources and integer columns
        warnings.simplefilter("ignore", UserWarning)
        for samples in sorted(evidence.glob("*/samples/*.jsonl")):
            datasets.append(_task_dataset(samples, mlflow.data, pd))
    return datasets


def _task_dataset(samples: Path, data, pd):
    suite_dir = samples.parent.parent
    items = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    frame = pd.DataFrame({"doc_id": [i["doc_id"] for i in items], "item_id": [i["item_id"] for i in items],
                          "target": [str(i["target"]) for i in items]})
    source = _task_sources(suite_dir).get(samples.stem, f"{suite_dir.name}/{samples.stem}")
    return data.from_pandas(frame, source=source, name=samples.stem, targets="target")


def log_eval_datasets(client: MlflowClient, run_id: str, evidence: Path) -> int:
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    inputs = [DatasetInput(d._to_mlflow_entity(), [InputTag(MLFLOW_DATASET_CONTEXT, DATASET_CONTEXT)])
              for d in eval_datasets(evidence)]
    if inputs:
        client.log_inputs(run_id, datasets=inputs)
    return len(inputs)


def log_release_lineage(client: MlflowClient, runs: list[Run]) -> dict[str, dict[str, int]]:
    """Flips tables on the variant runs and dataset inputs on every run; returns counts per variant."""
    from mlflow.exceptions import MlflowException

    counts: dict[str, dict[str, int]] = {}
    for run in runs:
        run_id = run.info.run_id
        with tempfile.TemporaryDirectory(prefix="quantgate-lineage-") as tmp:
            try:
                local = Path(client.download_artifacts(run_id, EVIDENCE_DIR, tmp))
            except (MlflowException, OSError):
                continue  # a run without evidence (recorded by hand, or by an older quantgate)
            row = {"datasets": log_eval_datasets(client, run_id, local)}
            compare = local / "compare.json"
            if run.data.tags.get(TAG_ROLE) != BASELINE and compare.is_file():
                row["flips"] = log_flips_table(client, run_id, json.loads(compare.read_text()))
        counts[run.data.tags.get(TAG_VARIANT, run.info.run_name)] = row
    return counts
