"""The canary router in front of real backends: two in-process replicas of `baseline` and one
`quantgate serve` subprocess as the `int8` canary (the same tiny model under another version label)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from reliability_fixtures import spawn_serve, stop_serve, wait_serve_up
from server_fixtures import metric, one_torch_thread, running_server, scrape, wait_for

from serving.http.server_thread import ServerThread
from serving.routing.router import build_router_app, parse_router_config

ADMIN = {"Authorization": "Bearer admin-key-for-tests"}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    """baseline: r1 in this process and r2 in a subprocess; int8 (the canary): a subprocess."""
    logs = tmp_path_factory.mktemp("backends")
    backend = ("--num-kv-blocks", "48", "--model-version")
    procs = []
    try:  # both subprocesses start before either is waited for: they load side by side
        procs.append(spawn_serve(tiny_model_dir, logs / "r2.log", *backend, "baseline"))
        procs.append(spawn_serve(tiny_model_dir, logs / "int8.log", *backend, "int8"))
        (r2_proc, r2), (proc, canary_url) = procs
        kw = dict(engine_kwargs={"num_kv_blocks": 48}, version="baseline")
        with one_torch_thread(), running_server(tiny_model_dir, **kw) as r1:
            wait_serve_up(r2_proc, r2, logs / "r2.log", timeout=180)
            wait_serve_up(proc, canary_url, logs / "int8.log", timeout=180)
            config = parse_router_config({
                "model": "tiny", "admin_key": "admin-key-for-tests", "canary": "int8", "poll_interval_s": 0.2,
                "timeout_s": 60,
                "versions": {"baseline": {"weight": 70, "backends": [r1.url, r2]},
                             "int8": {"weight": 30, "backends": [canary_url]}},
            })
            with ServerThread(build_router_app(config)) as router:
                yield {"router": router.url, "r1": r1.url, "r2": r2, "canary": canary_url, "proc": proc}
    finally:
        for p, _ in procs:
            stop_serve(p)


def _complete(url: str, user: str | None = None, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 1, "temperature": 0, **extra}
    if user is not None:
        body["user"] = user
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def _set_weights(url: str, baseline: float, int8: float) -> None:
    r = httpx.post(f"{url}/admin/weights", headers=ADMIN, timeout=10,
                   json={"weights": {"baseline": baseline, "int8": int8}, "reason": "test setup"})
    assert r.status_code == 200, r.text


def test_weight_split_and_stickiness(cluster):
    url = cluster["router"]
    _set_weights(url, 70, 30)
    versions = []
    for i in range(120):
        r = _complete(url, user=f"user-{i}")
        assert r.status_code == 200, r.text
        versions.append(r.headers["x-quantgate-version"])
    share = versions.count("int8") / len(versions)
    assert abs(share - 0.30) < 0.13, share  # 3 sigma of a binomial(120, 0.3)
    for i in (0, 1, 2):  # the same user always lands on the same version
        assert {_complete(url, user=f"user-{i}").headers["x-quantgate-version"] for _ in range(4)} == {versions[i]}


def test_promote_and_rollback_take_effect_on_the_next_request(cluster):
    url = cluster["router"]
    _set_weights(url, 95, 5)
    r = httpx.post(f"{url}/admin/promote", json={"reason": "int8 passed the gates"}, timeout=10)
    assert r.status_code == 401  # no admin key
    r = httpx.post(f"{url}/admin/promote", json={"reason": "x"}, headers={"Authorization": "Bearer wrong-key"})
    assert r.status_code == 401
    assert httpx.post(f"{url}/admin/promote", json={}, headers=ADMIN).status_code == 400  # a reason is required

    r = httpx.post(f"{url}/admin/promote", json={"reason": "int8 passed the gates"}, headers=ADMIN, timeout=10)
    assert r.status_code == 200 and r.json()["weights_after"] == {"baseline": 0.0, "int8": 100.0}
    assert {_complete(url, user=f"p-{i}").headers["x-quantgate-version"] for i in range(8)} == {"int8"}

    r = httpx.post(f"{url}/admin/rollback", json={"reason": "p99 TTFT regressed"}, headers=ADMIN, timeout=10)
    assert r.status_code == 200 and r.json()["weights_after"] == {"baseline": 70.0, "int8": 0.0}  # as configured
    assert {_complete(url, user=f"p-{i}").headers["x-quantgate-version"] for i in range(8)} == {"baseline"}

    history = httpx.get(f"{url}/admin/state", headers=ADMIN, timeout=10).json()["history"]
    assert [(h["action"], h["reason"]) for h in history[-2:]] == [("promote", "int8 passed the gates"),
                                                                  ("rollback", "p99 TTFT regressed")]
    assert all(h["time"] for h in history)
    assert httpx.get(f"{url}/admin/state", timeout=10).status_code == 401


def test_router_speaks_the_same_api(cluster):
    url = cluster["router"]
    _set_weights(url, 100, 0)
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    direct = openai.OpenAI(base_url=f"{cluster['r1']}/v1", api_key="unused", max_retries=0, timeout=60)
    kwargs = dict(model="tiny", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert client.completions.create(**kwargs).choices[0].text == direct.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert streamed == direct.completions.create(**kwargs).choices[0].text
    r = httpx.post(f"{url}/v1/completions", json={"model": "other", "prompt": "x"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "n": 2}, timeout=10)
    assert r.status_code == 400  # the backend's validation comes through unchanged
    assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"}, timeout=10).json()["tokens"]
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'quantgate:router_requests_total{code="200",version="baseline"}' in metrics
    assert 'quantgate:kv_cache_usage_perc{backend="' in metrics


def test_replica_choice_follows_kv_usage(cluster):
    """A replica whose KV cache is nearly full gets no new requests while its sibling is empty."""
    url, r1, r2 = cluster["router"], cluster["r1"], cluster["r2"]
    _set_weights(url, 100, 0)
    body = {"prompt": [list(range(100, 420))], "max_tokens": 420, "temperature": 0, "stream": True,
            "ignore_eos": True}  # grows to 46 of r1's 48 blocks
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{r1}/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        next(lines)

        def r1_loaded() -> bool:
            state = httpx.get(f"{url}/admin/state", headers=ADMIN, timeout=10).json()
            return next(b for b in state["backends"] if b["url"] == r1)["kv_usage"] > 0.5

        wait_for(r1_loaded, timeout=30, what="the router to see r1's KV usage")
        chosen = {_complete(url, user=f"kv-{i}").headers["x-quantgate-backend"] for i in range(6)}
        assert chosen == {r2}


def test_killed_backend_gives_502_in_flight_and_503_after_never_a_hang(cluster):
    url, proc = cluster["router"], cluster["proc"]
    _set_weights(url, 0, 100)
    assert _complete(url, user="k").headers["x-quantgate-version"] == "int8"
    result: dict = {}

    def long_request() -> None:
        result["r"] = _complete(url, user="k", max_tokens=700, ignore_eos=True)  # 48 blocks hold 768 tokens

    t = threading.Thread(target=long_request)
    t.start()
    # killed once the canary decodes it (~0.7 s of decoding here): a fixed 1 s sleep let it finish first
    wait_for(lambda: metric(scrape(cluster["canary"]), "quantgate:num_requests_running") == 1, timeout=30,
             what="the long request to be running on the canary")
    proc.kill()
    proc.wait(10)
    t.join(30)
    assert not t.is_alive(), "the in-flight request hung"
    assert result["r"].status_code == 502 and result["r"].json()["error"]["code"] == "backend_failed"

    start = time.monotonic()
    r = _complete(url, user="k")
    assert r.status_code == 503 and "int8" in r.json()["error"]["message"]
    assert time.monotonic() - start < 5
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # the router keeps serving
    wait_for(lambda: not next(b for b in httpx.get(f"{url}/admin/state", headers=ADMIN, timeout=10).json()["backends"]
                              if b["version"] == "int8")["healthy"], timeout=10, what="int8 to be marked down")
    r = httpx.post(f"{url}/admin/rollback", json={"reason": "int8 backend died"}, headers=ADMIN, timeout=10)
    assert r.status_code == 200
    assert _complete(url, user="k").status_code == 200


def test_router_config_is_checked():
    good = {"admin_key": "long-enough-key", "canary": "b",
            "versions": {"a": {"weight": 1, "backends": ["http://127.0.0.1:1"]},
                         "b": {"weight": 0, "backends": ["http://127.0.0.1:2"]}}}
    assert [v.name for v in parse_router_config(good).versions] == ["a", "b"]
    for bad, needle in [
        ({**good, "canary": "c"}, "canary"),
        ({**good, "admin_key": "short"}, "admin_key"),
        ({**good, "typo": 1}, "unknown field"),
        ({**good, "versions": {"a": {"weight": -1, "backends": ["http://x:1"]}, "b": good["versions"]["b"]}},
         "weight"),
        ({**good, "versions": {"a": {"weight": 1, "backends": ["ftp://x"]}, "b": good["versions"]["b"]}},
         "base URL"),
        ({**good, "versions": {"a": {"weight": 0, "backends": ["http://x:1"]}, "b": good["versions"]["b"]}},
         "weight > 0"),
    ]:
        with pytest.raises(ValueError, match=needle):
            parse_router_config(bad)
