"""How `quantgate bench peers` measures: the workload, one server at a time (each has the machine to
itself) or every server up at once and measured in interleaved rounds (`--rounds N`: a drift in the
machine's speed falls on all servers alike; each figure is the median of the rounds), and the check that
every request produced exactly what it was sent for."""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.llama_peer import gguf_as
from benchmarks.peer_servers import PeerPaths, ServerSpec, started

MEDIAN_KEYS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "duration_s")


@dataclass
class Workload:
    num_requests: int = 64
    prompt_tokens: tuple[int, int] = (16, 256)
    output_tokens: tuple[int, int] = (8, 256)
    token_ids: tuple[int, int] = (1000, 49151)  # prompt ids drawn from [lo, hi]: no special tokens
    seed: int = 0
    concurrency: int | None = None  # requests in flight at most (None: all at once; 1: single-stream decode)

    def describe(self) -> str:
        when = "at once" if self.concurrency is None else f"{self.concurrency} at a time"
        return (f"{self.num_requests} requests {when}, prompts {self.prompt_tokens}, outputs {self.output_tokens} "
                f"forced, seed {self.seed}")

    def requests(self) -> list[tuple[list[int], int]]:
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.num_requests):
            prompt = [rng.randint(*self.token_ids) for _ in range(rng.randint(*self.prompt_tokens))]
            out.append((prompt, rng.randint(*self.output_tokens)))
        return out


def _warm_up(url: str, model: str, prompt: list[int]) -> bool:
    """One short request; returns whether the server takes min_tokens (ours refuses unknown fields)."""
    from serving.loadgen.run import run_serving_benchmark

    try:
        run_serving_benchmark(url, model, requests=[(prompt, 4)], min_tokens=True)
        return True
    except ValueError as exc:
        if "min_tokens" not in str(exc):
            raise
    run_serving_benchmark(url, model, requests=[(prompt, 4)])
    return False


def check_exact(requests: list[tuple[list[int], int]], records: list[dict[str, Any]]) -> list[str]:
    """Why any request did not produce exactly what it was sent for (empty when all did)."""
    problems = []
    for (prompt, n), r in zip(requests, records, strict=True):
        if not r["ok"]:
            problems.append(f"request {r['index']}: {r['error']}")
        elif r["output_tokens"] != n:
            problems.append(f"request {r['index']}: {r['output_tokens']} output tokens, forced {n}")
        elif r["prompt_tokens"] is None:
            problems.append(f"request {r['index']}: the server reported no usage (prompt/output counts)")
        elif r["prompt_tokens"] != len(prompt):
            problems.append(f"request {r['index']}: prompt of {r['prompt_tokens']} tokens, sent {len(prompt)}")
    return problems


def measure(url: str, model: str, work: Workload, timeout_s: float, progress: bool) -> dict[str, Any]:
    from serving.loadgen.run import run_serving_benchmark

    requests = work.requests()
    takes_min_tokens = _warm_up(url, model, requests[0][0][:16])
    report = run_serving_benchmark(url, model, requests=requests, ignore_eos=True, min_tokens=takes_min_tokens,
                                   concurrency=work.concurrency, timeout_s=timeout_s, progress=progress, details=True)
    problems = check_exact(requests, report["requests"])
    return {
        "output_tok_s": report["output_throughput"], "ttft_p50_ms": report["ttft_ms"]["median"],
        "ttft_p99_ms": report["ttft_ms"]["p99"], "tpot_p50_ms": report["tpot_ms"]["median"],
        "duration_s": report["duration_s"], "completed": report["completed"], "failed": report["failed"],
        "total_output_tokens": report["total_output_tokens"], "total_input_tokens": report["total_input_tokens"],
        "expected_output_tokens": sum(n for _, n in requests), "exact": not problems, "problems": problems[:10],
        "min_tokens": takes_min_tokens, "serving": report,
    }


def served_weights(spec: ServerSpec, model: str, peers: PeerPaths) -> Path | None:
    """What the spec's server loads: the model's HF dir, a quantgate variant's dir or a GGUF file."""
    from quantgate.models import resolve_model

    if spec.kind == "url":
        return None
    if spec.kind == "llama":
        return gguf_as(model, spec.weights or "F16", peers.llama_dir)
    if spec.kind == "quantgate" and spec.weights:
        import quantize

        return quantize.quantize(model, spec.weights)  # made once, then cached under QUANTGATE_HOME
    return resolve_model(model)


def run_one(spec: ServerSpec, *, model: str, served_name: str, peers: PeerPaths, work: Workload,
            out: Path, startup_timeout_s: float, timeout_s: float, progress: bool) -> dict[str, Any]:
    """The server of `spec` started, measured once and stopped."""
    row = _describe_row(spec)
    try:
        row["weights_path"] = served_weights(spec, model, peers)
        with started(spec, weights=row["weights_path"], served_name=served_name, peers=peers, log_dir=out / "logs",
                     startup_timeout_s=startup_timeout_s) as server:
            row |= {"url": server.url, "startup_s": server.startup_s, "pid": server.pid,
                    "log": server.log, "version": server.version}
            row |= _measured(server.url, served_name, work, timeout_s, progress)
    except Exception as exc:  # one server failing must not lose the others' figures
        _failed(row, exc)
    return row


def _describe_row(spec: ServerSpec) -> dict[str, Any]:
    return {"label": spec.label, "kind": spec.kind, "args": spec.args, "weights": spec.weights}


def _measured(url: str, served_name: str, work: Workload, timeout_s: float, progress: bool) -> dict[str, Any]:
    before = os.getloadavg()[0]  # other load on the machine distorts every figure: say how much
    figures = measure(url, served_name, work, timeout_s, progress)
    return figures | {"load_avg_1m": {"before": before, "after": os.getloadavg()[0]}}


def _failed(row: dict[str, Any], exc: Exception) -> None:
    row["error"] = f"{type(exc).__name__}: {exc}"
    row["traceback"] = traceback.format_exc()


def median_of_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One row's figures from its rounds: the median of each timing, exact only if every round was."""
    row = {key: statistics.median(r[key] for r in rounds) for key in MEDIAN_KEYS}
    row["exact"] = all(r["exact"] for r in rounds)
    row["problems"] = [p for r in rounds for p in r["problems"]][:10]
    row["min_tokens"] = rounds[0]["min_tokens"]
    row["load_avg_1m"] = {"before": rounds[0]["load_avg_1m"]["before"], "after": rounds[-1]["load_avg_1m"]["after"]}
    for key in ("completed", "failed", "total_output_tokens", "total_input_tokens", "expected_output_tokens"):
        row[key] = sum(r[key] for r in rounds)
    return row


def run_rounds(specs: list[ServerSpec], rounds: int, *, model: str, served_name: str, peers: PeerPaths,
               work: Workload, out: Path, startup_timeout_s: float, timeout_s: float, progress: bool
               ) -> list[dict[str, Any]]:
    """Every server started (and kept up, idle between its turns), then `rounds` rounds in which each is
    measured once, in order, on the same requests (round i draws them with seed + i); a row's figures are
    the median of its rounds (each round kept in `rounds`)."""
    rows = [_describe_row(spec) for spec in specs]
    urls: list[str | None] = []
    with contextlib.ExitStack() as stack:
        for spec, row in zip(specs, rows, strict=True):
            try:
                row["weights_path"] = served_weights(spec, model, peers)
                server = stack.enter_context(started(spec, weights=row["weights_path"], served_name=served_name,
                                                     peers=peers, log_dir=out / "logs",
                                                     startup_timeout_s=startup_timeout_s))
                row |= {"url": server.url, "startup_s": server.startup_s, "pid": server.pid, "log": server.log,
                        "version": server.version, "rounds": []}
                urls.append(server.url)
            except Exception as exc:  # one server failing must not lose the others' figures
                _failed(row, exc)
                urls.append(None)
        for i in range(rounds):  # fresh prompts each round (seed + i): no prefix-cache hits on the last round's
            this_round = replace(work, seed=work.seed + i)
            for row, url in zip(rows, urls, strict=True):
                if url is None or "error" in row:
                    continue
                try:
                    row["rounds"].append(_measured(url, served_name, this_round, timeout_s, progress))
                except Exception as exc:
                    _failed(row, exc)
    for row in rows:
        if "error" not in row:
            row |= median_of_rounds(row["rounds"])
    return rows
