"""Tenants: the API-keys file, KV quotas at admission, fair sharing between tenants, and over HTTP."""

from __future__ import annotations

import threading

import httpx
import pytest
import yaml
from server_fixtures import metric, one_torch_thread, running_server, scrape, tiny_engine, wait_for

from serving import LLMEngine, SamplingParams
from serving.core.fairness import TenantFairness
from serving.http.tenants import Tenant, load_tenants, parse_tenants

KEYS = {"sk-team-a-0001": "a", "sk-team-b-0001": "b"}


# ---- the file ----------------------------------------------------------------------------------
def test_load_tenants_and_authenticate(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": KEYS, "tenants": {"a": {"max_kv_blocks": 0.25, "max_waiting": 3}}}))
    table = load_tenants(path)
    assert table.authenticate("sk-team-a-0001") == Tenant("a", 0.25, 3)
    assert table.authenticate("sk-team-b-0001") == Tenant("b")
    assert table.authenticate("sk-team-a-0002") is None and table.authenticate(None) is None
    assert table.quotas(num_blocks=100) == {"a": 25}
    assert Tenant("x", 500).kv_block_quota(100) == 100


@pytest.mark.parametrize("data,needle", [
    ([1, 2], "mapping"),
    ({"tenants": {}}, "`keys` must be"),
    ({"keys": {"short": "a"}}, "at least 8 characters"),
    ({"keys": {"sk-long-enough": ""}}, "non-empty string"),
    ({"keys": KEYS, "extra": 1}, "unknown top-level"),
    ({"keys": KEYS, "tenants": {"c": {}}}, "no API key"),
    ({"keys": KEYS, "tenants": {"a": {"max_blocks": 3}}}, "unknown field"),
    ({"keys": KEYS, "tenants": {"a": {"max_kv_blocks": 1.5}}}, "(0, 1]"),
    ({"keys": KEYS, "tenants": {"a": {"max_kv_blocks": 0}}}, ">= 1"),
    ({"keys": KEYS, "tenants": {"a": {"max_kv_blocks": "lots"}}}, "must be a number"),
    ({"keys": KEYS, "tenants": {"a": {"max_waiting": -1}}}, "max_waiting"),
])
def test_bad_api_keys_files_are_refused_by_name(data, needle):
    with pytest.raises(ValueError, match=__import__("re").escape(needle)):
        parse_tenants(data)


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tenants(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("keys: [unclosed")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_tenants(bad)


# ---- the scheduler -----------------------------------------------------------------------------
def _steps_until_done(engine, request_id: str, limit: int = 500) -> int:
    for step in range(1, limit + 1):
        if any(o.request_id == request_id and o.finished for o in engine.step()):
            return step
    raise AssertionError(f"{request_id} did not finish in {limit} steps")


def _drain(engine, limit: int = 500) -> None:
    for _ in range(limit):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError("the engine did not drain")


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with one_torch_thread():
        yield tiny_engine(tiny_model_dir, num_kv_blocks=256, max_num_batched_tokens=512)


def test_a_burst_of_long_prompts_does_not_starve_another_tenant(engine):
    """B's latency, counted in engine steps, with A flooding long prompts vs. B alone: within 1.5x when
    B is another tenant; far over it when the same requests share one FIFO (what fairness fixes)."""
    short = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    long = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def b_steps(b_tenant: str | None, salt: int = 0) -> int:
        if b_tenant is not None:  # fresh prompts each run (salt): nothing comes from the prefix cache
            for i in range(8):
                engine.add_request([100 + salt + (7 * i + j) % 900 for j in range(400)], long, tenant="a")
            engine.step()  # A's burst is admitted and prefilling when B arrives
        rid = engine.add_request(list(range(200, 210)), short, tenant=b_tenant or "b")
        steps = _steps_until_done(engine, rid)
        _drain(engine)
        return steps

    alone = b_steps(None)
    assert alone == 8  # one prefill step that also samples, then seven decodes
    fair = b_steps("b", salt=1000)
    fifo = b_steps("a", salt=2000)
    assert fair <= 1.5 * alone, (alone, fair)
    assert fifo > 1.5 * alone, (alone, fifo)  # the same flood in one FIFO does hold B back


def test_shared_steps_pay_for_prefill_from_a_time_allowance(engine):
    """While B decodes, A's long prompts are prefilled in fixed chunks only as far as the time allowance
    pays for them, so shared steps average within the slack of B's decode-only steps; a newcomer's
    short prompt is prefilled the step it arrives. Step times are crafted: 50 ms a decode step, prefill
    adding 20 ms plus 1 ms a token, so the bound below is exact arithmetic, not a timing."""
    sched, fairness = engine.scheduler, engine.scheduler.fairness
    fairness.decode_step_seconds, fairness.prefill_allowance = None, 0.0
    step_done, schedule, steps = sched.step_done, sched.schedule, []

    def crafted_step_done(plan, seconds):
        prefill = plan.num_prefill_tokens
        step_done(plan, 0.05 + (0.02 + 0.001 * prefill if prefill else 0.0))

    def spy():
        plan = schedule()
        steps.append(plan)
        return plan

    sched.step_done, sched.schedule = crafted_step_done, spy
    try:
        params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        b = engine.add_request([300 + i for i in range(12)], params, tenant="b")
        for _ in range(5):
            engine.step()
        assert fairness.decode_step_seconds == pytest.approx(0.05)
        for i in range(3):
            engine.add_request([100 + 3 * i + j % 700 for j in range(400)], params, tenant="a")
        steps.clear()
        while any(s.request_id == b for s in sched.running):
            engine.step()
        a_prefill = [sum(x.num_new_tokens for x in p.scheduled if x.seq.tenant == "a" and x.is_prefill)
                     for p in steps]
        assert all(any(x.seq.request_id == b for x in p.scheduled) for p in steps)  # B decodes every step
        assert max(a_prefill) <= fairness.prefill_chunk, a_prefill  # (a prompt's last token may ride along)
        assert sum(n >= fairness.prefill_chunk - 1 for n in a_prefill) >= 4, a_prefill  # A does progress
        assert a_prefill.count(0) > len(a_prefill) / 2  # most shared steps pay back what a chunk cost
        seconds = sum(0.05 + (0.02 + 0.001 * n if n else 0.0) for n in a_prefill)
        first_chunk = 0.02 + 0.001 * fairness.prefill_chunk  # A's newcomer chunk, before any saving
        assert seconds <= (1 + fairness.step_slack) * 0.05 * len(steps) + first_chunk

        steps.clear()
        prompt = [500 + i for i in range(20)]
        b2 = engine.add_request(prompt, params, tenant="b")  # B has nothing running: a newcomer
        engine.step()
        mine = [x for x in steps[0].scheduled if x.seq.request_id == b2]
        assert mine and mine[0].num_new_tokens == len(prompt)  # prefilled at once, allowance or not
    finally:
        del sched.step_done, sched.schedule
        _drain(engine)


def test_kv_quota_caps_a_tenant_and_others_still_get_in(engine):
    engine = LLMEngine(engine.model, engine.tokenizer, device="cpu", num_kv_blocks=256, max_num_batched_tokens=512,
                       tenant_fairness=TenantFairness({"a": 60}))  # the module's model, a scheduler with a quota
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)  # 408 tokens: 26 blocks
        for i in range(6):
            engine.add_request([100 + i] * 400, params, tenant="a")
        b = engine.add_request([300] * 20, params, tenant="b")
        most, b_done = 0, None
        for step in range(1, 300):
            outs = engine.step()
            held = sum(len(s.block_table) for s in engine.scheduler.running if s.tenant == "a")
            most = max(most, held)
            assert engine.scheduler.reserved_blocks("a") <= 60
            if any(o.request_id == b and o.finished for o in outs):
                b_done = step
            if not engine.has_unfinished():
                break
        assert 26 < most <= 60  # two of A's requests at a time, never three
        assert b_done is not None and b_done <= 10  # B was not queued behind A's quota-blocked requests
        with pytest.raises(ValueError, match="tenant 'a' may hold at most 60 blocks"):
            engine.add_request([5] * 1000, params, tenant="a")
    finally:
        _drain(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---- over HTTP ---------------------------------------------------------------------------------
def test_server_with_api_keys(tiny_model_dir, tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": KEYS, "tenants": {"a": {"max_kv_blocks": 40, "max_waiting": 1}},
                                    "metrics_key": "sk-metrics-0001"}))
    ops = {"Authorization": "Bearer sk-metrics-0001"}  # /metrics answers only to the metrics key
    key_a = {"Authorization": "Bearer sk-team-a-0001"}
    key_b = {"Authorization": "Bearer sk-team-b-0001"}
    with one_torch_thread(), running_server(tiny_model_dir, tenants=load_tenants(path)) as srv:
        url = f"{srv.url}/v1/completions"
        short = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
        r = httpx.post(url, json=short, timeout=30)
        assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
        r = httpx.post(url, json=short, headers={"Authorization": "Bearer sk-wrong-key"}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{srv.url}/v1/models", timeout=30).status_code == 401

        # A's request that could never fit its 40-block quota is refused, not left hanging
        r = httpx.post(url, json={**short, "max_tokens": 700}, headers=key_a, timeout=30)
        assert r.status_code == 400 and "may hold at most 40 blocks" in r.json()["error"]["message"]

        # one long A request fills A's quota (38 of 40 blocks reserved); a second waits; a third is a 429
        long = {"prompt": "a b", "max_tokens": 600, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", url, json=long, headers=key_a) as stream:
            lines = stream.iter_lines()  # keep a reference: a dropped iterator closes the connection
            next(lines)
            second: dict = {}
            t = threading.Thread(target=lambda: second.update(
                r=httpx.post(url, json={**short, "max_tokens": 90}, headers=key_a, timeout=60)))
            t.start()
            wait_for(lambda: metric(scrape(srv.url, ops), "quantgate:num_requests_waiting", tenant="a") == 1,
                     what="A's second request to wait")
            third = httpx.post(url, json=short, headers=key_a, timeout=30)
            assert third.status_code == 429 and "tenant 'a'" in third.json()["error"]["message"]
            assert third.headers["retry-after"] == "1"
            # B is neither queued behind A nor refused
            r = httpx.post(url, json=short, headers=key_b, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        t.join(60)
        assert second["r"].status_code == 200

        samples = scrape(srv.url, ops)
        assert metric(samples, "quantgate:request_rejected_total", tenant="a", reason="tenant_queue_full") == 1
        assert metric(samples, "quantgate:request_rejected_total", tenant="b") == 0
        assert metric(samples, "quantgate:e2e_request_latency_seconds_count", tenant="b") == 1
        assert metric(samples, "quantgate:e2e_request_latency_seconds_count", tenant="a") == 2
        assert {dict(lab).get("tenant") for n, lab in samples if n == "quantgate:num_requests_running"} == {"a", "b"}


@pytest.mark.parametrize("flag,value", [("--tenant-slack", "0"), ("--tenant-slack", "nan"),
                                        ("--tenant-prefill-chunk", "0")])
def test_serve_refuses_bad_tenant_sharing_flags_before_loading_the_model(flag, value, capsys):
    from quantgate.cli import main

    assert main(["serve", "--model", "no-such-model", flag, value]) == 2
    assert "--tenant-slack must be in (0, 100)" in capsys.readouterr().err
