"""gates.records.lineage on a real, temporary MLflow sqlite store: the flips table and the eval datasets of a release,
derived from the evidence the runs hold; the experiment kind the UI reads; grant_path for PostgreSQL."""

from __future__ import annotations

import json
import os
import pwd
import stat
from pathlib import Path

import pytest

COMPARE = {"rows": [
    {"task": "arith", "lost": [{"doc_id": 3, "item_id": "arith-0003", "target": "12", "baseline_response": "12",
                                "variant_response": "13"}],
     "gained": [{"doc_id": 5, "item_id": "arith-0005", "target": "7", "baseline_response": "8",
                 "variant_response": "7"}]},
    {"task": "perplexity", "lost": [], "gained": []},
]}



def _evidence(root: Path, with_compare: bool) -> list[Path]:
    suite = root / "accuracy"
    (suite / "samples").mkdir(parents=True)
    items = [{"doc_id": i, "item_id": f"arith-{i:04d}", "target": str(i * 2), "response": "x", "score": 0.0,
              "correct": False} for i in range(6)]
    (suite / "samples" / "arith.jsonl").write_text("\n".join(json.dumps(i) for i in items) + "\n")
    config = {"arith": {"dataset_kwargs": {"data_files": {"test": "/data/arith.jsonl"}}, "test_split": "test"}}
    (suite / "lm_eval_results.json").write_text(json.dumps({"configs": config}))
    paths = [suite]
    if with_compare:
        (root / "compare.json").write_text(json.dumps(COMPARE))
        paths.append(root / "compare.json")
    return paths


def test_flip_rows_name_every_flipped_item_with_both_outputs():
    from gates.records.lineage import flip_rows

    rows = flip_rows(COMPARE)
    assert [(r["task"], r["direction"], r["item_id"]) for r in rows] == [
        ("arith", "right→wrong", "arith-0003"), ("arith", "wrong→right", "arith-0005")]
    assert (rows[0]["baseline_response"], rows[0]["variant_response"]) == ("12", "13")


def test_release_lineage_logs_flips_table_and_dataset_inputs(store, tmp_path):
    from gates.records.comparison import log_release_comparison
    from gates.records.tracking import (
        EXPERIMENT_KIND,
        EXPERIMENT_KIND_TAG,
        get_client,
        log_variant,
        start_release,
    )

    release = start_release("lin-model", "sha256:abc", {})
    base = log_variant(release, "baseline", {"method": "none"}, {"task/arith/score": 0.5},
                       artifacts=_evidence(tmp_path / "b", with_compare=False))
    var = log_variant(release, "int8", {"method": "int8"}, {"task/arith/score": 0.5, "task/arith/delta": 0.0},
                      artifacts=_evidence(tmp_path / "v", with_compare=True))
    log_release_comparison(release)
    client = get_client()
    table = json.loads(Path(client.download_artifacts(var, "flips.json", str(tmp_path / "dl"))).read_text())
    assert table["columns"][:3] == ["task", "direction", "item_id"]
    assert [row[2] for row in table["data"]] == ["arith-0003", "arith-0005"]
    assert "flips.json" not in {f.path for f in client.list_artifacts(base)}  # the baseline has nothing to flip
    for run_id in (base, var):
        (dataset,) = client.get_run(run_id).inputs.dataset_inputs
        assert dataset.dataset.name == "arith" and "/data/arith.jsonl" in dataset.dataset.source
        assert {(t.key, t.value) for t in dataset.tags} == {("mlflow.data.context", "eval")}
        assert json.loads(dataset.dataset.profile)["num_rows"] == 6
    experiment = client.get_experiment(client.get_run(var).info.experiment_id)
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to judge another user's access")
def test_grant_path_opens_our_folders_and_names_the_one_above():
    import shutil
    import tempfile

    from quantgate.postgres import grant_path

    tmp_path = Path(tempfile.mkdtemp(prefix="quantgate-grant-"))  # under /tmp: pytest's own root is 0700
    try:
        _check_grant_path(tmp_path, grant_path)
    finally:
        shutil.rmtree(tmp_path)


def _check_grant_path(tmp_path: Path, grant_path) -> None:
    user = pwd.getpwnam("nobody")
    home = tmp_path / "home"
    data = home / "services" / "pg"
    data.mkdir(parents=True)
    for folder in (tmp_path, home):
        folder.chmod(0o700)
    with pytest.raises(RuntimeError, match=f"cannot enter {tmp_path}"):
        grant_path(data, home, user)  # above QUANTGATE_HOME: named, left as it is
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700
    tmp_path.chmod(0o711)
    assert home in grant_path(data, home, user)
    assert home.stat().st_mode & stat.S_IXOTH and not home.stat().st_mode & stat.S_IROTH
