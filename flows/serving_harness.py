"""The serving benchmark of one model inside the release flow.

Engine-level harness: the shipped prompt set (`benchmarks/prompts.jsonl`) at a fixed concurrency
(`bench_concurrency` requests in flight, a new one joins as one finishes, like a closed-loop client),
greedy, `ignore_eos` so every request decodes exactly `bench_max_tokens` tokens. TTFT and TPOT come from
the engine's per-request metrics; tokens/s from wall time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gates import metrics as M

if TYPE_CHECKING:
    from flows.release import MeasureConfig

PROMPTS = Path(__file__).resolve().parent.parent / "benchmarks" / "prompts.jsonl"


def prompts(n: int) -> list[str]:
    if not PROMPTS.is_file():
        raise RuntimeError(f"the serving benchmark's prompt set is missing: {PROMPTS}")
    items = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    if not items:
        raise RuntimeError(f"{PROMPTS} holds no prompts")
    return [items[i % len(items)] for i in range(n)]


def _quantiles(values: list[float]) -> dict[int, float]:
    from benchmarks.common import percentile

    return {q: percentile(values, q) for q in M.QUANTILES} if values else {}


def benchmark(engine, config: MeasureConfig) -> dict:
    from serving import SamplingParams

    params = SamplingParams(max_tokens=config.bench_max_tokens, temperature=0.0, ignore_eos=True)
    todo = list(enumerate(prompts(config.bench_requests)))
    in_flight: set[str] = set()
    done = []
    engine.generate(["warm up"], SamplingParams(max_tokens=2, temperature=0.0))
    start = time.perf_counter()
    while todo or in_flight:
        while todo and len(in_flight) < config.bench_concurrency:
            i, prompt = todo.pop(0)
            in_flight.add(engine.add_request(prompt, params, request_id=f"bench-{i}"))
        for out in engine.step():
            if out.finished:
                in_flight.discard(out.request_id)
                done.append(out)
    wall = time.perf_counter() - start
    ttft = [o.metrics.ttft for o in done if o.metrics.ttft is not None]
    tpot = [o.metrics.tpot for o in done if o.metrics.tpot]
    out_tokens = sum(len(o.token_ids) for o in done)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in done)
    decode_time = sum((o.metrics.tpot or 0.0) * max(len(o.token_ids) - 1, 0) for o in done)
    return {
        "harness": "engine",
        "requests": len(done),
        "concurrency": config.bench_concurrency,
        "max_tokens": config.bench_max_tokens,
        "wall_s": wall,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens_per_s": out_tokens / wall,
        # per-sequence decode speed, the number a user feels (1 / mean TPOT)
        "decode_tps": (sum(max(len(o.token_ids) - 1, 0) for o in done) / decode_time) if decode_time else None,
        "prefill_tps": prompt_tokens / sum(ttft) if ttft and sum(ttft) > 0 else None,
        "ttft_s": _quantiles(ttft),
        "tpot_s": _quantiles(tpot),
    }


def to_metrics(result: dict) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for kind in M.LATENCY_KINDS:
        for q, value in result[f"{kind}_s"].items():
            if value is not None:
                metrics[M.latency(kind, int(q))] = float(value)
    if result.get("decode_tps"):
        metrics[M.SERVE_DECODE_TPS] = float(result["decode_tps"])
    if result.get("prefill_tps"):
        metrics[M.SERVE_PREFILL_TPS] = float(result["prefill_tps"])
    metrics["serve/output_tps"] = float(result["output_tokens_per_s"])
    return metrics
