"""`quantgate bench autoscale`: cold start per variant and per-replica service rate on a real Ray fleet
(1-2 replicas), then a discrete-event simulation of a larger fleet driven by those numbers under a
bursty trace (quiet, then a 10x burst): scale-from-zero reactive vs reactive vs warm pool vs predictive.

Writes autoscale.json and autoscale.png (TTFT over time with the replica count, one panel per policy).
`--measured FILE` reuses an earlier run's measurements and only simulates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repo's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fmt, output_dir, pyplot, save_figure  # noqa: E402
from benchmarks.fleet_sim import Policy, ReplicaModel, Trace, simulate, summarize_result  # noqa: E402
from quantgate.ports import free_port  # noqa: E402
from serving.loadgen.report import machine, write_json  # noqa: E402
from serving.loadgen.stats import summarize  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="quantgate bench autoscale", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="smollm2-135m",
                   help="comma-separated model references (alias, HF dir, variant dir); cold start for each")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight per replica while measuring")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=24, help="requests per replica for the service rate")
    p.add_argument("--max-replicas-measured", type=int, default=2, choices=(1, 2))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray")
    p.add_argument("--measured", default=None, metavar="JSON", help="skip the Ray part: take its numbers from this file")
    p.add_argument("--sim-max-replicas", type=int, default=16)
    p.add_argument("--burst-factor", type=float, default=10.0)
    p.add_argument("--quiet-load", type=float, default=0.5, help="quiet arrival rate as a fraction of one replica's rate")
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--timeout-s", type=float, default=30.0, help="a request waiting longer is rejected")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None, help="default: benchmarks/results/autoscale")
    return p.parse_args(argv)


# ---- the real fleet ------------------------------------------------------------------------------
def _config(name: str, model: str, replicas: int, args: argparse.Namespace):
    from fleet.config import FleetConfig

    return FleetConfig.model_validate({
        "name": name, "served_model_name": "m", "port": args.port,
        "versions": [{"name": "v", "model": model, "num_replicas": replicas, "threads": args.threads,
                      "dtype": args.dtype, "num_cpus": 0.5, "max_num_seqs": max(64, 2 * args.concurrency)}]})


def measure_cold_start(model: str, args: argparse.Namespace) -> dict:
    """serve.run -> replica ready -> first token through the ingress, and the replica's own phases."""
    from ray import serve

    from benchmarks.fleet_load import closed_loop
    from fleet import app as fleet_app

    name = "coldstart"
    started = time.perf_counter()
    info = fleet_app.up(_config(name, model, 1, args))
    ready_s = time.perf_counter() - started
    samples, _ = asyncio.run(closed_loop(info["url"], {"prompt": "Hello", "max_tokens": 1}, 1, 1))
    first_token_s = time.perf_counter() - started
    phases = max(fleet_app.live_replicas(name), key=lambda r: r["started"])["cold_start"]
    serve.delete(name)
    return {"model": model, "deploy_to_ready_s": ready_s, "first_token_s": first_token_s,
            "first_request_ttft_s": samples[0].ttft, "phases": phases}


def measure_service(model: str, replicas: int, args: argparse.Namespace) -> dict:
    from ray import serve

    from benchmarks.fleet_load import closed_loop
    from fleet import app as fleet_app

    name = f"rate{replicas}"
    info = fleet_app.up(_config(name, model, replicas, args))
    body = {"prompt": "Tell me a story about a lighthouse keeper.", "max_tokens": args.max_tokens,
            "ignore_eos": True}
    light, _ = asyncio.run(closed_loop(info["url"], {**body, "max_tokens": 1}, 1, 6))
    samples, wall = asyncio.run(closed_loop(info["url"], body, args.concurrency * replicas,
                                            args.requests * replicas))
    serve.delete(name)
    ok = [s for s in samples if s.status == 200]
    return {"replicas": replicas, "concurrency": args.concurrency * replicas, "requests": len(samples),
            "ok": len(ok), "wall_s": wall, "rate_rps": len(ok) / wall, "rate_per_replica_rps": len(ok) / wall / replicas,
            "latency_s": summarize([s.latency for s in ok]), "ttft_s": summarize([s.ttft for s in ok]),
            "light_ttft_s": summarize([s.ttft for s in light[1:]]), "max_tokens": args.max_tokens,
            "replicas_used": len({s.replica for s in ok})}


def measure(args: argparse.Namespace) -> dict:
    import ray
    from ray import serve

    from fleet.app import connect

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.port = free_port()
    connect(None, args.num_cpus)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        cold = [measure_cold_start(v, args) for v in variants]
        service = [measure_service(variants[0], n, args) for n in range(1, args.max_replicas_measured + 1)]
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"cold_start": cold, "service": service, "rate_variant": variants[0]}


# ---- the simulated fleet -------------------------------------------------------------------------
def replica_model(measured: dict) -> ReplicaModel:
    one = measured["service"][0]
    cold = next(c for c in measured["cold_start"] if c["model"] == measured["rate_variant"])
    return ReplicaModel(cold_start_s=cold["first_token_s"], slots=one["concurrency"],
                        service_s=one["latency_s"]["mean"], prefill_s=one["light_ttft_s"]["p50"])


def policies(model: ReplicaModel, trace: Trace, max_replicas: int) -> list[Policy]:
    from fleet.schedule import Schedule

    burst = min(max_replicas, math.ceil(1.2 * trace.quiet_rate * trace.burst_factor / model.rate))
    quiet = max(1, math.ceil(trace.quiet_rate / model.rate))
    sched = Schedule(((0.0, quiet), (trace.burst_start, burst), (trace.burst_start + trace.burst_s, quiet)),
                     period_s=trace.duration + 3600)
    target = model.slots
    return [
        Policy("reactive from zero", 0, max_replicas, target),
        Policy(f"reactive, warm pool {quiet}", quiet, max_replicas, target),
        Policy(f"warm pool {burst}", burst, max_replicas, target),
        Policy("predictive", quiet, max_replicas, target, schedule=sched, lead_s=model.cold_start_s + 5),
    ]


def run_simulation(measured: dict, args: argparse.Namespace) -> tuple[list[dict], list, ReplicaModel, Trace]:
    model = replica_model(measured)
    trace = Trace(quiet_rate=args.quiet_load * model.rate, burst_factor=args.burst_factor, seed=args.seed)
    results = [simulate(trace, model, p, timeout_s=args.timeout_s) for p in policies(model, trace, args.sim_max_replicas)]
    return [summarize_result(r, args.slo_ttft_s) for r in results], results, model, trace


def plot(results: list, trace: Trace, slo: float, path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.4 * len(results)), sharex=True)
    top = max((t for r in results for t in r.ttft if t is not None), default=1.0) * 1.5
    most = max((r + s for res in results for _, r, s in res.replicas), default=1) + 1
    for ax, res in zip(axes, results, strict=True):
        served = [(a, t) for a, t in zip(res.arrivals, res.ttft, strict=True) if t is not None]
        rejected = [a for a, t in zip(res.arrivals, res.ttft, strict=True) if t is None]
        ax.scatter([a for a, _ in served], [t for _, t in served], s=3, color="tab:blue", label="TTFT")
        if rejected:
            ax.scatter(rejected, [0] * len(rejected), s=6, marker="x", color="tab:red", label="rejected")
        ax.axhline(slo, color="gray", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_ylim(0.05, top)
        ax.set_ylabel("TTFT s")
        ax.axvspan(trace.burst_start, trace.burst_start + trace.burst_s, color="orange", alpha=0.12)
        ax2 = ax.twinx()
        ax2.step([t for t, *_ in res.replicas], [r for _, r, _ in res.replicas], color="tab:green", lw=1.2,
                 where="post", label="ready replicas")
        ax2.step([t for t, *_ in res.replicas], [r + s for _, r, s in res.replicas], color="tab:green", lw=0.8,
                 ls=":", where="post", label="+ starting")
        ax2.set_ylim(0, most)
        ax2.set_ylabel("replicas")
        ax.set_title(res.policy, fontsize=9)
    axes[0].legend(loc="upper left", fontsize=7)
    axes[-1].set_xlabel("seconds (burst shaded)")
    return save_figure(fig, path)


def print_report(report: dict) -> None:
    for c in report["measured"]["cold_start"]:
        p = c["phases"]
        print(f"cold start {c['model']}: first token {c['first_token_s']:.1f} s after deploy (ready {c['deploy_to_ready_s']:.1f} s;"
              f" imports {p.get('import_s', 0):.2f}, read {p['read_s']:.2f}, load {p['load_s']:.2f}, tokenizer {p['tokenizer_s']:.2f}, KV {p['kv_alloc_s']:.3f},"
              f" first forward {p['first_forward_s']:.3f})")
    for s in report["measured"]["service"]:
        print(f"{s['replicas']} replica(s): {s['rate_rps']:.2f} req/s ({s['rate_per_replica_rps']:.2f} per replica), "
              f"latency mean {s['latency_s']['mean']:.2f} s, light-load TTFT {s['light_ttft_s']['p50']:.3f} s")
    print(f"{'policy':<26}{'p50 TTFT':>10}{'p99 TTFT':>10}{'rejected':>10}{'over SLO':>10}{'replica-s':>11}{'max':>5}")
    for r in report["policies"]:
        print(f"{r['policy']:<26}{fmt(r['ttft_s']['p50'], 2):>10}{fmt(r['ttft_s']['p99'], 2):>10}"
              f"{r['rejected']:>10}{r['over_slo']:>10}{r['replica_seconds']:>11.0f}{r['max_replicas']:>5}")


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.peers import cpu_info

    args = parse_args(argv)
    out = output_dir(args.out_dir, "autoscale")
    measured = json.loads(Path(args.measured).read_text())["measured"] if args.measured else measure(args)
    rows, results, model, trace = run_simulation(measured, args)
    report = {"machine": {**machine(), "cpu": cpu_info()}, "args": vars(args), "measured": measured,
              "sim_model": model.__dict__ | {"rate_rps": model.rate}, "trace": trace.__dict__, "policies": rows,
              "note": "measured on a shared 2-core machine: timings are noisy; the simulation assumes replicas on "
                      "their own cores (no contention between them)"}
    write_json(out / "autoscale.json", report)
    plot(results, trace, args.slo_ttft_s, out / "autoscale.png")
    print_report(report)
    print(f"wrote {out / 'autoscale.json'} and {out / 'autoscale.png'}")
    return report


if __name__ == "__main__":
    main()
