"""The serving benchmark of one model inside the release flow.

The model's engine is served by our OpenAI-compatible server (`serving.http.server`) on a free loopback port
in this process, stepped on the calling thread (where torch's ops run fastest: `run_beside_engine`), and
`serving.loadgen.run` drives it from another thread: the shipped prompt set, a fixed concurrency
(`bench_concurrency` streaming clients in a closed loop), greedy, `ignore_eos` so every request decodes
exactly `bench_max_tokens` tokens. TTFT and TPOT are measured on the client side, as a user sees them.
"""

from __future__ import annotations

from pathlib import Path

from flows.data import MeasureConfig
from gates import metric_names as M

_STAT_FOR_QUANTILE = {50: "median", 95: "p95", 99: "p99"}


def benchmark(engine, config: MeasureConfig, name: str, out_json: Path) -> dict:
    from serving import SamplingParams
    from serving.http.server import build_app
    from serving.http.server_thread import ServerThread, run_beside_engine
    from serving.loadgen.run import run_serving_benchmark

    engine.generate(["warm up"], SamplingParams(max_tokens=2, temperature=0.0))  # first-call costs out
    app = build_app(engine, served_model_name=name, version=name, engine_thread=False)
    with ServerThread(app) as server:
        return run_beside_engine(app.state.engine_loop, lambda: run_serving_benchmark(
            server.url, name, output_json=out_json, num_requests=config.bench_requests,
            concurrency=config.bench_concurrency, max_tokens=config.bench_max_tokens, ignore_eos=True,
            temperature=0.0, seed=config.seed,
        ))


def to_metrics(report: dict) -> dict[str, float]:
    """The report (flattened by `serving.loadgen.run.flat_metrics`) in `gates.metric_names` names: latency
    quantiles in seconds, tokens/s."""
    from serving.loadgen.run import flat_metrics

    flat = flat_metrics(report, prefix="")
    metrics: dict[str, float] = {}
    for kind in M.LATENCY_KINDS:
        for q, stat in _STAT_FOR_QUANTILE.items():
            if f"{kind}_ms_{stat}" in flat:
                metrics[M.latency(kind, q)] = flat[f"{kind}_ms_{stat}"] / 1000.0
    if flat.get("tpot_ms_mean"):
        metrics[M.SERVE_DECODE_TPS] = 1000.0 / flat["tpot_ms_mean"]  # per-sequence decode speed
    ttft_mean, inputs = flat.get("ttft_ms_mean"), flat.get("total_input_tokens")
    if ttft_mean and inputs:
        # prompt tokens per second of time-to-first-token (queueing included, at this concurrency)
        metrics[M.SERVE_PREFILL_TPS] = inputs / (ttft_mean / 1000.0 * flat["completed"])
    metrics["serve/output_tps"] = flat["output_throughput"]
    metrics["serve/request_throughput"] = flat["request_throughput"]
    metrics["serve/failed"] = flat["failed"]
    return metrics
