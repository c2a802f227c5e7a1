"""Can tenant B tell, from its own TTFT, which prompts tenant A sent? The prefix-cache timing leak, measured.

Through our real server with two tenants' API keys, once per `--prefix-cache-scope`:
  1. A sends N long prompts P_i (512 tokens each by default), one at a time;
  2. B sends every P_i once and, interleaved in a random order within each pair, an unseen prompt Q_i of
     the same length, and measures its TTFT (request sent -> first SSE chunk) for each;
  3. B sends each of 4 prompts of its own twice (its own reuse must survive isolation); A resends P_1.
A threshold on TTFT is the attacker: "fast means A sent it". Reported per scope: the accuracy of the best
threshold fitted on all 2N answers (what an attacker who knows the labels could reach, optimistic), the
same classifier's leave-one-pair-out accuracy with a 95 % Wilson interval (the headline: chance is 50 %),
and the paired test "the faster of P_i and Q_i is P". Plus the cost of the SHA-256 chain per block against
Python's hash, and B's TTFT for its own prompts uncached vs cached (the prefix cache's speed benefit, kept).

    quantgate bench tenant-leak --pairs 32 --prompt-tokens 512
"""

from __future__ import annotations

import gc
import hashlib
import math
import os
import random
import struct
import time
import timeit
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import fmt, output_dir, pyplot, save_figure
from serving.loadgen.report import machine, write_json
from serving.loadgen.stats import ratio, summarize

KEYS = {"sk-bench-tenant-a": "a", "sk-bench-tenant-b": "b"}
METRICS_KEY = "sk-bench-metrics"
SCOPES = ("global", "tenant")
OWN_PROMPTS = 4
COLORS = {"P": "#d62728", "Q": "#1f77b4"}


@dataclass
class LeakWorkload:
    pairs: int = 32
    prompt_tokens: int = 512
    seed: int = 0


# ---- the attacker's statistics -----------------------------------------------------------------
def best_threshold(samples: list[tuple[float, bool]]) -> tuple[float, float, bool]:
    """(accuracy, threshold, below) of the best rule "label True iff value < t" (below) or "> t"."""
    data = sorted(samples)
    n, positives = len(data), sum(label for _, label in data)
    best = (max(positives, n - positives) / n, math.inf, positives >= n - positives)
    seen_pos = 0
    for k in range(1, n):  # cut between data[k-1] and data[k]
        seen_pos += data[k - 1][1]
        if data[k - 1][0] == data[k][0]:
            continue
        below = (seen_pos + (n - k) - (positives - seen_pos)) / n  # True below the cut, False above
        t = (data[k - 1][0] + data[k][0]) / 2
        for acc, is_below in ((below, True), (1 - below, False)):
            if acc > best[0]:
                best = (acc, t, is_below)
    return best


def leave_one_pair_out(pairs: list[tuple[float, float]]) -> int:
    """Correct answers of the threshold classifier fitted without each (P, Q) pair, on that pair."""
    correct = 0
    for i, (p, q) in enumerate(pairs):
        train = [(v, lab) for j, (a, b) in enumerate(pairs) if j != i for v, lab in ((a, True), (b, False))]
        _, t, below = best_threshold(train)
        correct += ((p < t) == below) + ((q < t) != below)
    return correct


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval for a proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def leak_figures(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    n = len(pairs)
    samples = [(v, lab) for p, q in pairs for v, lab in ((p, True), (q, False))]
    in_sample, threshold, _ = best_threshold(samples)
    loo = leave_one_pair_out(pairs)
    paired = sum(p < q for p, q in pairs)
    return {
        "answers": 2 * n,
        "best_threshold_accuracy_in_sample": in_sample,
        "threshold_s": threshold,
        "loo_accuracy": loo / (2 * n),
        "loo_ci95": wilson(loo, 2 * n),
        "paired_accuracy": paired / n,
        "paired_ci95": wilson(paired, n),
    }


# ---- hashing cost ------------------------------------------------------------------------------
def hash_cost(block_size: int = 16, number: int = 20000) -> dict[str, float]:
    """Microseconds per full block: the engine's SHA-256 chain step, BLAKE2b, and the old Python hash."""
    from serving.core.block_manager import block_digest

    tokens = tuple(range(1000, 1000 + block_size))
    parent = hashlib.sha256(b"parent").digest()
    pack = struct.Struct(f"<{block_size}I").pack
    candidates = {
        "sha256_chain_us": lambda: block_digest(parent, tokens),
        "blake2b_chain_us": lambda: hashlib.blake2b(parent + pack(*tokens), digest_size=32).digest(),
        "python_hash_us": lambda: hash((1234567890123, tokens)),
    }
    return {name: min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6 for name, fn in candidates.items()}


# ---- one scope through the server --------------------------------------------------------------
def _ttft(client, url: str, key: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed 1-token completion to its first SSE data line (read to the end)."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True, "stream": True}
    first = None
    start = time.perf_counter()
    with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: "):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("the server sent no data line")
    return first


def run_scope(model: str, scope: str, work: LeakWorkload, device: str | None, dtype: str | None) -> dict[str, Any]:
    import httpx

    from serving import LLMEngine
    from serving.http.server import ServerThread, build_app
    from serving.http.tenants import parse_tenants

    rng = random.Random(work.seed)
    blocks_per_prompt = -(-(work.prompt_tokens + 1) // 16)
    engine = LLMEngine.from_pretrained(model, device=device, dtype=dtype, prefix_cache_scope=scope,
                                       num_kv_blocks=(3 * work.pairs + 12) * blocks_per_prompt)  # nothing is evicted
    vocab = engine.vocab_size

    def fresh() -> list[int]:
        return [rng.randrange(1000, vocab) for _ in range(work.prompt_tokens)]

    p_prompts, q_prompts = [fresh() for _ in range(work.pairs)], [fresh() for _ in range(work.pairs)]
    own, warm = [fresh() for _ in range(OWN_PROMPTS)], [fresh() for _ in range(3)]
    (key_a, _), (key_b, _) = KEYS.items()
    app = build_app(engine, tenants=parse_tenants({"keys": KEYS, "metrics_key": METRICS_KEY}))
    pairs: list[tuple[float, float]] = []
    with ServerThread(app) as server, httpx.Client(timeout=300) as client:
        url = f"{server.url}/v1/completions"
        for prompt in warm:
            _ttft(client, url, key_b, prompt)
        for prompt in p_prompts:
            _ttft(client, url, key_a, prompt)
        probe_hits = engine.stats().prefix_cache_hit_tokens
        for p, q in zip(p_prompts, q_prompts, strict=True):
            order = [("P", p), ("Q", q)]
            rng.shuffle(order)
            got = {label: _ttft(client, url, key_b, prompt) for label, prompt in order}
            pairs.append((got["P"], got["Q"]))
        probe_hits = engine.stats().prefix_cache_hit_tokens - probe_hits
        own_ttft: list[tuple[float, float]] = []
        own_hits: list[int] = []
        for prompt in own:  # each of B's own prompts twice: uncached, then from B's own cache
            miss = _ttft(client, url, key_b, prompt)
            before = engine.stats().prefix_cache_hit_tokens
            own_ttft.append((miss, _ttft(client, url, key_b, prompt)))
            own_hits.append(engine.stats().prefix_cache_hit_tokens - before)
        before = engine.stats().prefix_cache_hit_tokens
        a_again = _ttft(client, url, key_a, p_prompts[0])
        a_hits = engine.stats().prefix_cache_hit_tokens - before
    result = {
        "scope": scope,
        "dtype": str(engine.model.get_input_embeddings().weight.dtype).removeprefix("torch."),
        "num_kv_blocks": engine.config.num_kv_blocks,
        "b_ttft_p_s": summarize(p for p, _ in pairs),
        "b_ttft_q_s": summarize(q for _, q in pairs),
        "pairs_s": pairs,
        "b_probe_cached_tokens": probe_hits,  # prompt tokens of B's probes served from the cache (A's, if any)
        **leak_figures(pairs),
        "b_own_ttft_uncached_s": summarize(m for m, _ in own_ttft),
        "b_own_ttft_cached_s": summarize(h for _, h in own_ttft),
        "b_own_cached_tokens": own_hits,
        "b_own_speedup": ratio(summarize(m for m, _ in own_ttft)["median"], summarize(h for _, h in own_ttft)["median"]),
        "a_again_ttft_s": a_again,
        "a_again_cached_tokens": a_hits,
    }
    del engine, app
    gc.collect()
    return result


def run(model: str = "smollm2-135m", device: str | None = None, dtype: str | None = None,
        work: LeakWorkload | None = None, scopes: tuple[str, ...] = SCOPES, out_dir: str | Path | None = None,
        plots: bool = True) -> dict[str, Any]:
    work = work or LeakWorkload()
    if work.pairs < 2 or work.prompt_tokens < 17:
        raise ValueError("need at least 2 pairs and prompts longer than one block")
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    runs = {}
    for scope in scopes:
        print(f"  scope {scope}: A sends {work.pairs} prompts, B probes them and {work.pairs} unseen ones ...")
        runs[scope] = run_scope(model, scope, work, device, dtype)
        print_scope(runs[scope])
    costs = hash_cost()
    report = {
        "benchmark": "tenant_leak",
        "model": model,
        "machine": machine(),
        "workload": work.__dict__,
        "seconds": time.perf_counter() - started,
        "load_average_1m": [load_before, os.getloadavg()[0]],  # other jobs on the machine add TTFT noise
        "hash_cost": {**costs, "blocks_per_prompt": work.prompt_tokens // 16,
                      "sha256_us_per_prompt": costs["sha256_chain_us"] * (work.prompt_tokens // 16)},
        "runs": runs,
    }
    out = output_dir(out_dir, "tenant_leak")
    write_json(out / "tenant_leak.json", report)
    if plots:
        _plot(runs, out / "tenant_leak.png", model, work)
    print(f"hash per block: SHA-256 chain {costs['sha256_chain_us']:.2f} us, BLAKE2b {costs['blake2b_chain_us']:.2f} us, "
          f"Python hash {costs['python_hash_us']:.2f} us  -> {out / 'tenant_leak.json'}")
    return report


def print_scope(r: dict[str, Any]) -> None:
    lo, hi = r["loo_ci95"]
    plo, phi = r["paired_ci95"]
    print(f"    ({r['dtype']}) B's TTFT median: P (A sent it) {fmt(r['b_ttft_p_s']['median'])} s, Q (unseen) "
          f"{fmt(r['b_ttft_q_s']['median'])} s")
    print(f"    threshold classifier: in-sample {r['best_threshold_accuracy_in_sample']:.1%}, leave-one-pair-out "
          f"{r['loo_accuracy']:.1%} [{lo:.1%}, {hi:.1%}] of {r['answers']}; paired {r['paired_accuracy']:.1%} "
          f"[{plo:.1%}, {phi:.1%}]")
    print(f"    B's probes took {r['b_probe_cached_tokens']} prompt tokens from the prefix cache")
    print(f"    B's own prompts twice: median TTFT {fmt(r['b_own_ttft_uncached_s']['median'])} s -> "
          f"{fmt(r['b_own_ttft_cached_s']['median'])} s ({fmt(r['b_own_speedup'], 1)}x, cached tokens "
          f"{r['b_own_cached_tokens']}); A's P_1 again: {r['a_again_cached_tokens']} cached tokens")


def _plot(runs: dict[str, dict[str, Any]], path: Path, model: str, work: LeakWorkload) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.4), sharey=True, squeeze=False)
    for ax, (scope, r) in zip(axes[0], runs.items(), strict=True):
        jitter = random.Random(0)
        for x, (label, values) in enumerate((("P", [p for p, _ in r["pairs_s"]]), ("Q", [q for _, q in r["pairs_s"]]))):
            ax.scatter([x + jitter.uniform(-0.15, 0.15) for _ in values], [v * 1000 for v in values], s=12,
                       color=COLORS[label], alpha=0.8)
        ax.set_xticks([0, 1], ["P: A sent it", "Q: unseen"])
        ax.set_yscale("log")
        ax.set_title(f"--prefix-cache-scope {scope}: attacker {r['loo_accuracy']:.0%}", fontsize=9)
    axes[0][0].set_ylabel("tenant B's TTFT, ms (log)")
    fig.suptitle(f"{work.pairs} pairs of {work.prompt_tokens}-token prompts ({model})", fontsize=9)
    save_figure(fig, path)
