"""`quantgate bench fleet-router`: the KV-aware RequestRouter vs Ray Serve's power-of-two router on
2 replicas, the same mixed long/short open-loop workload for both; TTFT p50/p99 per request kind.

KV is kept small on purpose (`--num-kv-blocks` per replica) so that a long request takes most of
a replica's cache: a router that only counts ongoing requests sends the next long one to a replica
that cannot admit it, where it (and what queues behind it) waits. Writes fleet_router.json + .png.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repo's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fmt, output_dir, pyplot, save_figure  # noqa: E402
from serving.loadgen.report import machine, write_json  # noqa: E402
from serving.loadgen.stats import summarize  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="quantgate bench fleet-router", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--routers", default="kv,pow2")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, requests/s")
    p.add_argument("--long-fraction", type=float, default=0.25)
    p.add_argument("--long-prompt", type=int, default=384)
    p.add_argument("--long-tokens", type=int, default=256)
    p.add_argument("--short-prompt", type=int, default=16)
    p.add_argument("--short-tokens", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=48, help="per replica (blocks of 16 tokens)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None, help="default: benchmarks/results/fleet_router")
    return p.parse_args(argv)


def workload(args: argparse.Namespace) -> list[tuple[float, dict, str]]:
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for i in range(args.num_requests):
        t += rng.expovariate(args.rate)
        long = rng.random() < args.long_fraction
        n_prompt, n_out = (args.long_prompt, args.long_tokens) if long else (args.short_prompt, args.short_tokens)
        prompt = [rng.randrange(200, 20000) for _ in range(n_prompt)]
        out.append((t, {"prompt": prompt, "max_tokens": n_out, "ignore_eos": True, "user": f"u{i}"},
                    "long" if long else "short"))
    return out


def run_router(router: str, work: list, args: argparse.Namespace, port: int) -> dict:
    from ray import serve

    from benchmarks.fleet_load import closed_loop, open_loop
    from fleet import app as fleet_app
    from fleet.config import FleetConfig

    config = FleetConfig.model_validate({
        "name": f"router-{router}", "served_model_name": "m", "port": port, "router": router,
        "routing_stats_period_s": 0.2,
        "versions": [{"name": "v", "model": args.model, "num_replicas": 2, "num_kv_blocks": args.num_kv_blocks,
                      "threads": args.threads, "dtype": args.dtype, "num_cpus": 0.5}]})
    info = fleet_app.up(config)
    asyncio.run(closed_loop(info["url"], {"prompt": [300] * 8, "max_tokens": 2}, 2, 4))  # warm both
    samples = asyncio.run(open_loop(info["url"], work))
    serve.delete(config.name)
    rows = {"router": router, "failed": sum(1 for s in samples if s.status != 200),
            "replicas_used": len({s.replica for s in samples if s.replica})}
    for kind in ("short", "long", "all"):
        picked = [s for s in samples if kind in ("all", s.kind)]
        rows[kind] = {"ttft_s": summarize([s.ttft for s in picked]), "latency_s": summarize([s.latency for s in picked])}
    rows["samples"] = [s.__dict__ for s in samples]
    return rows


def plot(results: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for res, color in zip(results, ("tab:blue", "tab:orange", "tab:green"), strict=False):
        for kind, marker in (("short", "o"), ("long", "s")):
            pts = [(s["sent"], s["ttft"]) for s in res["samples"] if s["kind"] == kind and s["ttft"] is not None]
            ax.scatter([a for a, _ in pts], [b for _, b in pts], s=10, marker=marker, color=color, alpha=0.7,
                       label=f"{res['router']} {kind}")
    ax.set_yscale("log")
    ax.set_xlabel("sent at (s)")
    ax.set_ylabel("TTFT (s)")
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    import ray
    from ray import serve

    from benchmarks.autoscale import _free_port
    from benchmarks.peers import cpu_info
    from fleet.app import connect

    args = parse_args(argv)
    out = output_dir(args.out_dir, "fleet_router")
    work = workload(args)
    port = _free_port()
    connect(None, 2)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        results = [run_router(r.strip(), work, args, port) for r in args.routers.split(",") if r.strip()]
    finally:
        serve.shutdown()
        ray.shutdown()
    report = {"machine": {**machine(), "cpu": cpu_info()}, "args": vars(args), "results": results,
              "note": "2 replicas on a shared 2-core machine: timings are noisy"}
    write_json(out / "fleet_router.json", report)
    plot(results, out / "fleet_router.png")
    print(f"{'router':<8}{'kind':<7}{'TTFT p50':>10}{'TTFT p99':>10}{'failed':>8}")
    for r in results:
        for kind in ("short", "long", "all"):
            t = r[kind]["ttft_s"]
            print(f"{r['router']:<8}{kind:<7}{fmt(t['p50'], 3):>10}{fmt(t['p99'], 3):>10}{r['failed']:>8}")
    print(f"wrote {out / 'fleet_router.json'} and {out / 'fleet_router.png'}")
    return report


if __name__ == "__main__":
    main()
