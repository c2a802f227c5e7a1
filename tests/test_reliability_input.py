"""Hostile input against the real server on loopback: whatever a client sends, the answer is a 4xx (or a
200), never a 5xx and never a hang; the engine keeps serving everyone else. Plus keys: tenants' API keys
and the router's admin key refuse what is not theirs.

The fuzz server runs with `max_model_len=64`, so any request the fuzzer makes valid finishes in at most
64 tokens of the tiny model.
"""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_fixtures import assert_client_error_shape, openapi_schema
from server_fixtures import one_torch_thread, running_server, tiny_engine

from serving import SamplingParams

ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
VALID = {
    "/v1/completions": {"prompt": "hello there", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
FIELDS = {
    "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                        "logprobs", "echo", "stream", "stream_options", "n", "model", "user", "ignore_eos",
                        "logit_bias", "presence_penalty", "best_of", "suffix", "extra_field"],
    "/v1/chat/completions": ["messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "logprobs",
                             "top_logprobs", "stop", "seed", "stream", "model", "add_generation_prompt", "n"],
    "/tokenize": ["prompt", "add_special_tokens", "model"],
    "/detokenize": ["tokens", "model"],
}
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    kw = {"engine_kwargs": {"num_kv_blocks": 32, "max_model_len": 64, "max_num_seqs": 8}, "max_waiting": 64}
    with one_torch_thread(), running_server(tiny_model_dir, **kw) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _post_raw(http: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body, headers={"content-type": "application/json"})


def _post_json(http: httpx.Client, path: str, body: object) -> httpx.Response:
    # allow_nan: Python's json (and so the server) reads NaN/Infinity literals, so they must be handled
    return _post_raw(http, path, json.dumps(body, allow_nan=True).encode())


# ---- strategies ---------------------------------------------------------------------------------------
HUGE_INTS = st.sampled_from([-1, -(2**63) - 1, 2**31, 2**63, 2**64, 10**30, -(10**30)])
WEIRD_FLOATS = st.sampled_from([float("nan"), float("inf"), float("-inf"), 5e-324, 1e-300, -0.0, 1e308, -1e-9])
scalars = st.none() | st.booleans() | st.integers() | HUGE_INTS | st.floats(allow_nan=True) | WEIRD_FLOATS | st.text(
    max_size=40)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
    st.text(max_size=12), inner, max_size=5), max_leaves=25)
hostile = (
    json_values
    | st.lists(st.integers(min_value=-5, max_value=2**70), min_size=1, max_size=8)  # token ids, some out of vocab
    | st.lists(st.lists(st.integers(min_value=-5, max_value=2**70), max_size=4), max_size=4)
    | st.lists(st.text(max_size=5), max_size=40)  # many (possibly empty) stop strings
    | st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot", ""]),
                                      "content": json_values}), max_size=4)
)


@given(path=st.sampled_from(ENDPOINTS), body=json_values)
@FUZZ
def test_any_json_body_gets_a_client_error_never_a_5xx(http, path, body):
    assert_client_error_shape(_post_json(http, path, body))


@given(path=st.sampled_from(ENDPOINTS), data=st.data())
@FUZZ
def test_hostile_field_values_get_4xx_never_5xx(http, path, data):
    body = dict(VALID[path])
    for name in data.draw(st.lists(st.sampled_from(FIELDS[path]), min_size=1, max_size=3, unique=True)):
        body[name] = data.draw(hostile, label=name)
    assert_client_error_shape(_post_json(http, path, body))


@given(path=st.sampled_from(ENDPOINTS), body=st.binary(max_size=200))
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_arbitrary_bytes_get_400(http, path, body):
    r = _post_raw(http, path, body)
    assert_client_error_shape(r)
    try:
        json.loads(body)
    except ValueError:
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


# ---- the named cases ----------------------------------------------------------------------------------
NESTED = b"[" * 100_000 + b"]" * 100_000
LONG_INT = b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}"
RAW_CASES = [
    ("/v1/completions", NESTED, "not valid JSON"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "not valid JSON"),
    ("/v1/completions", LONG_INT, "not valid JSON"),
    ("/v1/completions", b'{"prompt": "\\ud800 x", "max_tokens": 2}', "UTF-8"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', "UTF-8"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "UTF-8"),
    ("/v1/completions", b'{"prompt": "\xff\xfe hi"}', "not valid JSON"),
    ("/v1/completions", b"\xef\xbb\xbf" + b'{"prompt": "hi", "max_tokens": 1}', None),
    ("/v1/completions", b"", "not valid JSON"),
    ("/v1/completions", b"null", "JSON object"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": Infinity}', "top_p"),
    ("/v1/completions", b'{"prompt": "hi", "seed": 1e400}', "seed"),
]


@pytest.mark.parametrize("path,body,needle", RAW_CASES, ids=[f"{p} {b[:24]!r}" for p, b, _ in RAW_CASES])
def test_malformed_bodies_get_400_naming_the_problem(http, path, body, needle):
    r = _post_raw(http, path, body)
    assert_client_error_shape(r)
    if needle is not None:
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    else:
        assert r.status_code in (200, 400), r.text


JSON_CASES = [
    ("/v1/completions", {"prompt": [10**30], "max_tokens": 2}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": [[5, 6], [7, 2**64]], "max_tokens": 2}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": [-1], "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**30}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a"] * 5000}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x" * 100_000], "max_tokens": 2}, 200, None),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**64], "max_tokens": 2}, 200, None),
    ("/v1/completions", {"prompt": "hi", "top_k": 10**30, "temperature": 1.0, "max_tokens": 2}, 200, None),
    ("/v1/completions", {"prompt": "hi", "seed": -(2**63), "temperature": 1.0, "max_tokens": 2}, 200, None),
    ("/v1/completions", {"prompt": "hi", "seed": 2**63, "max_tokens": 2}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "user": "u" * 1_000_000, "max_tokens": 1}, 200, None),
    ("/v1/completions", {"prompt": ["hi"] * 1000, "max_tokens": 1}, 400, "prompts"),
    ("/v1/completions", {"prompt": "hi", "model": "m" * 100_000}, 404, "does not exist"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**30}, 400,
     "maximum context length"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]}, 400,
     "content"),
    ("/detokenize", {"tokens": [2**64]}, 400, "vocabulary"),
    ("/detokenize", {"tokens": [-3]}, 400, "tokens"),
    ("/tokenize", {"prompt": "a" * 200_000}, 200, None),
]


@pytest.mark.parametrize("path,body,status,needle", JSON_CASES,
                         ids=[f"{p} {json.dumps(b)[:40]}" for p, b, _, _ in JSON_CASES])
def test_hostile_values_get_the_right_answer(http, path, body, status, needle):
    r = _post_json(http, path, body)
    assert r.status_code == status, r.text[:500]
    assert_client_error_shape(r)
    if needle is not None:
        assert needle in r.json()["error"]["message"], r.text[:500]


@pytest.mark.parametrize("knob", [{"temperature": 1e-300}, {"temperature": 5e-324}, {"top_p": 5e-324},
                                  {"temperature": 1e-30, "top_p": 1e-300}])
def test_degenerate_sampling_values_neither_fail_nor_break_other_requests(http, server, tiny_model_dir, knob):
    """A positive temperature or top_p that float32 rounds to 0 once took down every request in the batch
    (NaN probabilities -> the engine step raised). It must act as greedy / keep the best token."""
    other = {"prompt": "a b c d", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=_post_json(http, "/v1/completions", other)))
    t.start()
    r = _post_json(http, "/v1/completions", {"prompt": "hello there", "max_tokens": 4, **knob})
    t.join(120)
    assert r.status_code == 200, r.text
    assert box["r"].status_code == 200, box["r"].text
    ref = tiny_engine(tiny_model_dir, num_kv_blocks=16, max_model_len=64)
    want = ref.generate("a b c d", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].text
    assert box["r"].json()["choices"][0]["text"] == want


# ---- body size -----------------------------------------------------------------------------------------
def test_oversized_bodies_get_413_before_they_are_read(server):
    from serving.http.http_body import MAX_BODY_BYTES

    big = b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
    r = httpx.post(f"{server.url}/v1/completions", content=big, headers={"content-type": "application/json"},
                   timeout=120)
    assert r.status_code == 413 and "body over" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit holds while streaming the body in
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 2**20 + 2):
            yield b"a" * 2**20

    r = httpx.post(f"{server.url}/tokenize", content=chunks(), headers={"content-type": "application/json"},
                   timeout=120)
    assert r.status_code == 413

    # a Content-Length that lies about a huge body: refused from the header, nothing read
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 99999999999999\r\n\r\n{")
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


# ---- schemathesis against the request schema ------------------------------------------------------------
def test_schemathesis_finds_no_server_error(server):
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_dict(openapi_schema())
    failures: list[str] = []
    checked = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = operation.as_strategy(generation_mode=mode)

            @given(case=strategy)
            @settings(max_examples=12, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case):
                nonlocal checked
                r = case.call(base_url=server.url, timeout=60)
                checked += 1
                if r.status_code >= 500:
                    failures.append(f"{case.operation.path}: {r.status_code} {r.text[:200]} for {case.body!r:.200}")

            run()
    assert checked >= 4 * 2 * 5
    assert not failures, "\n".join(failures)


# ---- keys: tenants and the router's admin ------------------------------------------------------------
KEYS = {"sk-tenant-a-0001": "a", "sk-tenant-b-0001": "b"}


def test_every_tenant_endpoint_refuses_missing_or_wrong_keys(tiny_model_dir, tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": KEYS}))
    from serving.http.tenants import load_tenants

    kw = {"engine_kwargs": {"num_kv_blocks": 16, "max_model_len": 64}, "tenants": load_tenants(path)}
    with one_torch_thread(), running_server(tiny_model_dir, **kw) as srv:
        calls = [("POST", p, VALID[p]) for p in ENDPOINTS] + [("GET", "/v1/models", None),
                                                               ("GET", "/tokenizer_info", None)]
        bad_headers = [{}, {"Authorization": "Bearer sk-tenant-a-0002"}, {"Authorization": "Basic sk-tenant-a-0001"},
                       {"Authorization": "sk-tenant-a-0001"}, {"Authorization": "Bearer sk-tenant-a-000"},
                       {"Authorization": "Bearer SK-TENANT-A-0001"}, {"Authorization": "Bearer"},
                       {"X-API-Key": "sk-tenant-a-0001"}]
        for method, p, body in calls:
            for headers in bad_headers:
                r = httpx.request(method, f"{srv.url}{p}", json=body, headers=headers, timeout=30)
                assert r.status_code == 401, (p, headers, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
                assert "sk-tenant" not in r.text and '"a"' not in r.text  # no key or tenant name leaks
            ok = httpx.request(method, f"{srv.url}{p}", json=body, timeout=60,
                               headers={"Authorization": "Bearer sk-tenant-b-0001"})
            assert ok.status_code == 200, (p, ok.text)

        # a request id is never an address: there is no endpoint to read or cancel another's request
        a = httpx.post(f"{srv.url}/v1/completions", json=VALID["/v1/completions"], timeout=60,
                       headers={"Authorization": "Bearer sk-tenant-a-0001"}).json()
        for method, p in [("GET", f"/v1/completions/{a['id']}"), ("DELETE", f"/v1/completions/{a['id']}"),
                          ("POST", f"/v1/completions/{a['id']}/cancel"), ("GET", f"/v1/requests/{a['id']}")]:
            r = httpx.request(method, f"{srv.url}{p}", timeout=30, headers={"Authorization": "Bearer sk-tenant-b-0001"})
            assert r.status_code in (404, 405), r.text  # (a 404 echoes the path it was asked for, nothing more)
        assert a["id"] not in httpx.get(f"{srv.url}/metrics", timeout=30).text


ADMIN_KEY = "admin-key-for-reliability"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def router_url():
    router = pytest.importorskip("serving.routing.router")  # the router module is still being written
    from reliability_fixtures import free_port

    from serving.http.server_thread import ServerThread

    config = router.parse_router_config({
        "admin_key": ADMIN_KEY, "canary": "int8", "poll_interval_s": 5,
        "versions": {"baseline": {"weight": 90, "backends": [f"http://127.0.0.1:{free_port()}"]},
                     "int8": {"weight": 10, "backends": [f"http://127.0.0.1:{free_port()}"]}}})
    with ServerThread(router.build_router_app(config)) as srv:
        yield srv.url


def _router_state(url: str) -> dict:
    r = httpx.get(f"{url}/admin/state", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_router_admin_endpoints_refuse_without_the_admin_key(router_url):
    url = router_url
    state = _router_state(url)
    bad_headers = [{}, {"Authorization": "Bearer wrong-key-0000"}, {"Authorization": f"Basic {ADMIN_KEY}"},
                   {"Authorization": ADMIN_KEY}, {"Authorization": f"Bearer {ADMIN_KEY[:-1]}"},
                   {"Authorization": f"Bearer {ADMIN_KEY}x"}, {"Authorization": "Bearer sk-tenant-a-0001"},
                   {"X-Admin-Key": ADMIN_KEY}]
    calls = [("GET", "/admin/state", None), ("POST", "/admin/promote", {"reason": "x"}),
             ("POST", "/admin/rollback", {"reason": "x"}),
             ("POST", "/admin/weights", {"weights": {"baseline": 0, "int8": 100}, "reason": "x"})]
    for method, p, body in calls:
        for headers in bad_headers:
            r = httpx.request(method, f"{url}{p}", json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (p, headers, r.text)
            assert ADMIN_KEY not in r.text
        r = httpx.request(method, f"{url}{p}?key={ADMIN_KEY}", json=body, timeout=30)
        assert r.status_code == 401  # a key in the URL (and so in access logs) is not accepted either
    after = _router_state(url)
    assert (after["weights"], after["history"]) == (state["weights"], state["history"])  # nothing moved


ROUTER_BODIES = [
    b"[",
    b"[1]",
    b'{"reason": 5}',
    b'{"weights": {"baseline": -1, "int8": 1}, "reason": "x"}',
    b'{"weights": {"baseline": 1}, "reason": "x"}',
    b'{"weights": {"baseline": 1e400, "int8": 1}, "reason": "x"}',
    b'{"weights": {"baseline": NaN, "int8": 1}, "reason": "x"}',
    b'{"weights": {"baseline": -Infinity, "int8": 1}, "reason": "x"}',
    b'{"weights": {"baseline": 1e308, "int8": 1e308}, "reason": "x"}',  # each finite, the sum is not
    b'{"weights": {"baseline": 0, "int8": 0}, "reason": "x"}',
    b'{"weights": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # nesting deeper than the JSON parser's stack
    b'{"weights": {"baseline": 1, "int8": 1}, "reason": "\\ud800"}',  # a lone surrogate: not text
]


@pytest.mark.parametrize("body", ROUTER_BODIES, ids=[repr(b[:40]) for b in ROUTER_BODIES])
def test_router_admin_bad_bodies_get_400_and_move_nothing(router_url, body):
    before = _router_state(router_url)
    try:
        r = httpx.post(f"{router_url}/admin/weights", content=body, timeout=30,
                       headers={**ADMIN, "content-type": "application/json"})
        assert r.status_code == 400, (body[:60], r.text[:300])
        assert _router_state(router_url)["weights"] == before["weights"]
    finally:  # a bad body that got through must not spoil the next case
        httpx.post(f"{router_url}/admin/weights", headers=ADMIN, timeout=30,
                   json={"weights": before["weights"], "reason": "reliability test: restore"})


def test_router_refuses_oversized_bodies_with_413(router_url):
    from serving.http.http_body import MAX_BODY_BYTES

    big = b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
    for path in ("/v1/completions", "/admin/weights"):
        r = httpx.post(f"{router_url}{path}", content=big, timeout=120,
                       headers={**ADMIN, "content-type": "application/json"})
        assert r.status_code == 413 and "body over" in r.json()["error"]["message"], (path, r.text[:200])
