"""Tenant isolation, in wall-clock time: tenant B's latency while tenant A floods the engine.

B sends short requests one after another (closed loop: always one in flight). Three runs through the
same engine, side by side:
  alone  B by itself;
  fair   A's burst of long prompts arrives first, A and B are different tenants (round-robin
         admission, per-tenant prefill shares, prefill chunks capped by the measured step cost);
  fifo   the same burst, but A's and B's requests share one tenant: one FIFO, what fairness fixes.
Reports B's end-to-end latency, TTFT and TPOT percentiles per run, the p99 ratios against `alone`, and
how many of A's prompt tokens the engine got through meanwhile (the throughput isolation costs).

    quantgate bench tenants --model smollm2-135m --b-requests 24
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import fmt, output_dir, pyplot, save_figure
from serving.loadgen.report import machine, write_json
from serving.loadgen.stats import ratio, summarize

RUNS = ("alone", "fair", "fifo")
COLORS = {"alone": "#2ca02c", "fair": "#1f77b4", "fifo": "#d62728"}


@dataclass
class Workload:
    b_requests: int = 24
    b_prompt_tokens: int = 16
    b_max_tokens: int = 16
    a_requests: int = 24
    a_prompt_tokens: tuple[int, int] = (384, 512)
    a_max_tokens: int = 16
    seed: int = 0


@dataclass
class RunResult:
    name: str
    b_latency_s: list[float] = field(default_factory=list)
    b_ttft_s: list[float] = field(default_factory=list)
    b_tpot_s: list[float] = field(default_factory=list)
    a_prompt_tokens_done: int = 0
    seconds: float = 0.0


def run_one(engine, name: str, work: Workload, salt: int) -> RunResult:
    """One closed-loop pass of B's requests, with A's burst queued first unless `name` is 'alone'."""
    from serving import SamplingParams

    rng = random.Random(work.seed + salt)
    vocab = engine.vocab_size

    def tokens(n: int) -> list[int]:  # fresh random ids: nothing comes from the prefix cache
        return [rng.randrange(1000, vocab) for _ in range(n)]

    a_params = SamplingParams(max_tokens=work.a_max_tokens, temperature=0, ignore_eos=True)
    b_params = SamplingParams(max_tokens=work.b_max_tokens, temperature=0, ignore_eos=True)
    b_tenant = "a" if name == "fifo" else "b"
    a_ids = []
    if name != "alone":
        a_ids = [engine.add_request(tokens(rng.randint(*work.a_prompt_tokens)), a_params, tenant="a")
                 for _ in range(work.a_requests)]
    result = RunResult(name)
    prompt_tokens_before = engine.prompt_tokens
    start = time.perf_counter()
    for _ in range(work.b_requests):
        sent = time.perf_counter()
        rid = engine.add_request(tokens(work.b_prompt_tokens), b_params, tenant=b_tenant)
        final = None
        while final is None:
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    final = out
        done = time.perf_counter()
        m = final.metrics
        result.b_latency_s.append(done - sent)
        result.b_ttft_s.append(m.ttft)
        if len(m.token_times) > 1:
            result.b_tpot_s.append((m.token_times[-1] - m.token_times[0]) / (len(m.token_times) - 1))
    result.seconds = time.perf_counter() - start
    b_prompt_tokens = work.b_requests * work.b_prompt_tokens
    result.a_prompt_tokens_done = engine.prompt_tokens - prompt_tokens_before - b_prompt_tokens
    for rid in a_ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return result


def run(model: str = "smollm2-135m", device: str | None = None, dtype: str | None = None,
        work: Workload | None = None, slack: float | None = None, out_dir: str | Path | None = None,
        plots: bool = True) -> dict[str, Any]:
    from serving import LLMEngine, SamplingParams
    from serving.core.fairness import TenantFairness

    work = work or Workload()
    fairness = TenantFairness() if slack is None else TenantFairness(step_slack=slack)
    engine = LLMEngine.from_pretrained(model, device=device, dtype=dtype, enable_prefix_caching=False,
                                       tenant_fairness=fairness)
    warm = [random.Random(1).randrange(1000, engine.vocab_size) for _ in range(max(work.a_prompt_tokens))]
    engine.generate(warm, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # step costs learned

    results = {}
    for salt, name in enumerate(RUNS):
        results[name] = run_one(engine, name, work, salt)
        r = results[name]
        print(f"  {name:<6} B p50 {fmt(summarize(r.b_latency_s)['p50'])} s  p99 {fmt(summarize(r.b_latency_s)['p99'])} s"
              f"  ({r.seconds:.1f} s, A's prompt tokens done ~{r.a_prompt_tokens_done})")

    def p99(name: str) -> float | None:
        return summarize(results[name].b_latency_s)["p99"]

    report = {
        "benchmark": "tenants",
        "model": model,
        "machine": machine(),
        "workload": work.__dict__,
        "tenant_step_slack": fairness.step_slack,
        "shared_prefill_chunk": fairness.prefill_chunk,
        "decode_step_s": fairness.decode_step_seconds,
        "runs": {
            name: {
                "b_latency_s": summarize(r.b_latency_s),
                "b_ttft_s": summarize(r.b_ttft_s),
                "b_tpot_s": summarize(r.b_tpot_s),
                "seconds": r.seconds,
                "a_prompt_tokens_done": r.a_prompt_tokens_done,
            }
            for name, r in results.items()
        },
        "p99_ratio_fair_vs_alone": ratio(p99("fair"), p99("alone")),
        "p99_ratio_fifo_vs_alone": ratio(p99("fifo"), p99("alone")),
    }
    out = output_dir(out_dir, "tenants")
    write_json(out / "tenants.json", report)
    if plots:
        _plot(results, out / "tenants.png", model)
    print(f"B's p99 latency: fair {fmt(report['p99_ratio_fair_vs_alone'], 2)}x alone, "
          f"one FIFO {fmt(report['p99_ratio_fifo_vs_alone'], 2)}x alone  -> {out / 'tenants.json'}")
    return report


def _plot(results: dict[str, RunResult], path: Path, model: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for name, r in results.items():
        data = sorted(r.b_latency_s)
        ax.step(data, [(i + 1) / len(data) for i in range(len(data))], where="post", label=name,
                color=COLORS[name])
    ax.set_xscale("log")
    ax.set_xlabel("tenant B request latency, s (log)")
    ax.set_ylabel("fraction of B's requests")
    ax.set_title(f"B's latency while A floods ({model})", fontsize=9)
    ax.legend()
    save_figure(fig, path)
