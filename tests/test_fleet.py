"""The fleet on a real local Ray Serve with the tiny model: one Ray instance for the module.

Ingress (completions, chat, streaming, error shapes), the weighted sticky split, live promote and
rollback without replica restarts, a replica killed mid-stream, and autoscaling min -> max -> min.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")

from fleet.config import FleetConfig  # noqa: E402
from fleet.traffic import TrafficState  # noqa: E402
from quantgate.ports import free_port

APP = "tiny-fleet"
ADMIN = {"Authorization": "Bearer test-admin-key"}


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path):
    import ray
    from ray import serve

    from fleet import app as fleet_app

    engine = {"model": str(tiny_model_dir), "num_kv_blocks": 128, "threads": 1, "num_cpus": 0.5,
              "dtype": "float32"}
    config = FleetConfig.model_validate({
        "name": APP, "served_model_name": "tiny", "port": free_port(), "routing_stats_period_s": 0.25,
        "admin_key": "test-admin-key",
        "versions": [
            {"name": "champion", "weight": 0.7, "num_replicas": 2, **engine},
            {"name": "challenger", "weight": 0.3, **engine,
             "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                             "upscale_delay_s": 0, "downscale_delay_s": 1, "look_back_period_s": 1}},
        ],
    })
    try:
        info = fleet_app.up(config, num_cpus=2, timeout_s=240)
        yield info
    finally:
        serve.shutdown()
        ray.shutdown()


def post(fleet: dict, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{fleet['url']}{path}", json=body, timeout=60, **kw)


def traffic(fleet: dict, **body) -> dict:
    r = post(fleet, "/fleet/traffic", body, headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def running_replicas(version: str) -> int:
    from ray import serve

    states = serve.status().applications[APP].deployments[version].replica_states
    return sum(n for state, n in states.items() if str(state).endswith("RUNNING"))


def test_ingress_answers_completions_chat_and_streams(fleet):
    r = post(fleet, "/v1/completions", {"prompt": "Hello", "max_tokens": 5, "ignore_eos": True, "user": "u1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["usage"]["completion_tokens"] == 5 and r.headers["x-quantgate-version"] in ("champion", "challenger")
    chat = post(fleet, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    with httpx.stream("POST", f"{fleet['url']}/v1/completions", timeout=60,
                      json={"prompt": "Hello", "max_tokens": 6, "ignore_eos": True, "stream": True}) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    # the single server's error shapes, from the single server's own code
    bad = post(fleet, "/v1/completions", {"prompt": "x", "max_tokens": "many"})
    assert bad.status_code == 400
    assert bad.json()["error"] == {"message": "max_tokens: Input should be a valid integer (got 'many')",
                                   "type": "invalid_request_error", "param": "max_tokens", "code": None}
    assert httpx.get(f"{fleet['url']}/v1/nope", timeout=10).json()["error"]["type"] == "not_found_error"
    assert httpx.get(f"{fleet['url']}/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"


def test_split_follows_the_weights_and_sticks_to_users(fleet):
    expected = TrafficState({"champion": 0.7, "challenger": 0.3}, "champion")
    got = {}
    for i in range(40):
        r = post(fleet, "/v1/completions", {"prompt": "a", "max_tokens": 1, "user": f"user-{i}"})
        got[f"user-{i}"] = r.headers["x-quantgate-version"]
    assert all(got[u] == expected.pick(u) for u in got)  # the ingress applies exactly this split
    share = sum(v == "challenger" for v in got.values()) / len(got)
    assert 0.1 <= share <= 0.5  # 0.3 within ~3 binomial standard deviations of 40 draws
    again = post(fleet, "/v1/completions", {"prompt": "b", "max_tokens": 1, "user": "user-3"})
    assert again.headers["x-quantgate-version"] == got["user-3"]


def test_promote_and_rollback_apply_to_the_next_request_without_restarts(fleet):
    from fleet.app import live_replicas

    before = {(r["replica"], r["pid"]) for r in live_replicas(APP)}
    user = next(f"user-{i}" for i in range(100)
                if TrafficState({"champion": 0.7, "challenger": 0.3}, "champion").pick(f"user-{i}") == "champion")
    state = traffic(fleet, action="promote", version="challenger", reason="canary passed")
    assert state["weights"] == {"champion": 0.0, "challenger": 1.0} and state["champion"] == "challenger"
    r = post(fleet, "/v1/completions", {"prompt": "a", "max_tokens": 1, "user": user})
    assert r.headers["x-quantgate-version"] == "challenger"
    state = traffic(fleet, action="rollback", reason="latency regression")
    r = post(fleet, "/v1/completions", {"prompt": "a", "max_tokens": 1, "user": user})
    assert r.headers["x-quantgate-version"] == "champion"
    assert [(h["action"], h["reason"]) for h in state["history"][-2:]] == [
        ("promote", "canary passed"), ("rollback", "latency regression")]
    assert all(h["time_iso"].endswith("Z") for h in state["history"])
    assert {(r["replica"], r["pid"]) for r in live_replicas(APP)} == before  # no replica restarted
    assert len(before) == 3
    bad = post(fleet, "/fleet/traffic", {"action": "promote", "version": "nope", "reason": "x"}, headers=ADMIN)
    assert bad.status_code == 400 and "unknown version" in bad.json()["error"]["message"]
    denied = post(fleet, "/fleet/traffic", {"action": "promote", "version": "challenger", "reason": "x"})
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_admin_key"
    assert httpx.get(f"{fleet['url']}/fleet/state", timeout=10).status_code == 401


def test_a_replica_killed_mid_stream_fails_that_request_clearly_and_the_fleet_keeps_serving(fleet):
    import ray

    user = next(f"k{i}" for i in range(100)
                if TrafficState({"champion": 0.7, "challenger": 0.3}, "champion").pick(f"k{i}") == "champion")
    body = {"prompt": "Once", "max_tokens": 900, "ignore_eos": True, "stream": True, "user": user}
    with httpx.stream("POST", f"{fleet['url']}/v1/completions", json=body, timeout=60) as s:
        replica = s.headers["x-quantgate-replica"]
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
        name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["namespace"] == "serve" and a["name"].endswith(f"#{replica}"))
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["code"] == "replica_failed" and "champion" in error["message"]
    for i in range(6):  # the other champion replica (and the one Serve starts) answer
        r = post(fleet, "/v1/completions", {"prompt": "a", "max_tokens": 2, "user": f"{user}-{i}"})
        assert r.status_code == 200, r.text


def test_autoscaling_goes_from_min_to_max_under_load_and_back(fleet):
    traffic(fleet, action="weights", weights={"champion": 0, "challenger": 1}, reason="load the challenger")
    stop = threading.Event()
    seen: set[str] = set()

    def load(n: int) -> None:
        while not stop.is_set():
            r = post(fleet, "/v1/completions", {"prompt": "Hi", "max_tokens": 300, "ignore_eos": True, "user": f"l{n}"})
            if r.status_code == 200:
                seen.add(r.headers["x-quantgate-replica"])

    threads = [threading.Thread(target=load, args=(n,), daemon=True) for n in range(4)]
    try:
        assert running_replicas("challenger") == 1
        for t in threads:
            t.start()
        deadline = time.monotonic() + 90
        while running_replicas("challenger") < 2:
            assert time.monotonic() < deadline, "the challenger never scaled out"
            time.sleep(0.5)
        deadline = time.monotonic() + 30
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(seen) == 2  # the new replica took requests
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    deadline = time.monotonic() + 60
    while running_replicas("challenger") > 1:
        assert time.monotonic() < deadline, "the challenger never scaled back in"
        time.sleep(0.5)
    traffic(fleet, action="weights", weights={"champion": 0.7, "challenger": 0.3}, reason="restore")
