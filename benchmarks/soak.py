"""Bounded soak: steady load on a `quantgate serve` process for minutes, watching for drift.

A closed loop of N clients streams completions back to back (a refused request waits its Retry-After and
goes again) while a sampler reads the server process's RSS and /metrics every few seconds. Per time
window: requests completed, TTFT / TPOT / E2E percentiles, RSS. The report says how much memory and
latency drifted from the first window (after warm-up) to the last, and accounts for every request:
sent = completed + rejected (429/503) + failed, with lost = 0. At the end the load stops, the KV cache
must drain to 0 blocks, and the server is stopped with SIGTERM (its drain is timed).

    python -m benchmarks.soak --model smollm2-135m --duration 600 --concurrency 4
    python -m benchmarks.soak --model /path/to/tiny --duration 120 --num-kv-blocks 64   # a quick one

Writes soak.json and soak.png to benchmarks/results/soak (or --out-dir). Not run in CI: minutes long.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from benchmarks.common import fmt, output_dir, pyplot, save_figure
from serving.http.serve_process import spawn_serve, stop_serve, wait_serve_up
from serving.loadgen.client import session, stream_completion
from serving.loadgen.prompts import load_prompts
from serving.loadgen.report import machine, write_json
from serving.loadgen.stats import summarize


@dataclass
class Record:
    start: float  # seconds since the soak started
    end: float = 0.0
    status: int | None = None
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.tokens < 2:
            return None
        return (self.end - self.start - self.ttft) / (self.tokens - 1)


@dataclass
class Sample:
    t: float
    rss_mib: float | None
    kv_usage: float | None
    running: float | None
    waiting: float | None
    preemptions: float | None


@dataclass
class Soak:
    records: list[Record] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)


# ---- the server --------------------------------------------------------------------------------------
def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    extra = ["--served-model-name", "soak", "--log-level", "warning", "--max-waiting", str(args.max_waiting)]
    for flag, value in (("--num-kv-blocks", args.num_kv_blocks), ("--threads", args.threads),
                        ("--device", args.device)):
        if value is not None:
            extra += [flag, str(value)]
    proc, url = spawn_serve(args.model, log, *extra)
    try:
        wait_serve_up(proc, url, log, args.startup_timeout)
    except RuntimeError as exc:
        proc.kill()
        raise SystemExit(str(exc)) from None
    return proc, url


def _scrape(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


# ---- the load ----------------------------------------------------------------------------------------
async def _request(client, url: str, body: dict, t0: float) -> tuple[Record, float]:
    """One streamed completion; returns its record and how long to wait before the next (Retry-After)."""
    rec = Record(start=time.monotonic() - t0)
    got = await stream_completion(client, f"{url}/v1/completions", body)
    rec.end = time.monotonic() - t0
    rec.status, rec.error, rec.tokens = got.status, got.error and got.error[:200], got.output_tokens
    rec.ttft = got.ttft
    rec.ok = got.status == 200 and got.error is None
    wait = 0.0
    if got.status != 200:
        wait = got.retry_after if got.retry_after is not None else 1.0
    return rec, wait


async def _load(url: str, args: argparse.Namespace, soak: Soak, proc_pid: int | None) -> None:
    prompts = load_prompts(args.prompts)
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    stop_at = t0 + args.duration

    async def client_loop(client) -> None:
        while time.monotonic() < stop_at:
            body = {"prompt": rng.choice(prompts), "max_tokens": rng.randint(*args.max_tokens), "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            rec, wait = await _request(client, url, body, t0)
            soak.records.append(rec)
            if wait:
                await asyncio.sleep(wait)

    async def sampler(client) -> None:
        import psutil

        proc = psutil.Process(proc_pid) if proc_pid else None
        while True:
            t = time.monotonic() - t0
            rss = proc.memory_info().rss / 2**20 if proc else None
            try:
                async with client.get(f"{url}/metrics") as r:
                    m = _scrape(await r.text())
            except (aiohttp.ClientError, TimeoutError):
                m = {}
            soak.samples.append(Sample(t, rss, m.get("quantgate:kv_cache_usage_perc"),
                                       m.get("quantgate:num_requests_running"),
                                       m.get("quantgate:num_requests_waiting"),
                                       m.get("quantgate:num_preemptions_total")))
            if time.monotonic() >= stop_at:
                return
            await asyncio.sleep(args.sample_every)

    async with session(args.concurrency + 2, args.request_timeout) as client:
        from rich.progress import Progress

        with Progress() as bar:
            task = bar.add_task(f"soak: {args.concurrency} clients", total=args.duration)

            async def tick() -> None:
                while time.monotonic() < stop_at:
                    bar.update(task, completed=min(args.duration, time.monotonic() - t0),
                               description=f"soak: {sum(r.ok for r in soak.records)} done")
                    await asyncio.sleep(1)

            await asyncio.gather(sampler(client), tick(), *(client_loop(client) for _ in range(args.concurrency)))


# ---- the report --------------------------------------------------------------------------------------
def windows(soak: Soak, width: float, duration: float) -> list[dict]:
    out = []
    n = max(1, int(duration // width))
    for i in range(n):
        lo, hi = i * width, (i + 1) * width
        done = [r for r in soak.records if r.ok and lo <= r.end < hi]
        samples = [s for s in soak.samples if lo <= s.t < hi]
        rss = [s.rss_mib for s in samples if s.rss_mib is not None]
        out.append({
            "start_s": lo, "end_s": hi, "completed": len(done),
            "requests_per_s": len(done) / width,
            "ttft_s": summarize(r.ttft for r in done),
            "tpot_s": summarize(r.tpot for r in done),
            "e2e_s": summarize(r.end - r.start for r in done),
            "rss_mib": max(rss) if rss else None,
            "kv_usage_max": max((s.kv_usage or 0.0 for s in samples), default=None),
        })
    return out


def _drift(first: float | None, last: float | None) -> float | None:
    return None if first is None or last is None or first == 0 else (last - first) / first


def _slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope (per second) of (t, y) points."""
    if len(points) < 2:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return None if var == 0 else sum((t - mt) * (y - my) for t, y in points) / var


def report(soak: Soak, args: argparse.Namespace, after: dict) -> dict:
    recs = soak.records
    completed = [r for r in recs if r.ok]
    rejected = [r for r in recs if r.status in (429, 503)]
    failed = [r for r in recs if not r.ok and r.status not in (429, 503)]
    wins = windows(soak, args.window, args.duration)
    steady = [w for w in wins if w["start_s"] >= args.warmup and w["completed"]] or wins
    first, last = steady[0], steady[-1]
    rss = [(s.t, s.rss_mib) for s in soak.samples if s.rss_mib is not None and s.t >= args.warmup]
    slope = _slope(rss)
    return {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "machine": machine(),
        "totals": {"sent": len(recs), "completed": len(completed), "rejected": len(rejected),
                   "failed": len(failed), "lost": len(recs) - len(completed) - len(rejected) - len(failed),
                   "failures": sorted({r.error or str(r.status) for r in failed})[:10],
                   "output_tokens": sum(r.tokens for r in completed)},
        "overall": {"ttft_s": summarize(r.ttft for r in completed), "tpot_s": summarize(r.tpot for r in completed),
                    "e2e_s": summarize(r.end - r.start for r in completed)},
        "drift": {
            "first_window_s": first["start_s"], "last_window_s": last["start_s"],
            "ttft_p50": _drift(first["ttft_s"]["p50"], last["ttft_s"]["p50"]),
            "ttft_p99": _drift(first["ttft_s"]["p99"], last["ttft_s"]["p99"]),
            "tpot_p50": _drift(first["tpot_s"]["p50"], last["tpot_s"]["p50"]),
            "tpot_p99": _drift(first["tpot_s"]["p99"], last["tpot_s"]["p99"]),
            "requests_per_s": _drift(first["requests_per_s"], last["requests_per_s"]),
            "rss_mib_first": rss[0][1] if rss else None, "rss_mib_last": rss[-1][1] if rss else None,
            "rss_mib_max": max((y for _, y in rss), default=None),
            "rss_mib_per_min": None if slope is None else slope * 60,
        },
        "after_load": after,
        "windows": wins,
        "samples": [asdict(s) for s in soak.samples],
    }


def plot(result: dict, path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    samples = result["samples"]
    axes[0].plot([s["t"] for s in samples if s["rss_mib"]], [s["rss_mib"] for s in samples if s["rss_mib"]])
    axes[0].set_ylabel("server RSS (MiB)")
    mid = [(w["start_s"] + w["end_s"]) / 2 for w in result["windows"]]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
        for q, style in (("p50", "-"), ("p99", "--")):
            axes[1].plot(mid, [None if w[key][q] is None else w[key][q] * 1000 for w in result["windows"]], style,
                         label=f"{label} {q}")
    axes[1].set_ylabel("ms")
    axes[1].set_yscale("log")
    axes[1].legend(fontsize=8)
    axes[2].plot(mid, [w["requests_per_s"] for w in result["windows"]], label="completed req/s")
    axes[2].plot([s["t"] for s in samples], [s["kv_usage"] or 0 for s in samples], label="KV usage (0..1)")
    axes[2].set_xlabel("seconds")
    axes[2].legend(fontsize=8)
    t = result["totals"]
    fig.suptitle(f"soak: {t['sent']} sent, {t['completed']} completed, {t['rejected']} rejected, "
                 f"{t['failed']} failed, {t['lost']} lost")
    return save_figure(fig, path)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f} %"


def run(args: argparse.Namespace) -> dict:
    out = output_dir(args.out_dir, "soak")
    proc, pid = None, args.pid
    if args.url:
        url = args.url.rstrip("/")
    else:
        proc, url = start_server(args, out / "server.log")
        pid = proc.pid
    try:
        soak = Soak()
        asyncio.run(_load(url, args, soak, pid))
        import httpx

        deadline, drained = time.monotonic() + 60, None  # the load stopped: every KV block must come back
        while time.monotonic() < deadline:
            m = _scrape(httpx.get(f"{url}/metrics", timeout=10).text)
            if not m.get("quantgate:kv_cache_usage_perc") and not m.get("quantgate:num_requests_running"):
                drained = m
                break
            time.sleep(0.5)
        after = {"kv_cache_usage_perc": None if drained is None else drained.get("quantgate:kv_cache_usage_perc"),
                 "drained": drained is not None,
                 "preemptions_total": None if drained is None else drained.get("quantgate:num_preemptions_total")}
    finally:
        sigterm_exit_s = None if proc is None else stop_serve(proc, signal.SIGTERM, 60.0)
    after["sigterm_exit_s"] = sigterm_exit_s
    result = report(soak, args, after)
    write_json(out / "soak.json", result)
    plot(result, out / "soak.png")
    t, d = result["totals"], result["drift"]
    print(f"sent {t['sent']}  completed {t['completed']}  rejected {t['rejected']}  failed {t['failed']}  "
          f"lost {t['lost']}")
    print(f"drift first->last steady window: TTFT p50 {_pct(d['ttft_p50'])}, p99 {_pct(d['ttft_p99'])}; "
          f"TPOT p50 {_pct(d['tpot_p50'])}, p99 {_pct(d['tpot_p99'])}; req/s {_pct(d['requests_per_s'])}")
    print(f"server RSS {fmt(d['rss_mib_first'], 0)} -> {fmt(d['rss_mib_last'], 0)} MiB (max {fmt(d['rss_mib_max'], 0)}, "
          f"slope {fmt(d['rss_mib_per_min'], 2)} MiB/min); KV drained after load: {after['drained']}; "
          f"SIGTERM exit {fmt(after['sigterm_exit_s'], 1)} s")
    print(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")
    return result


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="model reference to serve (ignored with --url)")
    p.add_argument("--url", default=None, help="soak an already running server instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's pid, to watch its RSS")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds left out of the drift figures")
    p.add_argument("--window", type=float, default=30.0, help="seconds per report window")
    p.add_argument("--sample-every", type=float, default=2.0, help="seconds between RSS / metrics samples")
    p.add_argument("--concurrency", type=int, default=4, help="clients in the closed loop")
    p.add_argument("--max-tokens", type=_range, default=(16, 64), metavar="N|LO-HI")
    p.add_argument("--prompts", default=None, help="JSONL prompts (default: serving/loadgen/prompts.jsonl)")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-waiting", type=int, default=256)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.duration <= 0 or args.window <= 0 or args.concurrency < 1:
        raise SystemExit("--duration and --window must be > 0 and --concurrency >= 1")
    if args.threads:  # the server subprocess inherits it
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
