"""The load generator (serving/loadgen/run.py) against a stub server that answers at once."""

from __future__ import annotations

import json

import pytest
from benchmarks_fixtures import stub_server

from quantgate.ports import free_port
from serving.loadgen.run import (
    arrival_gaps,
    build_requests,
    completions_url,
    flat_metrics,
    run_serving_benchmark,
)
from serving.loadgen.stats import percentile, summarize


@pytest.fixture(scope="module")
def stub_url():
    with stub_server() as url:
        yield url


def test_percentile_matches_numpy_linear_method():
    data = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(data, 50) == 3.0
    assert percentile(data, 0) == 1.0 and percentile(data, 100) == 5.0
    assert percentile(data, 95) == pytest.approx(4.8)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([], 50) is None
    s = summarize([1, 2, 3, None, 4], scale=1000)
    assert s["count"] == 4 and s["mean"] == 2500 and s["median"] == 2500 and s["max"] == 4000


def test_url_requests_and_arrivals():
    assert completions_url("http://h:1") == "http://h:1/v1/completions"
    assert completions_url("http://h:1/v1/") == "http://h:1/v1/completions"
    assert completions_url("http://h:1/v1", chat=True) == "http://h:1/v1/chat/completions"
    assert completions_url("http://h:1/x/v1/completions") == "http://h:1/x/v1/completions"
    with pytest.raises(ValueError, match="http://host:port"):
        completions_url("localhost:8000")
    reqs = build_requests(150, max_tokens=(4, 9), seed=3)
    assert len(reqs) == 150 and reqs == build_requests(150, max_tokens=(4, 9), seed=3)
    assert all(4 <= n <= 9 for _, n in reqs) and len({p for p, _ in reqs}) == 64  # every shipped prompt used
    gaps = arrival_gaps(2000, 50.0, seed=1)
    assert gaps[0] == 0 and sum(gaps) / 1999 == pytest.approx(1 / 50, rel=0.1)
    assert arrival_gaps(5, float("inf")) == [0.0] * 5
    with pytest.raises(ValueError, match="request rate"):
        arrival_gaps(5, 0)
    with pytest.raises(ValueError, match="max_tokens"):
        build_requests(3, max_tokens=(5, 2))


def test_streams_are_measured_and_counted(stub_url, tmp_path):
    out = tmp_path / "serve.json"
    report = run_serving_benchmark(stub_url, None, num_requests=40, concurrency=8, max_tokens=(3, 6),
                                   seed=7, output_json=out, details=True)
    expected_tokens = sum(n for _, n in build_requests(40, max_tokens=(3, 6), seed=7))
    assert report["config"]["model"] == "stub-model"  # discovered through /v1/models
    assert report["completed"] == 40 and report["failed"] == 0
    assert report["total_output_tokens"] == expected_tokens
    assert report["ttft_ms"]["count"] == 40 and report["e2e_ms"]["count"] == 40
    assert report["itl_ms"]["count"] == expected_tokens - 40  # one gap between each pair of chunks
    assert report["ttft_ms"]["p99"] <= report["e2e_ms"]["max"]
    assert report["goodput_fraction"] == 1.0  # the stub answers far inside the default SLO
    assert json.loads(out.read_text())["completed"] == 40
    metrics = flat_metrics(report)
    assert metrics["serve_completed"] == 40 and "serve_tpot_ms_p99" in metrics and "serve_itl_ms_median" in metrics
    assert all(isinstance(v, float) for v in metrics.values())
    # an impossible SLO: nothing is good
    strict = run_serving_benchmark(stub_url, "stub-model", num_requests=10, slo_ttft_ms=0.0)
    assert strict["goodput"] == 0 and strict["goodput_fraction"] == 0


def test_chat_endpoint_and_failures_are_reported(stub_url):
    prompts = ["hello there", "please fail now", "tell me a story", "please fail again"]
    report = run_serving_benchmark(stub_url, "stub-model", num_requests=8, max_tokens=5, prompts=prompts, chat=True)
    assert report["completed"] == 4 and report["failed"] == 4
    assert report["errors"] == {"HTTP 429: queue full": 4}
    assert report["total_output_tokens"] == 20 and report["goodput_fraction"] == 0.5


def test_poisson_arrivals_are_spread_over_time(stub_url):
    report = run_serving_benchmark(stub_url, "stub-model", num_requests=30, request_rate=100.0, max_tokens=2, seed=2)
    assert report["completed"] == 30
    assert report["duration_s"] >= sum(arrival_gaps(30, 100.0, seed=2))  # the last one left no earlier


def test_no_server_is_a_clear_error():
    port = free_port()
    with pytest.raises(ValueError, match="none of the 3 requests succeeded.*Connect"):
        run_serving_benchmark(f"http://127.0.0.1:{port}", "m", num_requests=3)


def test_generator_overhead_against_stub(stub_url):
    """A benchmark printout, not a timed assertion: how many requests/s the generator drives."""
    report = run_serving_benchmark(stub_url, "stub-model", num_requests=1000, concurrency=64, max_tokens=4)
    assert report["completed"] == 1000 and report["total_output_tokens"] == 4000
    print(f"\nload generator vs stub: {report['request_throughput']:.0f} requests/s "
          f"({report['output_throughput']:.0f} chunks/s), TTFT p50 {report['ttft_ms']['median']:.2f} ms")


def test_against_our_server(tiny_model_dir):
    """The real thing: quantgate's OpenAI server over the tiny model, completions and chat, streaming."""
    import torch

    server_mod = pytest.importorskip("serving.http.server")
    from serving import LLMEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's steps are much faster single-threaded on 2 shared cores
    try:
        engine = LLMEngine.from_pretrained(str(tiny_model_dir), device="cpu", num_kv_blocks=128)
        with server_mod.ServerThread(server_mod.build_app(engine, served_model_name="tiny")) as server:
            report = run_serving_benchmark(server.url, None, num_requests=12, concurrency=4, max_tokens=(3, 6),
                                           seed=1)
            chat = run_serving_benchmark(server.url, "tiny", num_requests=3, max_tokens=4, chat=True)
    finally:
        torch.set_num_threads(threads)
    requests = build_requests(12, max_tokens=(3, 6), seed=1)
    expected = sum(n for _, n in requests)
    assert report["config"]["model"] == "tiny"
    assert report["completed"] == 12 and report["failed"] == 0
    assert report["total_output_tokens"] == expected  # ignore_eos forces every max_tokens
    assert report["total_input_tokens"] == sum(len(engine.tokenizer.encode(p)) for p, _ in requests)
    assert report["ttft_ms"]["count"] == 12 and report["tpot_ms"]["count"] == 12
    assert 0 < report["itl_ms"]["count"] <= expected - 12
    assert chat["completed"] == 3 and chat["total_output_tokens"] == 12
    assert engine.stats().generation_tokens == expected + 12
