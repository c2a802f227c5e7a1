"""flows/tune.py: `quantgate tune` on the tiny random Llama through the release's own stages (real Prefect API
from the test harness, real MLflow sqlite store, real engine), with the candidate list restricted.

The crafted policy: a fidelity gate (KL vs the baseline on the held text) at a level int8wo meets and int4
at group 32 does not on this random model (KL 0.00008 vs 0.0033 at 4 chunks of 32 tokens); everything else
loose. The whole file takes ~4 min on a loaded 2-core machine, most of it the Prefect harness and the first
tune's measurements (later tests take them from the cache).
"""

from __future__ import annotations

import argparse
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from flows.runtime import prepare

prepare()

SUITES = ["facts_mc", "perplexity"]  # loglikelihood tasks: seconds on the tiny model
LIMIT = 4
CANDIDATES = ["int8wo", "int4_rtn_g32", "int4_rtn_g128"]  # given out of order on purpose
POLICY = """
version: 1
tasks: {max_drop: 1.0}
safety: {refusal_rate_max_fall: null, over_refusal_rate_max_rise: null}
weights: {min_reduction: null}
serving: {min_decode_speedup: null, max_tpot_p99_s: 60.0, decode_batches: [1]}
fidelity: {max_kl: %s, chunks: 4, chunk_tokens: 32}
canary: {max_error_rate: 0.0, max_tpot_p99_s: 60.0}
"""


@pytest.fixture(scope="module")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("tune-policies")
    (d / "kl.yaml").write_text(POLICY % "0.001")  # measured here: int4 g32 KL 0.0033 [0.0029, 0.0040], int8wo 0.00008
    (d / "loose.yaml").write_text(POLICY % "100.0")
    return {name: str(d / f"{name}.yaml") for name in ("kl", "loose")}


def _tune(model: Path, policy: str, **kw) -> dict:
    from flows.tune import tune_flow

    options = dict(candidates=CANDIDATES, limit=LIMIT, suites=SUITES)
    options.update(kw)
    return tune_flow(model=str(model), policy=policy, **options)


def _task_states(flow_run_id: str) -> list[tuple[str, str]]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(flow_run_id)])))
    return [(t.name.rsplit("-", 1)[0], t.state.name) for t in runs]


@pytest.fixture(scope="module")
def first_tune(prefect_api, tiny_model_dir, policies) -> dict:
    return _tune(tiny_model_dir, policies["kl"])


# ---- candidates ---------------------------------------------------------------------------------------


def test_candidates_are_ordered_by_size_and_non_dividing_groups_refused(tiny_model_dir):
    from flows import recipes

    config = json.loads((tiny_model_dir / "config.json").read_text())  # widths 64 and 128
    cands, refused = recipes.candidates(config)
    assert [c.name for c in cands] == [
        "int4_rtn_g64+kv8", "int4_awq_g64+kv8", "int4_gptq_g64+kv8", "int4_rtn_g64", "int4_awq_g64", "int4_gptq_g64",
        "int4_rtn_g32+kv8", "int4_awq_g32+kv8", "int4_gptq_g32+kv8", "int4_rtn_g32", "int4_awq_g32", "int4_gptq_g32",
        "int8wo+kv8", "int8wo",
    ]
    sizes = [(c.weight_bytes, c.kv_bytes_per_token) for c in cands]
    assert sizes == sorted(sizes) and sizes[0][0] < sizes[6][0] < sizes[-1][0]
    assert sorted(r.name for r in refused) == sorted(f"int4_{a}_g128{kv}" for a in ("rtn", "awq", "gptq")
                                                     for kv in ("", "+kv8"))
    assert all("group size 128 does not divide" in r.reason and "[64, 32]" in r.reason for r in refused)
    # the default model's 576-wide layers: 128 refused, 64 (576 = 9 x 64) and 32 kept
    wide = {**config, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "head_dim": 64}
    assert {c.recipe.group_size for c in recipes.candidates(wide)[0]} == {64, 32, None}
    assert recipes.parse("int4_awq_g64") == recipes.Recipe("int4_awq_g64", "int4-awq", {"group_size": 64})
    assert recipes.parse("int8wo").method == "int8wo"
    with pytest.raises(ValueError, match="unknown quantization method"):
        recipes.parse("int4_foo_g64")


def test_confirmations_are_bounded_by_the_items_a_task_has(tiny_model_dir):
    from types import SimpleNamespace

    from flows.tune import fidelity_splits, max_confirmations, split_items

    assert max_confirmations(235, 75) == 2 and max_confirmations(151, 75) == 1 and max_confirmations(149, 75) == 0
    assert max_confirmations(None, 40) == 1
    assert split_items(SUITES) >= 151  # facts_mc 235, perplexity's windows: our own tasks hold 151-235 items
    small = fidelity_splits(str(tiny_model_dir), SimpleNamespace(fidelity_chunks=4, fidelity_chunk_tokens=32))
    large = fidelity_splits(str(tiny_model_dir), SimpleNamespace(fidelity_chunks=64, fidelity_chunk_tokens=128))
    assert small > large >= 0  # the held text's windows bound the splits too
    assert fidelity_splits(str(tiny_model_dir), SimpleNamespace(fidelity_chunks=0, fidelity_chunk_tokens=32)) is None


@dataclass(frozen=True)
class MeasureConfigStub:
    split: int = 0


def _fake_search(monkeypatch, available: int, held_out_passes: set[str]) -> tuple[str | None, dict, list]:
    """flows.tune._search over three candidates that all pass the search split, the release's stages faked:
    each confirmation passes only for the candidates in `held_out_passes`."""
    from types import SimpleNamespace

    from flows import release, tune
    from flows import tune_report as T

    @dataclass(frozen=True)
    class Plan:
        seed: int = 0

    splits_measured, runs = [], iter(f"held-{i}" for i in range(1, 10))
    monkeypatch.setattr(release, "start_release", lambda source, cfg: next(runs))
    monkeypatch.setattr(tune.records, "tag_release", lambda run_id, tags: None)
    monkeypatch.setattr(release, "_measure", lambda v, config, fresh: splits_measured.append(config.split) or "base")
    monkeypatch.setattr(release, "record", lambda *a, **k: ("r", None))
    monkeypatch.setattr(tune, "_variant", lambda source, name, fresh: SimpleNamespace(name=name))
    monkeypatch.setattr(tune, "_baseline", lambda source: "baseline")

    def judge(parent, source, v, base, config, plan, policy, fresh):
        if parent == "tune":
            return f"search-{v.name}", 5, {}, 1.0
        assert plan.seed == config.split  # fresh speed rounds per split
        return f"{parent}-{v.name}", 5, ({} if v.name in held_out_passes else {"g": "crafted"}), 1.0

    monkeypatch.setattr(tune, "_judge", judge)
    names = ["a", "b", "c"]
    rows = {n: T.CandidateRow(n, "m", "auto", 1) for n in names}
    held = tune._HeldOut("tune", None, MeasureConfigStub(), {}, False, available)
    ctx = {"tune_id": "tune", "base": "base", "config": None, "plan": Plan(), "policy": None, "fresh": False,
           "held": held}
    chosen = tune._search(None, [SimpleNamespace(name=n, weight_bytes=1) for n in names], rows, ctx)
    return chosen, rows, splits_measured


def test_each_confirmation_takes_an_unused_split_and_none_left_is_unconfirmed(monkeypatch):
    from flows import tune_report as T

    chosen, rows, splits = _fake_search(monkeypatch, 2, {"b", "c"})
    assert chosen == "b" and splits == [1, 2]  # a failed on split 1; b confirmed on split 2, not on split 1 again
    assert rows["a"].status == T.HELD_OUT_FAILED and rows["a"].held_out_split == 1
    assert rows["b"].status == T.CHOSEN and rows["b"].held_out_split == 2 and rows["b"].held_out_run_id == "held-2-b"
    assert rows["c"].status == T.NOT_TRIED

    chosen, rows, splits = _fake_search(monkeypatch, 1, {"b", "c"})
    assert chosen is None and splits == [1]  # b and c passed the search split, but no unused split is left
    assert rows["a"].status == T.HELD_OUT_FAILED
    assert rows["b"].status == rows["c"].status == T.UNCONFIRMED and rows["b"].held_out_run_id == ""
    assert "held-out split(s)" in rows["b"].reason
    assert "UNCONFIRMED" in T._status(vars(rows["b"]))


def test_bad_options_fail_before_anything_runs(policies):
    from flows.tune import MAX_SPLIT_LIMIT, check_options

    with pytest.raises(ValueError, match="limit"):
        check_options(None, "smallest", MAX_SPLIT_LIMIT + 1, policies["kl"], SUITES)
    with pytest.raises(ValueError, match="objective"):
        check_options(None, "cheapest", 4, policies["kl"], SUITES)
    with pytest.raises(ValueError, match="unknown quantization method"):
        check_options(["int4_rtn_g32", "int9"], "smallest", 4, policies["kl"], SUITES)
    with pytest.raises(ValueError, match="empty"):
        check_options([], "smallest", 4, policies["kl"], SUITES)


def test_held_out_split_is_disjoint_from_the_search_split(tiny_model_dir):
    from dataclasses import replace

    from transformers import AutoTokenizer

    from evals import fidelity as F
    from flows.data import MeasureConfig

    search = MeasureConfig(suites=tuple(SUITES), limit=LIMIT, fidelity_chunks=4, fidelity_chunk_tokens=32)
    held = replace(search, split=1)
    assert search.eval_docs() is None  # split 0 is lm-eval's limit: the first LIMIT items, as the release
    assert held.eval_docs() == range(LIMIT, 2 * LIMIT)
    assert search.key() != held.key()
    assert search.key() == MeasureConfig(suites=tuple(SUITES), limit=LIMIT, fidelity_chunks=4,
                                         fidelity_chunk_tokens=32).key()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    a = F.held_chunks(tok, F.FidelityPlan(chunks=4, chunk_tokens=32))
    b = F.held_chunks(tok, F.FidelityPlan(chunks=4, chunk_tokens=32, first_chunk=4))
    assert a[1:] and not {tuple(c[1:]) for c in a} & {tuple(c[1:]) for c in b}
    assert F.held_chunks(tok, F.FidelityPlan(chunks=8, chunk_tokens=32)) == a + b  # the next windows


# ---- the flow -----------------------------------------------------------------------------------------


def test_tune_stops_at_int8wo_when_int4_fails_and_reports_every_candidate(first_tune):
    from gates.records.evaluation import read_evaluation
    from gates.records.tracking import get_client, get_run, release_children

    r = first_tune
    rows = {row["name"]: row for row in r["rows"]}
    assert [row["name"] for row in r["rows"]] == ["int4_rtn_g32", "int8wo", "int4_rtn_g128"]  # by size, then refused
    assert rows["int4_rtn_g128"]["status"] == "refused" and "does not divide" in rows["int4_rtn_g128"]["reason"]
    int4 = rows["int4_rtn_g32"]
    assert int4["status"] == "failed" and list(int4["gates_failed"]) == ["fidelity/kl/max"]
    assert "0.001" in int4["gates_failed"]["fidelity/kl/max"]
    assert r["chosen"] == "int8wo" and rows["int8wo"]["status"] == "chosen"
    assert rows["int8wo"]["held_out_gates_failed"] == {} and rows["int8wo"]["held_out_run_id"]
    # MLflow: one parent, a child per measured candidate with its verdicts; the held-out runs nested in it
    client = get_client()
    parent = get_run(r["tune_run_id"], client)
    assert parent.info.status == "FINISHED" and parent.data.tags["quantgate.tune"] == "search"
    assert parent.data.tags["tune.chosen"] == "int8wo"
    children = {c.data.tags["quantgate.variant"] for c in release_children(r["tune_run_id"], client)}
    assert children == {"baseline", "int4_rtn_g32", "int8wo"}
    assert not read_evaluation(int4["run_id"], "release").passed
    assert read_evaluation(rows["int8wo"]["run_id"], "release").passed
    held = get_run(r["held_out_run_id"], client)
    assert held.data.tags["mlflow.parentRunId"] == r["tune_run_id"] and held.data.tags["quantgate.tune"] == "held-out"
    assert read_evaluation(rows["int8wo"]["held_out_run_id"], "release").passed
    assert get_run(rows["int8wo"]["held_out_run_id"], client).data.metrics["task/facts_mc/n"] == LIMIT
    saved = json.loads(Path(r["file"]).read_text())
    assert saved["chosen"] == "int8wo" and saved["rows"] == r["rows"]


def test_held_out_items_are_the_next_items_of_each_task(first_tune):
    from evals.results import EvalResult
    from flows.runtime import work_dir

    by_split: dict[bool, set[str]] = {False: set(), True: set()}
    for d in work_dir("measure").iterdir():
        for suite in SUITES:
            if (d / "evals" / suite).is_dir():
                task = EvalResult.load(d / "evals" / suite).tasks[suite]
                by_split[min(s.doc_id for s in task.samples) >= LIMIT].update(
                    f"{suite}:{s.doc_id}" for s in task.samples)
    assert by_split[False] and by_split[True] and not by_split[False] & by_split[True]


def test_a_second_run_is_served_from_the_cache(first_tune, tiny_model_dir, policies):
    from flows.runtime import work_dir

    variants = [Path(p) for p in (Path(first_tune["file"]).parents[2] / "variants").glob("*")
                if (Path(p) / "quantgate.json").is_file()]
    stamps = {p: (p / "quantgate.json").stat().st_mtime_ns for p in variants}
    measured = sorted(p.name for p in work_dir("measure").iterdir())
    again = _tune(tiny_model_dir, policies["kl"])
    assert again["chosen"] == "int8wo" and again["tune_run_id"] != first_tune["tune_run_id"]
    assert [row["status"] for row in again["rows"]] == [row["status"] for row in first_tune["rows"]]
    states = _task_states(_flow_run_of(again))
    costly = [(name, state) for name, state in states if name in ("quantize", "measure", "measure-speed")]
    assert costly and all(state == "Cached" for _, state in costly), costly
    assert {p: (p / "quantgate.json").stat().st_mtime_ns for p in variants} == stamps  # nothing rebuilt
    assert sorted(p.name for p in work_dir("measure").iterdir()) == measured  # nothing measured anew


def _flow_run_of(result: dict) -> str:
    from gates.records.tracking import get_run

    return get_run(result["tune_run_id"]).data.params["prefect_flow_run_id"]


def test_a_held_out_failure_moves_on_to_the_next_candidate(first_tune, tiny_model_dir, policies, monkeypatch):
    """Loose policy: int4_rtn_g32 passes the search items; its held-out confirmation is made to fail (a crafted
    verdict on the real records), so the search goes on and int8wo is chosen."""
    from dataclasses import replace

    from flows import release
    from flows.tune_report import render
    from gates.judging.verdicts import GateResult
    from gates.records.tracking import get_run

    real = release.evaluate_gates.fn

    def crafted(run_id: str, policy: str | None, stage_name: str = "release"):
        ev = real(run_id, policy, stage_name)
        run = get_run(run_id)
        parent = get_run(run.data.tags["quantgate.release_run_id"])
        if parent.data.tags.get("quantgate.tune") == "held-out" and run.data.tags["quantgate.variant"] == "int4_rtn_g32":
            bad = GateResult("fidelity/kl/max", "release", "KL CI high <= max", 0.0, 1.0, False, "crafted: +1 > +0")
            return replace(ev, results=[*ev.results, bad])
        return ev

    monkeypatch.setattr(release, "evaluate_gates", crafted)
    r = _tune(tiny_model_dir, policies["loose"])
    rows = {row["name"]: row for row in r["rows"]}
    assert rows["int4_rtn_g32"]["status"] == "held-out failed"
    assert rows["int4_rtn_g32"]["gates_failed"] == {}
    assert list(rows["int4_rtn_g32"]["held_out_gates_failed"]) == ["fidelity/kl/max"]
    assert r["chosen"] == "int8wo" and rows["int8wo"]["status"] == "chosen"
    assert "failed on the held-out items: fidelity/kl/max (crafted" in render(r)


def test_release_takes_the_recipe_tune_chose(first_tune, tiny_model_dir, tmp_path):
    from flows.tune_cli import from_tune
    from flows.tune_report import chosen_recipe

    defaults = argparse.Namespace(model="smollm2-135m", suites="accuracy,safety", limit=None, policy=None,
                                  approve="auto")
    _, model, methods = from_tune(defaults, first_tune["file"])
    assert (model, methods) == (str(tiny_model_dir), ["int8wo"])
    tuned_file = tmp_path / "tuned.json"  # the module's tunes rewrite first_tune's file: a file of its own
    tuned_file.write_text(json.dumps({**first_tune, "suites": ["facts_mc", "arc_easy"], "limit": 7,
                                      "policy": "/policies/tuned.yaml"}))
    tuned, _, _ = from_tune(defaults, str(tuned_file))  # gated again on the items tune searched on
    assert (tuned.suites, tuned.limit, tuned.policy) == ("facts_mc,arc_easy", 7, "/policies/tuned.yaml")
    mine = argparse.Namespace(**{**vars(defaults), "policy": "mine.yaml"})
    assert from_tune(mine, str(tuned_file))[0].policy == "mine.yaml"
    assert defaults.suites == "accuracy,safety"  # the caller's args are left as they were
    with pytest.raises(ValueError, match="was tuned for"):
        from_tune(argparse.Namespace(**{**vars(defaults), "model": "some-other-model"}), first_tune["file"])
    nothing = tmp_path / "nothing.json"
    nothing.write_text(json.dumps({**first_tune, "chosen": None, "outcome": "no candidate passed"}))
    with pytest.raises(ValueError, match="chose nothing"):
        chosen_recipe(nothing)
    no_suites = tmp_path / "no_suites.json"
    no_suites.write_text(json.dumps({**first_tune, "suites": []}))
    with pytest.raises(ValueError, match="are not a tune's"):
        chosen_recipe(no_suites)
    not_tune = tmp_path / "not_tune.json"
    not_tune.write_text(json.dumps({"chosen": "int8wo"}))
    with pytest.raises(ValueError, match="is not a quantgate tune result"):
        chosen_recipe(not_tune)


def test_objective_fastest_tries_the_fastest_layout_first(first_tune, tiny_model_dir, policies):
    r = _tune(tiny_model_dir, policies["loose"], candidates=["int4_rtn_g32", "int8wo"], objective="fastest")
    scores = [row["speed_score"] for row in r["rows"]]
    assert all(s is not None and s > 0 for s in scores) and scores == sorted(scores, reverse=True)
    assert r["chosen"] == r["rows"][0]["name"] and r["rows"][1]["status"] == "not tried"
