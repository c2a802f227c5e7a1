"""`quantgate bench release-memory`: the release's memory plan (flows/memory_plan.py) against what a real release
holds, stage by stage.

Runs `quantgate release` in a child process under a throw-away `QUANTGATE_HOME` (the model linked in, not
copied) and watches it from outside: every SAMPLE_SECONDS the anonymous memory (`RssAnon`) and the whole
resident set (`VmRSS`: file pages too, e.g. mmap'd weights) summed over the release and every process it
started (the quantize child, Prefect's and MLflow's servers where they run apart), each sample tagged with the
stage the release's own progress lines say is running. Prints, per planned stage, the planned peak beside
the measured ones and their ratio (the issue's target: within ±20 %), writes release_memory.json and a plot.

    quantgate bench release-memory [--model smollm2-135m] [--methods int8wo,int4-awq] [--limit 20]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the repo's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import fmt, pyplot, save_figure, write_rows_report  # noqa: E402
from benchmarks.peers import cpu_info  # noqa: E402

SAMPLE_SECONDS = 0.1
TOLERANCE = 0.20
# The release's progress lines (flows/progress.py) -> the plan's stage names (flows/memory_plan.py).
STAGES = ((re.compile(r"^resolve \S+ \.\.\.$"), "resolve"),
          (re.compile(r"snapshot the source .* \.\.\.$"), "snapshot"),
          (re.compile(r"quantize \S+ -> (\S+) \.\.\.$"), "quantize {0}"),
          (re.compile(r"(\S+): load, benchmark, evaluate \.\.\.$"), "measure {0}"),
          (re.compile(r"paired speed: .* \.\.\.$"), "speed"),
          (re.compile(r"canary: .* \.\.\.$"), "canary"))
DONE = re.compile(r" done in [0-9.]+ s$| failed")


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    planned = _plan(args.model, methods, args.policy)
    planned_s, pilot = _time_plan(args, methods) if args.time_plan else ({}, {})
    with tempfile.TemporaryDirectory(prefix="qg-release-memory-") as home:
        _link_models(Path(home))
        samples, wall = _watched_release(args, Path(home))
        speed_wall_s, measure_s, canary_s = _speed_walls(Path(home)), _measure_parts(Path(home)), _canary_parts(Path(home))
    rows = _rows(planned, samples, planned_s)
    time_only = _time_only(planned, samples, planned_s)
    _print(rows, args.model, wall)
    for name, row in time_only.items():
        print(f"{name:<24} (time only){'':>44} {fmt(row['planned_s'], 0):>9} {row['seconds']:>7.0f}")
    path = write_rows_report(args.out_dir, "release_memory", rows, _plot, args.plots, model=args.model,
                             methods=methods, limit=args.limit, suites=args.suites, cpu=cpu_info(),
                             wall_s=round(wall, 1), sample_seconds=SAMPLE_SECONDS, tolerance=TOLERANCE,
                             release_peak_anon_gb=round(max((s[2] for s in samples), default=0) / 1e9, 3),
                             release_peak_rss_gb=round(max((s[3] for s in samples), default=0) / 1e9, 3),
                             timeline=_timeline(samples), pilot=pilot, speed_wall_s=speed_wall_s,
                             measure_parts_s=measure_s, canary_parts_s=canary_s, time_only=time_only)
    print(f"wrote {path}")
    return {"rows": rows, "path": str(path)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantgate bench release-memory", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="model reference (in QUANTGATE_HOME/models or a path)")
    p.add_argument("--methods", default="int8wo,int4-awq")
    p.add_argument("--suites", default="arith,safety", help="eval suites/tasks (the release's --suites)")
    p.add_argument("--limit", type=int, default=20, help="items per task")
    p.add_argument("--policy", default=None, help="gate policy (default: the release's)")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--no-time-plan", dest="time_plan", action="store_false",
                   help="skip the pilot that plans each stage's time (gates/time_plan.py)")
    return p


def _plan(model: str, methods: list[str], policy: str | None) -> dict[str, int]:
    from flows.memory_plan import plan_for
    from flows.release import read_policy

    plan = plan_for(model, methods, read_policy(policy))
    if plan.not_planned:
        raise SystemExit(f"no memory plan for {model}: {plan.not_planned}")
    return {s.name: s.total for s in plan.stages}


def _time_plan(args, methods: list[str]) -> tuple[dict[str, float | None], dict[str, Any]]:
    """Each stage's planned seconds, from a pilot of the engine on the model here (as `release --plan` prints),
    and the pilot's figures."""
    from dataclasses import asdict, replace

    from flows.release import read_policy
    from flows.time_shape import release_shape
    from gates import time_plan as T
    from gates.pilot import pilot
    from gates.release_plan import with_suites
    from quantgate.allocator import release_engine_memory

    policy, suites = read_policy(args.policy), [s for s in args.suites.split(",") if s]
    shape = release_shape(policy, methods, suites, args.limit, snapshot=True)  # the release's home is new:
    # no champion, and the model lies outside it (linked in)
    shape = replace(shape, measure=with_suites(shape.measure, suites, args.limit))
    timing = pilot(args.model, list(shape.measure.items), policy, release=shape)
    release_engine_memory()  # the pilot's engines are gone: their heap goes back before the release starts
    rows = T.stage_times(policy, shape, timing)
    for r in rows:
        print(f"time plan: {r.stage}: {r.seconds and round(r.seconds)} s ({r.counted})", file=sys.stderr)
    figures = {"load_s": timing.load_s, "round_s": timing.round_s, "prefill_tps": timing.prefill_tps,
               "decode_s": timing.decode_s, "item_s": timing.item_s, "setup_s": timing.setup_s,
               "quantize": {label: asdict(q) for label, q in timing.quantize.items()},
               "canary_up_s": timing.canary_up_s, "canary_request_s": timing.canary_request_s,
               "source_hash_s": timing.source_hash_s, "snapshot_s": timing.snapshot_s,
               "serving_wave_s": timing.serving_wave_s, "first_wave_s": timing.first_wave_s,
               "variants": {label: asdict(cut) for label, cut in timing.variants.items()}}
    return {r.stage: r.seconds for r in rows}, figures


def _speed_walls(home: Path) -> dict[str, Any]:
    """The speed stage's own clock (flows.speed_rounds writes it into speed.json): each load, warm-up and
    model's point, per pair; {} when the release did not reach the stage."""
    found = sorted(home.rglob("speed.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(found[-1].read_text()).get("wall_s", {}) if found else {}


def _canary_parts(home: Path) -> dict[str, float]:
    """The canary stage's parts and each version's load in seconds (flows/canary_stage.py writes them into
    canary.json); {} without one."""
    found = sorted(home.rglob("canary.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        return {}
    record = json.loads(found[-1].read_text())
    loads = {f"load {v}": record[v]["load_s"] for v in ("champion", "challenger") if "load_s" in record.get(v, {})}
    return {**record.get("seconds", {}), **loads}


def _measure_parts(home: Path) -> dict[str, dict[str, float]]:
    """Each measure stage's parts in seconds (flows/measuring.py writes seconds.json), by model."""
    parts = {}
    for path in home.rglob("seconds.json"):
        record = json.loads(path.read_text())
        parts[record["model"]] = record["seconds"]
    return parts


def _link_models(home: Path) -> None:
    """The user's models and compiled kernels, linked into the throw-away home (converted sources are GBs:
    never copied; kernels are keyed by their sources, so a link only saves the builds)."""
    from quantgate import settings

    models = Path(settings.home()) / "models"
    (home / "models").mkdir(parents=True)
    for entry in models.iterdir() if models.is_dir() else ():
        (home / "models" / entry.name).symlink_to(entry.resolve())
    if (Path(settings.home()) / "kernels").is_dir():
        (home / "kernels").symlink_to((Path(settings.home()) / "kernels").resolve())


def _watched_release(args, home: Path) -> tuple[list[tuple], float]:
    """(seconds, stage, tree anon bytes, tree RSS bytes, processes) samples of one release, and its wall time."""
    cmd = [sys.executable, "-m", "quantgate", "release", "--model", args.model, "--methods", args.methods,
           "--suites", args.suites, "--limit", str(args.limit), "--approve", "auto"]
    cmd += ["--policy", args.policy] if args.policy else []
    env = {**os.environ, "QUANTGATE_HOME": str(home)}  # the child's environment only
    start = time.perf_counter()
    child = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1)
    stage, samples, done = ["setup"], [], threading.Event()

    def sample() -> None:
        while not done.is_set():
            anon, rss, processes = _tree_memory(child.pid)
            samples.append((time.perf_counter() - start, stage[0], anon, rss, processes))
            done.wait(SAMPLE_SECONDS)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for line in child.stderr:
        sys.stderr.write(line)
        stage[0] = _stage_of(line.rstrip("\n").removeprefix("[quantgate] "), stage[0])
    child.wait()
    done.set()
    sampler.join()
    if child.returncode:  # a failed or killed release still shows what its stages held until then
        print(f"the release failed ({child.returncode}); its output is above; the stages it ran:", file=sys.stderr)
    return samples, time.perf_counter() - start


def _stage_of(line: str, current: str) -> str:
    for pattern, name in STAGES:
        found = pattern.search(line)
        if found:
            return name.format(*found.groups())
    return "between stages" if DONE.search(line) and current != "setup" else current


def _tree_memory(pid: int) -> tuple[int, int, list[tuple[int, str, int]]]:
    """Anonymous memory (`RssAnon`) and the resident set (`VmRSS`) of `pid` and its descendants, bytes (a process
    gone meanwhile counts 0), and each process's (pid, command, anon bytes). Read from /proc/<pid>/status, which
    the kernel keeps as counters: smaps_rollup (`Pss_Anon`) walks the page tables under the process's mmap lock,
    24 ms a read at 3 GB, and at 10 reads a second it slowed the release it watched (the speed stage's baseline
    rounds 1.28x a quiet run's, Qwen2.5-Coder-0.5B). A child whose command line is still its parent's has not
    exec'd yet: its pages are the parent's (a fork or vfork on its way to exec) and count 0."""
    anon = rss = 0
    stack, processes = [(pid, None)], []
    while stack:
        current, parent_command = stack.pop()
        try:
            command = Path(f"/proc/{current}/cmdline").read_bytes()
            own = own_rss = 0
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    own_rss = int(line.split()[1]) * 1024
                elif line.startswith("RssAnon:"):
                    own = int(line.split()[1]) * 1024
            if command == parent_command:
                own = own_rss = 0
            anon, rss = anon + own, rss + own_rss
            processes.append((current, command.replace(b"\0", b" ").decode(errors="replace")[:120], own))
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [(int(c), command) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return anon, rss, processes


def _rows(planned: dict[str, int], samples: list[tuple], planned_s: dict[str, float | None]
          ) -> list[dict[str, Any]]:
    rows = []
    for name, plan_bytes in planned.items():
        seen = [s for s in samples if s[1] == name]
        at_peak = max(seen, key=lambda s: s[2]) if seen else None
        anon = at_peak[2] if at_peak else 0
        rss = max((s[3] for s in seen), default=0)
        ratio = plan_bytes / anon if anon else None
        rows.append({"stage": name, "planned_gb": round(plan_bytes / 1e9, 3), "peak_anon_gb": round(anon / 1e9, 3),
                     "peak_rss_gb": round(rss / 1e9, 3), "planned_over_anon": ratio and round(ratio, 3),
                     "within_tolerance": ratio is not None and abs(ratio - 1) <= TOLERANCE,
                     "seconds": _span(samples, name), "ran": bool(seen),
                     "planned_s": planned_s.get(name) and round(planned_s[name], 1),
                     "at_peak": [{"pid": p, "command": c, "anon_gb": round(a / 1e9, 3)}
                                 for p, c, a in sorted(at_peak[4], key=lambda x: -x[2])] if at_peak else []})
    return rows


def _time_only(planned: dict[str, int], samples: list[tuple], planned_s: dict[str, float | None]
               ) -> dict[str, dict[str, float | None]]:
    """The stages the time plan costs and the memory plan does not (resolve, snapshot): planned and measured s."""
    out = {}
    for name in (n for n in planned_s if n not in planned):
        out[name] = {"planned_s": planned_s[name] and round(planned_s[name], 1), "seconds": _span(samples, name)}
    return out


def _span(samples: list[tuple], stage: str) -> float:
    """Seconds from the stage's first sample to its last (0 where it never ran)."""
    seen = [s[0] for s in samples if s[1] == stage]
    return round(seen[-1] - seen[0], 1) if seen else 0.0


def _timeline(samples: list[tuple]) -> list[dict[str, Any]]:
    """The samples a second apart (each second's largest), for the plot and the JSON."""
    seconds: dict[int, tuple] = {}
    for sample in samples:
        second = int(sample[0])
        if second not in seconds or sample[2] > seconds[second][2]:
            seconds[second] = sample
    return [{"s": s[0] // 1, "stage": s[1], "anon_gb": round(s[2] / 1e9, 3), "rss_gb": round(s[3] / 1e9, 3)}
            for _, s in sorted(seconds.items())]


def _print(rows: list[dict[str, Any]], model: str, wall: float) -> None:
    print(f"\n{model}: release {wall:.0f} s; planned peak per stage vs measured (anonymous, and all resident)")
    print(f"{'stage':<24} {'planned GB':>10} {'anon GB':>8} {'RSS GB':>8} {'plan/anon':>9}  within ±20 %"
          f"  {'planned s':>9} {'s':>7} {'plan/s':>7}")
    for r in rows:
        verdict = "-" if not r["ran"] else ("yes" if r["within_tolerance"] else "NO")
        time_ratio = r["planned_s"] / r["seconds"] if r["planned_s"] and r["seconds"] else None
        print(f"{r['stage']:<24} {r['planned_gb']:>10.2f} {r['peak_anon_gb']:>8.2f} {r['peak_rss_gb']:>8.2f} "
              f"{fmt(r['planned_over_anon'], 2):>9}  {verdict:<12} {fmt(r['planned_s'], 0):>9} "
              f"{r['seconds']:>7.0f} {fmt(time_ratio, 2):>7}")
    print("\nat each stage's peak, the processes holding the most anonymous memory:")
    for r in rows:
        top = ", ".join(f"{p['anon_gb']:.2f} GB {p['command'].split(' -m ')[-1][:40]!r}" for p in r["at_peak"][:3])
        print(f"  {r['stage']:<22} {top}")


def _plot(rows: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    ran = [r for r in rows if r["ran"]]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(ran)), 4))
    x = range(len(ran))
    ax.bar([i - 0.27 for i in x], [r["planned_gb"] for r in ran], 0.27, label="planned")
    ax.bar(list(x), [r["peak_anon_gb"] for r in ran], 0.27, label="measured anon")
    ax.bar([i + 0.27 for i in x], [r["peak_rss_gb"] for r in ran], 0.27, label="measured RSS")
    ax.set_xticks(list(x), [r["stage"] for r in ran], rotation=30, ha="right")
    ax.set_ylabel("peak GB")
    ax.set_title("release memory: plan vs measured per stage")
    ax.legend()
    return save_figure(fig, path)


if __name__ == "__main__":
    main()
