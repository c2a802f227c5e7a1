"""The OpenAI-compatible server, driven over loopback by the `openai` client and raw HTTP."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from server_fixtures import metric, one_torch_thread, running_server, scrape, tiny_engine, wait_for

from serving import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with one_torch_thread(), running_server(tiny_model_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    """The same model in-process: what the server's answers must equal."""
    return tiny_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_completions_equal_in_process_engine(client, ref):
    r = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0)
    expected = ref.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))
    choices = sorted(r.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [o.text for o in expected]
    assert [c.finish_reason for c in choices] == [o.finish_reason for o in expected]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in expected)
    assert r.model == "tiny" and r.object == "text_completion"
    # the same prompts as token ids give the same completions
    ids = [o.prompt_token_ids for o in expected]
    r2 = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(r2.choices, key=lambda c: c.index)] == [o.text for o in expected]


def test_streaming_equals_non_streaming(client, ref):
    expected = ref.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert len(chunks) > 3  # tokens arrive as they are made, not in one piece
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_stop_strings_cut_text_streaming_or_not(client, ref):
    full = ref.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    want = full[: full.find(stop)]
    kwargs = dict(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=[stop],
                  extra_body={"ignore_eos": True})
    r = client.completions.create(**kwargs)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert streamed == want


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model="tiny", prompt=PROMPTS[2], max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    c = client.completions.create(**{**kwargs, "seed": 8}).choices[0].text
    assert a == b and a != c


def test_chat_completions_use_the_chat_template(client, ref):
    messages = [{"role": "user", "content": "Name a prime number."}]
    prompt = ref.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = ref.tokenizer.encode(prompt, add_special_tokens=False)
    expected = ref.generate(ids, SamplingParams(max_tokens=10, temperature=0))[0]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.text
    assert r.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)  # greedy: chosen = best


def test_echo_logprobs_score_the_prompt_like_openai(client, server, ref):
    """lm-eval's scoring call: echo + logprobs + max_tokens 1 (and 0: no generation at all)."""
    ids = ref.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    expected = ref.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, logprobs=1))[0]
    body = {"model": "tiny", "prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0,
            "seed": 1234}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [e.logprob for e in expected.prompt_logprobs[1:]] + [expected.logprobs[0].logprob]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    for token_lp, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert token_lp in top.values() and max(top.values()) >= token_lp  # the actual token is always listed
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    text = r["choices"][0]["text"]
    assert text == ref.tokenizer.decode(ids) + expected.text
    assert all(text[o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"], strict=True))

    r0 = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 0}, timeout=60).json()
    lp0 = r0["choices"][0]["logprobs"]
    assert lp0["token_logprobs"] == lp["token_logprobs"][:-1]
    assert r0["choices"][0]["text"] == ref.tokenizer.decode(ids)
    assert r0["usage"]["completion_tokens"] == 0


def test_models_tokenizer_and_health_endpoints(server, ref):
    url = server.url
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    tok = httpx.post(f"{url}/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
    assert tok["tokens"] == ref.tokenizer.encode("hello world", add_special_tokens=False)
    assert httpx.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "hello world"
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["eos_token"] == ref.tokenizer.eos_token and info["chat_template"]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


BAD_REQUESTS = [
    ("POST", "/v1/completions", b"{not json", 400, "not valid JSON"),
    ("POST", "/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": ""}, 400, "empty"),
    ("POST", "/v1/completions", {"prompt": [[1, 2], []]}, 400, "empty"),
    ("POST", "/v1/completions", {"prompt": [10**9]}, 400, "vocabulary"),
    ("POST", "/v1/completions", {"prompt": "x", "n": 2}, 400, "n=1"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("POST", "/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("POST", "/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "unrecognized request argument: frobnicate"),
    ("POST", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream"),
    ("POST", "/v1/completions", {"prompt": "word " * 1100}, 400, "maximum context length"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "maximum context length"),
    ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "gpt-9"),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400, "role"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("POST", "/tokenize", {"text": "x"}, 400, "prompt"),
    ("POST", "/detokenize", {"tokens": [10**9]}, 400, "vocabulary"),
    ("GET", "/v1/completions", None, 405, "not allowed"),
    ("GET", "/v1/nothing", None, 404, "no route"),
]


@pytest.mark.parametrize("method,path,body,status,needle", BAD_REQUESTS,
                         ids=[f"{b[0]} {b[1]} {b[3]} {b[4]}" for b in BAD_REQUESTS])
def test_bad_requests_get_openai_shaped_4xx(server, method, path, body, status, needle):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    if isinstance(body, bytes):
        kwargs["headers"] = {"content-type": "application/json"}
    r = httpx.request(method, f"{server.url}{path}", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_openai_client_sees_bad_request_error(client):
    with pytest.raises(openai.BadRequestError, match="n=1"):
        client.completions.create(model="tiny", prompt="x", n=3)


def test_metrics_are_labelled_and_count_requests(server, client):
    before = scrape(server.url)
    client.completions.create(model="tiny", prompt="count me", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = scrape(server.url)
    labels = {"version": "tiny", "tenant": "default"}
    for name in ("quantgate:time_to_first_token_seconds_count", "quantgate:e2e_request_latency_seconds_count",
                 "quantgate:request_queue_time_seconds_count", "quantgate:time_per_output_token_seconds_count"):
        assert metric(after, name, **labels) - metric(before, name, **labels) == 1, name
    assert metric(after, "quantgate:inter_token_latency_seconds_count", **labels) - metric(
        before, "quantgate:inter_token_latency_seconds_count", **labels) == 4
    assert metric(after, "quantgate:generation_tokens_total", **labels) - metric(
        before, "quantgate:generation_tokens_total", **labels) == 5
    assert metric(after, "quantgate:prompt_tokens_total", **labels) > metric(
        before, "quantgate:prompt_tokens_total", **labels)
    names = {n for n, _ in after}
    for name in ("quantgate:kv_cache_usage_perc", "quantgate:num_requests_running", "quantgate:num_requests_waiting",
                 "quantgate:num_preemptions_total", "quantgate:prefix_cache_hits_total"):
        assert name in names, name
    assert all(dict(lab).get("version") == "tiny" for n, lab in after if n.startswith("quantgate:"))


def test_disconnect_mid_stream_aborts_and_frees_blocks(tiny_model_dir):
    with one_torch_thread(), running_server(tiny_model_dir, engine_kwargs={"num_kv_blocks": 64}) as srv:
        body = {"prompt": "a b c d e f g", "max_tokens": 900, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30) as http, http.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            assert metric(scrape(srv.url), "quantgate:kv_cache_usage_perc") > 0
        # the connection is closed here, long before 900 tokens
        wait_for(lambda: metric(scrape(srv.url), "quantgate:request_success_total", finish_reason="abort") == 1,
                 what="the request to be aborted")
        samples = scrape(srv.url)
        assert metric(samples, "quantgate:kv_cache_usage_perc") == 0
        assert metric(samples, "quantgate:num_requests_running") == 0
        assert srv.engine.block_manager.num_free_blocks == srv.engine.block_manager.num_blocks
        assert metric(samples, "quantgate:generation_tokens_total") < 900


def test_full_waiting_queue_gives_429_with_retry_after(tiny_model_dir):
    kw = {"engine_kwargs": {"max_num_seqs": 1}, "max_waiting": 1}
    with one_torch_thread(), running_server(tiny_model_dir, **kw) as srv:
        url = f"{srv.url}/v1/completions"
        long = {"prompt": "a b c", "max_tokens": 900, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", url, json=long) as r:
            lines = r.iter_lines()
            next(lines)  # the long request holds the only decode slot
            queued: dict = {}
            t = threading.Thread(target=lambda: queued.update(
                r=httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=60)))
            t.start()
            wait_for(lambda: metric(scrape(srv.url), "quantgate:num_requests_waiting") == 1, what="a waiting request")
            refused = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "rate_limit_error"
        t.join(60)  # the long stream was dropped: the queued request runs
        assert queued["r"].status_code == 200
        assert metric(scrape(srv.url), "quantgate:request_rejected_total", reason="server_queue_full") == 1


def test_sse_wire_format(server):
    body = {"prompt": "x y", "max_tokens": 3, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(p["object"] == "text_completion" and p["id"] == payloads[0]["id"] for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_no_client_input_gets_a_5xx(server):
    """Random JSON bodies (right field names, any values) are answered 200 or 4xx, never 5xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.integers(), st.floats(allow_nan=True),
                        st.text(max_size=5))
    values = st.one_of(scalars, st.lists(scalars, max_size=3), st.lists(st.lists(st.integers(0, 50000), max_size=3),
                                                                        max_size=2))
    fields = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "logprobs", "echo",
              "stream", "ignore_eos", "stop_token_ids", "model", "user", "best_of"]
    bodies = st.dictionaries(st.sampled_from(fields), values, max_size=6).map(
        lambda d: {"prompt": "hi", "max_tokens": 2, **d})

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(bodies)
    def check(body):
        try:
            payload = json.dumps(body, allow_nan=True)
        except (TypeError, ValueError):
            return
        r = httpx.post(f"{server.url}/v1/completions", content=payload, timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400 and not body.get("stream"):
            assert r.json()["error"]["message"]

    check()


def test_validation_errors_name_the_param(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens" and "max_tokens" in err["message"]


def test_a_failure_outside_the_engine_step_fails_its_requests_and_the_loop_serves_on(tiny_model_dir):
    """Delivery or metrics raising used to kill the loop thread, leaving every request hanging."""
    with one_torch_thread(), running_server(tiny_model_dir) as srv:
        loop = srv.server.config.app.state.engine_loop
        on_output, calls = loop.metrics.on_output, []

        def broken_once(out):
            calls.append(out.request_id)
            if len(calls) == 1:
                raise RuntimeError("metrics backend broke")
            on_output(out)

        loop.metrics.on_output = broken_once
        body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        assert "metrics backend broke" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        wait_for(lambda: srv.engine.block_manager.num_free_blocks == srv.engine.block_manager.num_blocks)

        loop.stop()  # the loop is gone for good: requests get a 503 at once, never a hang
        for stream in (False, True):
            r = httpx.post(f"{srv.url}/v1/completions", json={**body, "stream": stream}, timeout=30)
            if stream:
                assert r.status_code == 200 and "engine_stopped" in r.text
            else:
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"


def test_non_finite_logits_fail_that_request_only(tiny_model_dir, monkeypatch):
    import serving.model.model_runner as runner_module
    from serving.model.sampler import sample

    def poisoning_sample(logits, seqs, generators, greedy_pick=None):  # greedy_pick: the kernel's, when built
        for row, seq in enumerate(seqs):
            if seq.token_ids[:3] == [5, 6, 7]:
                logits[row, 0] = float("nan")
        return sample(logits, seqs, generators, greedy_pick)

    monkeypatch.setattr(runner_module, "sample", poisoning_sample)
    with one_torch_thread(), running_server(tiny_model_dir) as srv:
        box = {}
        healthy = threading.Thread(target=lambda: box.setdefault("r", httpx.post(
            f"{srv.url}/v1/completions", json={"prompt": [9, 10, 11], "max_tokens": 24, "temperature": 0}, timeout=60)))
        healthy.start()
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8}, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        assert "non-finite logits" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "stream": True},
                       timeout=60)
        assert r.status_code == 200 and "non-finite logits" in r.text
        healthy.join()
        assert box["r"].status_code == 200 and box["r"].json()["usage"]["completion_tokens"] == 24
        wait_for(lambda: srv.engine.block_manager.num_free_blocks == srv.engine.block_manager.num_blocks)
