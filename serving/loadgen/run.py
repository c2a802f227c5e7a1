"""An async load generator for any OpenAI-compatible server: ours, or another engine's.

Requests go out as Poisson arrivals at a given rate (or all at once), optionally capped at a fixed
number in flight (`concurrency`: a closed loop of N clients), each streaming its completion over SSE.
Measured on the client side: TTFT (request sent → first text), ITL (between text chunks), TPOT
((E2E − TTFT) / (output tokens − 1)), E2E; request and output-token throughput; goodput, the
requests/s that met an SLO (TTFT ≤ a and TPOT ≤ b).

The transport is the shared streaming client (serving/loadgen/client.py, aiohttp), as for the soak and
the canary: it drives well over 500 requests/s against a stub that answers at once (see
tests/test_benchmarks_serving.py), so the generator is not what the benchmark measures.

    quantgate bench serve --url http://127.0.0.1:8000 --num-requests 200 --rate 4

From Python (the release flow calls this for each variant):

    from serving.loadgen.run import run_serving_benchmark, flat_metrics
    result = run_serving_benchmark("http://127.0.0.1:8000", "smollm2-135m", num_requests=64, request_rate=2)
    mlflow.log_metrics(flat_metrics(result))
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from serving.loadgen.client import session, stream_completion
from serving.loadgen.prompts import load_prompts
from serving.loadgen.report import ProgressBar, machine, write_json
from serving.loadgen.stats import ratio, summarize

DEFAULT_SLO_TTFT_MS = 2000.0
DEFAULT_SLO_TPOT_MS = 200.0


@dataclass
class RequestResult:
    index: int
    ok: bool = False
    status: int | None = None
    error: str | None = None
    send_time: float = 0.0  # seconds after the benchmark start
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0  # the server's usage count when it sends one, else the text chunks seen
    prompt_tokens: int | None = None
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def completions_url(url: str, chat: bool = False) -> str:
    """Accept a base URL (`http://host:port`), one ending in `/v1`, or a full endpoint URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"url must look like http://host:port, got {url!r}")
    path = parts.path.rstrip("/")
    if path.endswith("/completions"):
        return url
    if not path.endswith("/v1"):
        path += "/v1"
    return f"{parts.scheme}://{parts.netloc}{path}/{'chat/completions' if chat else 'completions'}"


def build_requests(
    num_requests: int,
    *,
    prompts: list[str] | None = None,
    max_tokens: int | tuple[int, int] = 64,
    seed: int = 0,
) -> list[tuple[str, int]]:
    """(prompt, max_tokens) per request: the prompt set shuffled and cycled, lengths fixed or drawn."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1, got {num_requests}")
    lo, hi = (max_tokens, max_tokens) if isinstance(max_tokens, int) else max_tokens
    if not 1 <= lo <= hi:
        raise ValueError(f"max_tokens must be a positive integer or a range lo <= hi, got {max_tokens!r}")
    rng = random.Random(seed)
    pool = list(prompts) if prompts is not None else load_prompts()
    if not pool:
        raise ValueError("the prompt list is empty")
    order: list[str] = []
    while len(order) < num_requests:
        batch = pool[:]
        rng.shuffle(batch)
        order.extend(batch)
    return [(order[i], rng.randint(lo, hi)) for i in range(num_requests)]


def arrival_gaps(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Poisson arrivals: exponential gaps with mean 1/rate seconds; rate=inf sends all at once."""
    if not rate > 0:
        raise ValueError(f"request rate must be positive (requests/s) or inf, got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed + 1)
    return [0.0] + [rng.expovariate(rate) for _ in range(num_requests - 1)]


async def _send(client, url: str, payload: dict[str, Any], chat: bool, result: RequestResult, t0: float) -> None:
    result.send_time = time.perf_counter() - t0
    got = await stream_completion(client, url, payload, chat)
    result.status, result.error = got.status, got.error
    if got.error is not None:
        return
    result.ttft, result.e2e, result.itls, result.text = got.ttft, got.e2e, got.itls, got.text
    result.output_tokens, result.prompt_tokens = got.output_tokens, got.prompt_tokens
    result.ok = result.ttft is not None or result.output_tokens == 0
    if not result.ok:
        result.error = "the stream ended without any text"


def _workload(requests: list | None, prompts: list[str] | str | Path | None, num_requests: int,
              max_tokens: int | tuple[int, int], seed: int, chat: bool) -> tuple[list, int | None]:
    """(prompt, max_tokens) per request and how many distinct prompts they come from (None: the
    caller gave the requests themselves)."""
    if requests is not None:
        if not requests:
            raise ValueError("the request list is empty")
        if chat and any(not isinstance(p, str) for p, _ in requests):
            raise ValueError("token-id prompts need /v1/completions, not chat")
        return list(requests), None
    prompt_list = prompts if isinstance(prompts, list) else load_prompts(prompts)
    return build_requests(num_requests, prompts=prompt_list, max_tokens=max_tokens, seed=seed), len(prompt_list)


async def async_run_serving_benchmark(
    url: str,
    model: str | None = None,
    *,
    num_requests: int = 100,
    request_rate: float = math.inf,
    concurrency: int | None = None,
    max_tokens: int | tuple[int, int] = 64,
    prompts: list[str] | str | Path | None = None,
    ignore_eos: bool = True,
    chat: bool = False,
    temperature: float = 0.0,
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS,
    slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    seed: int = 0,
    progress: bool = False,
    details: bool = False,
    requests: list[tuple[str | list[int], int]] | None = None,
    min_tokens: bool = False,
) -> dict[str, Any]:
    """`requests` gives the workload itself, (prompt text or token ids, max_tokens) per request, instead
    of drawing it from `prompts`; `min_tokens` also sends min_tokens = max_tokens (vLLM's way of forcing
    the length; servers that reject unknown fields, like ours, need only ignore_eos)."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    endpoint = completions_url(url, chat)
    requests, num_prompts = _workload(requests, prompts, num_requests, max_tokens, seed, chat)
    num_requests = len(requests)
    if num_prompts is None:  # the caller's own requests
        num_prompts, max_tokens = num_requests, (min(n for _, n in requests), max(n for _, n in requests))
    gaps = arrival_gaps(num_requests, request_rate, seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results = [RequestResult(i) for i in range(num_requests)]
    async with session(concurrency, timeout_s, headers) as client:
        if model is None:
            model = await _first_model(client, endpoint)
        gate = asyncio.Semaphore(concurrency) if concurrency else None
        bar = ProgressBar(num_requests, "requests") if progress else None

        async def one(i: int) -> None:
            prompt, n = requests[i]
            payload: dict[str, Any] = {"model": model, "max_tokens": n, "temperature": temperature,
                                       "stream": True, "stream_options": {"include_usage": True},
                                       **({"messages": [{"role": "user", "content": prompt}]} if chat
                                          else {"prompt": prompt}),
                                       **({"ignore_eos": True} if ignore_eos else {}),
                                       **({"min_tokens": n} if min_tokens else {})}
            if gate:
                async with gate:
                    await _send(client, endpoint, payload, chat, results[i], t0)
            else:
                await _send(client, endpoint, payload, chat, results[i], t0)
            if bar:
                bar.advance(1)

        tasks = []
        t0 = time.perf_counter()
        next_at = 0.0
        for i, gap in enumerate(gaps):
            next_at += gap
            delay = t0 + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if bar:
            bar.stop()
    config = {
        "url": endpoint, "model": model, "num_requests": num_requests,
        "request_rate": None if math.isinf(request_rate) else request_rate,
        "arrivals": "all at once" if math.isinf(request_rate) else "poisson", "concurrency": concurrency,
        "max_tokens": max_tokens, "ignore_eos": ignore_eos, "chat": chat, "temperature": temperature,
        "seed": seed, "num_prompts": num_prompts, "min_tokens": min_tokens,
    }
    report = summarize_results(results, duration, slo_ttft_ms, slo_tpot_ms)
    report = {"benchmark": "serving", "config": config, "machine": machine(), **report}
    if details:
        report["requests"] = [
            {k: v for k, v in asdict(r).items() if k not in ("itls", "text")} | {"tpot": r.tpot} for r in results
        ]
    return report


def summarize_results(
    results: list[RequestResult], duration: float, slo_ttft_ms: float, slo_tpot_ms: float
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    if not ok:
        first = failed[0].error if failed else "no requests"
        raise ValueError(f"none of the {len(results)} requests succeeded; the first failure: {first}")
    good = [
        r for r in ok
        if r.ttft is not None and r.ttft * 1000 <= slo_ttft_ms and (r.tpot is None or r.tpot * 1000 <= slo_tpot_ms)
    ]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_counts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    errors: dict[str, int] = {}
    for r in failed:
        errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    return {
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration,
        "total_output_tokens": out_tokens,
        "total_input_tokens": sum(prompt_counts) if prompt_counts else None,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "goodput": len(good) / duration,  # requests/s that met the SLO
        "goodput_fraction": ratio(len(good), len(results)),
        "ttft_ms": _stats(r.ttft for r in ok),
        "tpot_ms": _stats(r.tpot for r in ok),
        "itl_ms": _stats(itl for r in ok for itl in r.itls),
        "e2e_ms": _stats(r.e2e for r in ok),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10]),
    }


def _stats(values) -> dict[str, float | None]:
    s = summarize(values, scale=1000.0)
    return {k: s[k] for k in ("mean", "median", "p95", "p99", "max")} | {"count": s["count"]}


def run_serving_benchmark(url: str, model: str | None = None, *, output_json: str | Path | None = None,
                          **kwargs) -> dict[str, Any]:
    """Run the load generator to completion and return its report (see `async_run_serving_benchmark`
    for the options); also writes it to `output_json` when given. Safe to call from inside a running
    event loop (it then runs in a worker thread). Raises ValueError if no request succeeded."""
    coro_args = (url, model)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        report = asyncio.run(async_run_serving_benchmark(*coro_args, **kwargs))
    else:
        box: dict[str, Any] = {}

        def worker() -> None:
            try:
                box["report"] = asyncio.run(async_run_serving_benchmark(*coro_args, **kwargs))
            except BaseException as exc:  # re-raised in the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=worker, name="serving-benchmark")
        thread.start()
        thread.join()
        if "error" in box:
            raise box["error"]
        report = box["report"]
    if output_json:
        report["json"] = str(write_json(output_json, report))
    return report


def flat_metrics(report: dict[str, Any], prefix: str = "serve_") -> dict[str, float]:
    """The report's numbers as flat `name: float` pairs (e.g. `serve_ttft_ms_p99`), for MLflow: the one
    flattener (the release flow names them for the gates in flows/serving_harness.py)."""
    flat = {
        f"{prefix}{k}": float(report[k])
        for k in ("request_throughput", "output_throughput", "goodput", "goodput_fraction", "completed",
                  "failed", "duration_s", "total_input_tokens", "total_output_tokens")
        if report.get(k) is not None
    }
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        for stat, value in report[metric].items():
            if value is not None and stat != "count":
                flat[f"{prefix}{metric}_{stat}"] = float(value)
    return flat


async def _first_model(client, endpoint: str) -> str:
    models_url = endpoint[: endpoint.rindex("/v1/") + 3] + "/models"
    try:
        async with client.get(models_url) as response:
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]
    except Exception as exc:
        raise ValueError(f"no model given and {models_url} did not name one ({type(exc).__name__}: {exc})") from None


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = report["config"]
    console = Console()
    mode = f"concurrency {cfg['concurrency']}" if cfg["concurrency"] else cfg["arrivals"]
    if cfg["request_rate"] is not None:
        mode += f" at {cfg['request_rate']} req/s"
    console.print(f"[bold]{cfg['url']}[/bold] model {cfg['model']}: {cfg['num_requests']} requests, {mode}")
    console.print(
        f"completed {report['completed']}, failed {report['failed']} in {report['duration_s']:.2f} s: "
        f"{report['request_throughput']:.2f} req/s, {report['output_throughput']:.1f} output tok/s, "
        f"goodput {report['goodput']:.2f} req/s ({report['goodput_fraction']:.0%} within TTFT ≤ "
        f"{report['slo']['ttft_ms']:g} ms and TPOT ≤ {report['slo']['tpot_ms']:g} ms)"
    )
    table = Table("metric (ms)", "mean", "median", "p95", "p99", "max")
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = report[metric]
        table.add_row(metric.removesuffix("_ms").upper(), *("-" if s[k] is None else f"{s[k]:.1f}"
                                                           for k in ("mean", "median", "p95", "p99", "max")))
    console.print(table)
    for error, count in report["errors"].items():
        console.print(f"[red]{count}× {error}[/red]")
    if "json" in report:
        console.print(f"report: {report['json']}")

