"""The release on a Ray cluster against the release in one process (issue 46): the Ray path's overhead.

Both run `quantgate release` at the demo's size (the demo's suites, 40 items per task, its policy, the default
methods, `--fresh`) as a child process under one throw-away `QUANTGATE_HOME` (the user's models and compiled
kernels linked in); the Ray runs add `--ray-address` of a local cluster this process starts
(`ray.cluster_utils.Cluster`, `--nodes` nodes of `--node-cpus` CPUs each, every node's QUANTGATE_HOME that home).
An untimed warm-up builds the variants first (`quantgate quantize` per method: quantize's own content-addressed
cache then serves both paths alike). Then `--pairs` pairs, the order alternating (one process first in even pairs, Ray first in odd),
each run's wall time from outside; per pair the ratio Ray / one process, and their geometric mean with a 95 %
t interval. The target: overhead <= 30 %.

    python -m benchmarks.ray_release [--pairs 3] [--limit 40] [--nodes 2] [--node-cpus 1]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the repo's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import output_dir  # noqa: E402
from benchmarks.peers import cpu_info  # noqa: E402
from benchmarks.release_memory import _link_models  # noqa: E402

TARGET = 0.30
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    from flows.cli import DEMO_LIMIT, DEMO_POLICY, DEMO_SUITES

    limit = args.limit or DEMO_LIMIT
    base = [sys.executable, "-m", "quantgate", "release", "--model", args.model, "--limit", str(limit),
            "--suites", args.suites or DEMO_SUITES, "--policy", str(DEMO_POLICY), "--fresh"]
    if args.methods:
        base += ["--methods", args.methods]
    home = Path(tempfile.mkdtemp(prefix="qg-ray-bench-"))
    temp = tempfile.mkdtemp(prefix="qgrb-", dir="/tmp")
    runs: list[dict[str, Any]] = []
    try:
        _link_models(home)
        env = {**os.environ, "QUANTGATE_HOME": str(home)}
        cluster = _cluster(args.nodes, args.node_cpus, home, temp)
        try:
            for method in _methods(args.methods):  # the variants built once: both paths then find them
                runs.append(_run([sys.executable, "-m", "quantgate", "quantize", "--model", args.model,
                                  "--method", method], env, f"warm-up: quantize {method}"))
            for pair in range(args.pairs):
                order = ["one", "ray"] if pair % 2 == 0 else ["ray", "one"]
                for kind in order:
                    cmd = base + (["--ray-address", cluster.address] if kind == "ray" else [])
                    runs.append({**_run(cmd, env, kind), "pair": pair})
        finally:
            cluster.shutdown()
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(temp, ignore_errors=True)
    report = _report(runs, args, limit)
    out = output_dir(args.out_dir, "ray_release") / "ray_release.json"
    import json

    out.write_text(json.dumps(report, indent=2))
    print(_table(report))
    print(f"wrote {out}")
    return report


def _methods(methods: str | None) -> list[str]:
    if methods:
        return [m for m in methods.split(",") if m]
    from flows.machine import resolve_device
    from quantize.methods import default_methods

    return list(default_methods(resolve_device(None)))


def _cluster(nodes: int, cpus: int, home: Path, temp: str):
    from ray.cluster_utils import Cluster

    env = {"QUANTGATE_HOME": str(home)}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "include_dashboard": False,
                                                      "temp_dir": temp, "env_vars": env})
    for _ in range(nodes - 1):
        c.add_node(num_cpus=cpus, env_vars=env)
    return c


def _run(cmd: list[str], env: dict[str, str], kind: str) -> dict[str, Any]:
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    outcome = next((line.strip() for line in done.stdout.splitlines() if "promoted" in line or "nothing" in line
                    or "rolled back" in line), "")
    print(f"{kind}: {wall:.1f} s, exit {done.returncode} {outcome}", flush=True)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
    return {"kind": kind, "wall_s": wall, "returncode": done.returncode, "outcome": outcome,
            "load_1min": os.getloadavg()[0]}


def _report(runs: list[dict[str, Any]], args, limit: int) -> dict[str, Any]:
    timed = [r for r in runs if "pair" in r]
    ratios = []
    for pair in sorted({r["pair"] for r in timed}):
        walls = {r["kind"]: r["wall_s"] for r in timed if r["pair"] == pair and r["returncode"] == 0}
        if {"one", "ray"} <= walls.keys():
            ratios.append(walls["ray"] / walls["one"])
    logs = [math.log(r) for r in ratios]
    mean = math.exp(statistics.fmean(logs)) if logs else None
    ci = None
    if len(logs) >= 2:
        half = T95.get(len(logs) - 1, 2.0) * statistics.stdev(logs) / math.sqrt(len(logs))
        ci = (math.exp(statistics.fmean(logs) - half), math.exp(statistics.fmean(logs) + half))
    return {"cpu": cpu_info(), "nodes": args.nodes, "node_cpus": args.node_cpus, "limit": limit,
            "model": args.model, "runs": runs, "ratios": ratios, "geomean_ratio": mean, "ci95": ci,
            "overhead": None if mean is None else mean - 1.0, "target_overhead": TARGET}


def _table(report: dict[str, Any]) -> str:
    cpu = report["cpu"]
    lines = [f"CPU: {cpu['model_name']} ({cpu['cpus']} CPUs; {' '.join(cpu['flags'])}); Ray: {report['nodes']} "
             f"nodes x {report['node_cpus']} CPU, {report['limit']} items per task",
             "| pair | one process s | Ray s | Ray / one |", "| ---: | ---: | ---: | ---: |"]
    for pair in sorted({r["pair"] for r in report["runs"] if "pair" in r}):
        walls = {r["kind"]: r["wall_s"] for r in report["runs"] if r.get("pair") == pair}
        ratio = walls["ray"] / walls["one"] if {"one", "ray"} <= walls.keys() else float("nan")
        lines.append(f"| {pair} | {walls.get('one', float('nan')):.1f} | {walls.get('ray', float('nan')):.1f} | "
                     f"{ratio:.3f} |")
    if report["geomean_ratio"] is not None:
        ci = report["ci95"]
        span = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
        lines.append(f"geometric mean Ray / one process {report['geomean_ratio']:.3f}{span}: overhead "
                     f"{report['overhead']:+.1%} (target <= {TARGET:.0%})")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantgate bench ray-release", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="alternated pairs of releases (default 3)")
    p.add_argument("--limit", type=int, default=None, help="items per task (default: the demo's)")
    p.add_argument("--suites", default=None, help="default: the demo's")
    p.add_argument("--methods", default=None, help="default: the device's default methods")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--nodes", type=int, default=2, help="Ray nodes on this machine (default 2)")
    p.add_argument("--node-cpus", type=int, default=1, help="CPUs per node (default 1: the 2 cores split)")
    p.add_argument("--out-dir", default=None)
    return p


if __name__ == "__main__":
    main()
