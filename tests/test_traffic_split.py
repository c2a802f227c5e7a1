"""The one traffic split (serving/routing/traffic_split.py) and its two users: the canary router's state (config order,
canary last) and the fleet ingress's (by name); both roll back by taking the versions on trial out. No server,
no engine."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from fleet.traffic import TrafficState
from serving.http.protocol import APIError
from serving.routing.router_config import parse_router_config
from serving.routing.router_state import RouterState
from serving.routing.traffic_split import (
    NoVersion,
    TrafficError,
    TrafficSplit,
    pick,
    user_point,
)


def _router(tmp_path=None, **weights: float) -> RouterState:
    versions = {name: {"weight": w, "backends": [f"http://127.0.0.1:{9100 + i}"]}
                for i, (name, w) in enumerate(weights.items())}
    data = {"admin_key": "admin-key-for-tests", "canary": "int8", "versions": versions}
    if tmp_path is not None:
        data["decisions_log"] = str(tmp_path / "decisions.jsonl")
    return RouterState(parse_router_config(data))


def test_pick_lays_slices_out_in_the_given_order():
    weights = {"a": 1.0, "b": 1.0, "c": 0.0}
    assert pick(weights, ["a", "b", "c"], 0.25) == "a" and pick(weights, ["b", "a", "c"], 0.25) == "b"
    assert pick(weights, ["a", "b", "c"], 0.99999999) == "b"  # a zero weight never gets a request
    with pytest.raises(NoVersion):
        pick({"a": 0.0}, ["a"], 0.5)


def test_user_point_is_stable_and_in_unit_interval():
    assert user_point("alice") == user_point("alice") != user_point("bob")
    assert all(0 <= user_point(f"u{i}") < 1 for i in range(100))


def test_changes_need_a_reason_and_leave_the_state_alone_without_one():
    split = TrafficSplit({"a": 1.0, "b": 1.0}, champion="a", canaries=["b"])
    with pytest.raises(TrafficError, match="reason"):
        split.promote("b", " ")
    assert split.weights == {"a": 1.0, "b": 1.0} and split.champion == "a" and split.history == []


def test_router_lays_versions_out_in_config_order_canary_last():
    state = _router(int8=30, baseline=70)  # the config file's order does not matter: the canary goes last
    assert state.split.order == ["baseline", "int8"]
    picks = [state.pick_version(f"user-{i}") for i in range(2000)]
    assert abs(picks.count("int8") / len(picks) - 0.3) < 0.04
    assert all(p == "int8" for i, p in enumerate(picks) if user_point(f"user-{i}") >= 0.7)
    assert state.pick_version(None) in {"baseline", "int8"}


def test_router_rollback_takes_the_canary_out_even_without_a_promote(tmp_path):
    state = _router(tmp_path, baseline=70, int8=30)
    record = state.rollback("int8 backend died")
    assert record["weights_before"] == {"baseline": 70.0, "int8": 30.0}
    assert record["weights_after"] == state.weights == {"baseline": 70.0, "int8": 0.0}
    assert (record["action"], record["reason"], record["canary"]) == ("rollback", "int8 backend died", "int8")
    assert (tmp_path / "decisions.jsonl").read_text().count("\n") == 1


def test_router_rollback_after_a_promote_gives_the_others_their_configured_weights():
    state = _router(baseline=70, int8=30)
    state.set_weights({"baseline": 50.0, "int8": 50.0}, "weights", "widen")
    state.promote("int8 passed the gates")
    assert state.weights == {"baseline": 0.0, "int8": 100.0}
    assert state.pick_version("anyone") == "int8"
    state.rollback("p99 TTFT regressed")
    assert state.weights == {"baseline": 70.0, "int8": 0.0}  # configured, not the 50 set before the promote
    assert [h["action"] for h in state.history] == ["weights", "promote", "rollback"]
    assert all(h["time"].endswith("+00:00") for h in state.history)


def test_router_errors_are_api_errors():
    state = _router(baseline=70, int8=30)
    state.set_weights({"baseline": 0.0, "int8": 0.0}, "weights", "drain")
    with pytest.raises(APIError) as no_version:
        state.pick_version("anyone")
    assert no_version.value.status == 503
    alone = RouterState(parse_router_config({"admin_key": "admin-key-for-tests", "canary": "int8", "versions": {
        "int8": {"weight": 1, "backends": ["http://127.0.0.1:9100"]}}}))
    with pytest.raises(APIError) as no_other:
        alone.rollback("x")
    assert no_other.value.status == 400


def test_fleet_rollback_takes_every_version_but_its_starting_champion_out():
    state = TrafficState({"champion": 0.7, "challenger": 0.3}, "champion")
    state.set_weights({"champion": 0.5, "challenger": 0.5}, reason="widen")
    state.promote("challenger", reason="gates passed")
    state.rollback(reason="regressed")
    assert state.weights == {"champion": 0.7, "challenger": 0.0} and state.champion == "champion"
    state.rollback(reason="again")  # the same rule, so a second rollback changes nothing
    assert state.weights == {"champion": 0.7, "challenger": 0.0} and state.champion == "champion"
    with pytest.raises(ValueError, match="nothing to roll back"):
        TrafficState({"a": 1.0}, "a").rollback("x")
    assert [c["action"] for c in state.snapshot()["history"]] == ["start", "weights", "promote", "rollback",
                                                                  "rollback"]


def test_fleet_lays_versions_out_by_name():
    state = TrafficState({"zeta": 0.5, "alpha": 0.5}, "zeta")
    assert state.order == ["alpha", "zeta"]
    rng = random.Random(0)
    assert {state.pick(None, rng) for _ in range(50)} == {"alpha", "zeta"}
    assert all(state.pick(f"u{i}") == ("alpha" if user_point(f"u{i}") < 0.5 else "zeta") for i in range(200))


def test_the_split_and_the_router_state_import_neither_torch_nor_the_engine():
    code = ("import sys, serving.routing.router, fleet.traffic; "
            "bad = [m for m in ('torch', 'serving.core.engine', 'serving.http.metrics') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
