"""Pipeline faults: whatever breaks -- a gate evaluation cut off halfway, an unreachable MLflow store, a task
that raises, a variant directory damaged between runs, a champion whose weights vanished -- `champion`
does not move unless every gate of the release passed and was approved. After each fault the test reads
the alias history back from MLflow and compares it with the history before.

The registry half runs on a temp sqlite store of its own (seconds). The flow half drives
`flows.release.release_flow` on the tiny model under a Prefect test harness; when `tests/test_flows.py`
ran first in the session, its quantizations and measurements are reused from the persisted task cache.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from gates_fixtures import BASELINE, GOOD, POLICY_YAML, make_release
from reliability_fixtures import free_port


def _history(model: str) -> list[tuple]:
    from gates.records.registry import alias_history

    return [(m.seq, m.alias, m.version, m.kind) for m in alias_history(model)]


def _aliases(model: str) -> dict[str, str]:
    from gates.records.registry import aliases

    return aliases(model)


@pytest.fixture
def unreachable_mlflow(monkeypatch):
    """MLflow pointed at a loopback port nobody listens on, HTTP retries off: every call fails fast."""
    def point() -> None:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")

    return point


# ---- the registry ---------------------------------------------------------------------------------------
@pytest.fixture
def store(tmp_path, monkeypatch):
    """A temp sqlite store of this test's own (the flow tests below keep the session's)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("QUANTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("QUANTGATE_USER", "reliability")
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY_YAML)
    return policy


@pytest.fixture
def with_champion(store):
    """A model whose baseline is champion and whose int8 passed its gates and was approved."""
    from gates.records.evaluation import evaluate_run
    from gates.records.registry import record_approval, set_initial_champion
    from gates.records.tracking import register_variant

    model = f"rel-{os.urandom(3).hex()}"
    runs = make_release(model, {"int8": GOOD}, baseline=BASELINE)
    set_initial_champion(model, register_variant(runs["baseline"][0]))
    run_id, version = runs["int8"]
    assert evaluate_run(run_id, str(store)).passed
    record_approval(model, version, by="rm", comment="ok")
    return model, run_id, version


def test_a_gate_evaluation_cut_off_halfway_never_promotes(store, with_champion):
    """A re-evaluation dies after writing some verdicts (its artifact store refuses the report): the run
    says `pending`, and promote refuses even though an approval and an older `pass` are recorded."""
    from gates.records.evaluation import evaluate_run, read_evaluation
    from gates.records.registry import PromotionRefused, check_promotable, promote, record_approval
    from gates.records.tracking import get_client

    model, run_id, version = with_champion
    before, champion = _history(model), _aliases(model)["champion"]
    artifacts = Path(get_client().get_run(run_id).info.artifact_uri.removeprefix("file://"))
    blocker = artifacts / "gates"
    shutil.rmtree(blocker, ignore_errors=True)
    blocker.write_text("not a directory: the evaluation's report cannot be written")
    with pytest.raises(OSError):
        evaluate_run(run_id, str(store))
    assert read_evaluation(run_id).extra["verdict"] == "pending"
    reasons = check_promotable(model, version)
    assert "the gate evaluation was not completed" in reasons
    with pytest.raises(PromotionRefused, match="not completed"):
        promote(model, version)
    record_approval(model, version, by="rm", comment="approving again does not help")
    with pytest.raises(PromotionRefused, match="not completed"):
        promote(model, version)
    assert _history(model) == before and _aliases(model)["champion"] == champion

    # once the evaluation completes and is approved afresh, the same version may go
    blocker.unlink()
    assert evaluate_run(run_id, str(store)).passed
    with pytest.raises(PromotionRefused, match="predates"):
        promote(model, version)
    record_approval(model, version, by="rm", comment="re-reviewed")
    assert promote(model, version).version == version
    assert _aliases(model)["champion"] == version


def test_an_unreachable_mlflow_store_refuses_every_move(store, with_champion, unreachable_mlflow):
    from gates.records.registry import promote, record_approval, rollback, set_challenger

    model, run_id, version = with_champion
    before, aliases_before = _history(model), _aliases(model)
    uri = os.environ["MLFLOW_TRACKING_URI"]
    unreachable_mlflow()
    for move in (lambda: promote(model, version), lambda: rollback(model), lambda: set_challenger(model, version),
                 lambda: record_approval(model, version, by="rm")):
        with pytest.raises(ConnectionError, match="could not read the MLflow registry at http://127.0.0.1"):
            move()  # the store is named as the cause, not the model
    os.environ["MLFLOW_TRACKING_URI"] = uri
    assert _history(model) == before and _aliases(model) == aliases_before


# ---- the release flow -----------------------------------------------------------------------------------
FAST_SUITES = ["facts_mc", "perplexity"]
POLICY = """
version: 1
tasks: {max_drop: 1.0}
safety: {refusal_rate_max_fall: null, over_refusal_rate_max_rise: null}
weights: {min_reduction: null}
serving: {min_decode_speedup: null, max_tpot_p99_s: %s}
canary: {max_error_rate: 0.0, max_tpot_p99_s: 60.0}
"""
OPTIONS = dict(limit=4, suites=FAST_SUITES, canary_requests=8, approve="auto")  # as tests/test_flows.py


@pytest.fixture(scope="module")
def flow_env(tiny_model_dir, tmp_path_factory):
    """A Prefect API, pass/fail policies, and a champion for the tiny model (one release if none yet)."""
    from flows.runtime import prepare

    prepare()
    from prefect.testing.utilities import prefect_test_harness

    from flows.release import model_name, release_flow
    from gates.records.registry import CHAMPION

    d = tmp_path_factory.mktemp("reliability-policies")
    (d / "pass.yaml").write_text(POLICY % "60.0")
    (d / "fail.yaml").write_text(POLICY % "1.0e-6")
    model = model_name(str(tiny_model_dir), tiny_model_dir)
    with prefect_test_harness(server_startup_timeout=120):
        try:
            has_champion = CHAMPION in _aliases(model)
        except ValueError:
            has_champion = False
        if not has_champion:
            release_flow(model=str(tiny_model_dir), policy=str(d / "pass.yaml"), methods=["nf4"], **OPTIONS)
        assert CHAMPION in _aliases(model)
        yield {"model": model, "pass": str(d / "pass.yaml"), "fail": str(d / "fail.yaml")}


def _latest_release_status(model: str) -> str:
    from gates.records.tracking import experiment_name, get_client

    client = get_client()
    exp = client.get_experiment_by_name(experiment_name(model))
    runs = client.search_runs([exp.experiment_id], "tags.`quantgate.kind` = 'release'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.status


def test_flow_with_an_unreachable_mlflow_fails_and_moves_nothing(flow_env, tiny_model_dir, unreachable_mlflow):
    from flows.release import release_flow

    model = flow_env["model"]
    before, aliases_before = _history(model), _aliases(model)
    uri = os.environ["MLFLOW_TRACKING_URI"]
    unreachable_mlflow()
    try:
        with pytest.raises(Exception) as info:  # noqa: PT011
            release_flow(model=str(tiny_model_dir), policy=flow_env["pass"], methods=["nf4"], **OPTIONS)
        assert not isinstance(info.value, AssertionError)
    finally:
        os.environ["MLFLOW_TRACKING_URI"] = uri
    assert _history(model) == before and _aliases(model) == aliases_before


def test_a_task_that_keeps_failing_fails_the_flow_and_moves_nothing(flow_env, tiny_model_dir, tmp_path):
    """The model's weights are truncated (a copy that never finished): quantization raises on every retry,
    the flow fails, its MLflow release run is FAILED, and no alias moves."""
    from flows.release import release_flow

    model = flow_env["model"]
    broken = tmp_path / tiny_model_dir.name  # same directory name: the same registered model
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    before, aliases_before = _history(model), _aliases(model)
    with pytest.raises(Exception) as info:  # noqa: PT011
        release_flow(model=str(broken), policy=flow_env["pass"], methods=["nf4"], **OPTIONS)
    assert not isinstance(info.value, AssertionError)
    assert _history(model) == before and _aliases(model) == aliases_before
    assert _latest_release_status(model) == "FAILED"


def _variant_dir(model_dir: Path, method: str) -> Path:
    """The cached variant of exactly this source (other tests leave variants of other models beside it)."""
    from quantize.variant import quantize

    return quantize(model_dir, method)  # intact and cached: returned without rebuilding


def test_a_variant_damaged_between_runs_is_rebuilt_before_it_is_measured(flow_env, tiny_model_dir):
    """Same size, bytes flipped in the middle of the weights: the next release notices, quantizes again,
    and the registered version points at intact weights. (Its gates fail by policy: nothing may move.)"""
    from flows.release import release_flow
    from serving.model.quant.integrity import verify_variant

    model = flow_env["model"]
    variant = _variant_dir(tiny_model_dir, "nf4")
    weights = next(variant.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle: middle + 64] = bytes(b ^ 0xFF for b in data[middle: middle + 64])
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError):
        verify_variant(variant, full=True)
    before, aliases_before = _history(model), _aliases(model)

    s = release_flow(model=str(tiny_model_dir), policy=flow_env["fail"], methods=["nf4"], **OPTIONS)
    verify_variant(variant, full=True)  # rebuilt whole
    nf4 = s["rows"][1]
    assert nf4["gates_passed"] is False and s["chosen"] is None
    from flows.records import version_source

    verify_variant(version_source(model, nf4["version"]), full=True)
    assert _history(model) == before and _aliases(model) == aliases_before


def test_a_champion_whose_weights_vanished_fails_the_release_and_leaves_no_challenger(flow_env, tiny_model_dir,
                                                                                    tmp_path):
    """The champion's weights vanish between releases; the next release passes its gates but has nothing to
    run its canary against. The flow fails, the champion stays, and no challenger is left behind (if one
    was set before the failure, it was withdrawn)."""
    from flows.records import version_source
    from flows.release import release_flow
    from gates.records.registry import CHALLENGER, CHAMPION

    model = flow_env["model"]
    champion_dir = version_source(model, _aliases(model)[CHAMPION])
    if not champion_dir.resolve().is_relative_to((Path(os.environ["QUANTGATE_HOME"]) / "variants").resolve()):
        pytest.skip(f"the champion is not a variant directory ({champion_dir}); nothing to take away safely")
    method = "fp4" if champion_dir.name.endswith("-nf4") else "nf4"  # a challenger with weights of its own
    before, aliases_before = _history(model), _aliases(model)
    moved = tmp_path / "champion-weights"
    shutil.move(champion_dir, moved)
    try:
        with pytest.raises(Exception, match="holds no model"):  # noqa: PT011
            release_flow(model=str(tiny_model_dir), policy=flow_env["pass"], methods=[method], **OPTIONS)
    finally:
        shutil.move(moved, champion_dir)
    assert _aliases(model) == aliases_before and CHALLENGER not in _aliases(model)
    after = _history(model)
    assert after[: len(before)] == before
    moves = [(alias, kind) for _, alias, _, kind in after[len(before):]]
    assert moves in ([], [(CHALLENGER, "challenger"), (CHALLENGER, "clear")])  # the champion never moved
    assert _latest_release_status(model) == "FAILED"
