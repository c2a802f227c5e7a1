"""Our server beside the engines a user would pick instead, on one workload, one server at a time.

The workload (issue 19): 64 requests sent all at once, token-id prompts of 16–256 tokens, outputs of
8–256 tokens forced (ignore_eos, and min_tokens where the server takes it), streaming, drawn from a fixed
seed so that every server gets the identical requests. Every request must produce exactly its forced
token count (and report its prompt length) or its row is marked inexact and the run exits 1. Every
server gets one short warm-up request first. Same client for all: serving/loadgen.

    quantgate bench peers --serve quantgate --serve "quantgate:--dtype bfloat16" --serve vllm \\
        [--serve "vllm:--dtype float32"] [--serve llama] [--serve url=http://127.0.0.1:8000] [--reference 3]

Single-stream decode (batch 1), the model and its quantized forms beside llama.cpp's:

    quantgate bench peers --concurrency 1 --num-requests 8 --output-tokens 128-128 --serve quantgate \\
        --serve quantgate:int8wo --serve quantgate:int4wo --serve vllm --serve llama --serve llama:Q8_0 \\
        --serve llama:Q4_1

`--rounds N` starts every server first and then measures them in N interleaved rounds (each row: the
median of its rounds), so that a drift in the machine's speed falls on every server alike; the servers
not being measured sit idle beside the one that is.

Prints server | output tok/s | TTFT p50 | TTFT p99 | TPOT p50 (and tokens/s per stream, 1000 / TPOT p50)
with ratios to the reference row (default: the first vLLM row, else the first), the CPU's model name and
SIMD/AMX flags; writes peers.json, peers.md and peers.png under --out-dir (default benchmarks/results/peers).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the repo's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import fmt, output_dir, pyplot, save_figure, token_range  # noqa: E402
from benchmarks.peer_isa import ISAS, llama_dir_name  # noqa: E402
from benchmarks.peer_isa import check as check_isa  # noqa: E402
from benchmarks.peer_runs import Workload, run_one, run_rounds  # noqa: E402
from benchmarks.peer_servers import PeerPaths, ServerSpec, parse_serve  # noqa: E402
from quantgate.env import apply_defaults, home  # noqa: E402
from serving.loadgen.report import machine, write_json  # noqa: E402
from serving.loadgen.stats import ratio  # noqa: E402

CPU_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
             "amx_int8")
METRICS = (("output_tok_s", "output tok/s", 1), ("ttft_p50_ms", "TTFT p50 (ms)", 0),
           ("ttft_p99_ms", "TTFT p99 (ms)", 0), ("tpot_p50_ms", "TPOT p50 (ms)", 1))


def cpu_info(path: str = "/proc/cpuinfo") -> dict[str, Any]:
    """The CPU's model name and which of the flags that decide CPU inference speed it has."""
    name, flags = None, set()
    try:
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name is None:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"model_name": name, "flags": [f for f in CPU_FLAGS if f in flags], "cpus": len(os.sched_getaffinity(0))}


def pick_reference(rows: list[dict[str, Any]], reference: str | None) -> int | None:
    """A 1-based row number or a label substring; default: the first vLLM row, else the first row."""
    measured = [i for i, r in enumerate(rows) if "error" not in r]
    if reference is None:
        return next((i for i in measured if rows[i]["kind"] == "vllm"), measured[0] if measured else None)
    if reference.isdigit():
        i = int(reference) - 1
        if not 0 <= i < len(rows):
            raise ValueError(f"--reference {reference}: there are {len(rows)} servers")
        return i
    matches = [i for i, r in enumerate(rows) if reference in r["label"]]
    if not matches:
        raise ValueError(f"--reference {reference!r} matches no server label")
    return matches[0]


def add_ratios(rows: list[dict[str, Any]], ref: int | None) -> None:
    base = rows[ref] if ref is not None and "error" not in rows[ref] else {}
    for row in rows:
        if "error" not in row:
            row["ratios"] = {key: ratio(row[key], base.get(key)) for key, _, _ in METRICS}


def forced(report: dict[str, Any]) -> str:
    isa = report.get("forced_isa")
    return f" (every server forced onto {isa})" if isa else ""


def markdown(report: dict[str, Any]) -> str:
    cpu = report["cpu"]
    lines = [f"CPU: {cpu['model_name']}, {cpu['cpus']} CPUs, flags: {', '.join(cpu['flags']) or 'none'}{forced(report)}; "
             f"model: {report['model']}; {Workload(**report['workload']).describe()}; "
             f"reference: {report['reference']}", "",
             "| server | output tok/s | × ref | TTFT p50 | TTFT p99 | × ref | TPOT p50 | × ref | tok/s per stream "
             "| exact | load 1m |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error'].splitlines()[0][:120]} |||||||||| |")
            continue
        x = r["ratios"]
        lines.append(
            f"| {r['label']} | {r['output_tok_s']:.1f} | {fmt(x['output_tok_s'], 2)}× | {r['ttft_p50_ms'] / 1000:.2f} s "
            f"| {r['ttft_p99_ms'] / 1000:.2f} s | {fmt(x['ttft_p99_ms'], 2)}× | {r['tpot_p50_ms']:.1f} ms "
            f"| {fmt(x['tpot_p50_ms'], 2)}× | {1000 / r['tpot_p50_ms']:.1f} | {'yes' if r['exact'] else 'NO'} "
            f"| {r['load_avg_1m']['before']:.1f}/{r['load_avg_1m']['after']:.1f} |")
    return "\n".join(lines) + "\n"


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)  # a log file gets the whole table
    cpu, work = report["cpu"], report["workload"]
    console.print(f"[bold]{cpu['model_name']}[/bold], {cpu['cpus']} CPUs, flags: {' '.join(cpu['flags']) or 'none'}"
                  f"{forced(report)}")
    console.print(f"model {report['model']}; {Workload(**work).describe()}; reference: {report['reference']}")
    table = Table("server", "output tok/s", "×", "TTFT p50 s", "TTFT p99 s", "×", "TPOT p50 ms", "×",
                  "tok/s per stream", "exact", "start s", "load 1m")
    for r in report["rows"]:
        if "error" in r:
            table.add_row(r["label"], f"[red]{r['error'].splitlines()[0][:100]}[/red]", *[""] * 10)
            continue
        x = r["ratios"]
        table.add_row(r["label"], f"{r['output_tok_s']:.1f}", fmt(x["output_tok_s"], 2),
                      f"{r['ttft_p50_ms'] / 1000:.2f}", f"{r['ttft_p99_ms'] / 1000:.2f}", fmt(x["ttft_p99_ms"], 2),
                      f"{r['tpot_p50_ms']:.1f}", fmt(x["tpot_p50_ms"], 2), f"{1000 / r['tpot_p50_ms']:.1f}",
                      "yes" if r["exact"] else "[red]NO[/red]",
                      fmt(r.get("startup_s"), 0), f"{r['load_avg_1m']['before']:.1f}/{r['load_avg_1m']['after']:.1f}")
    console.print(table)
    for r in report["rows"]:
        for problem in r.get("problems", [])[:3]:
            console.print(f"[red]{r['label']}: {problem}[/red]")
    console.print(f"report: {report['json']}")


def plot(report: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    rows = [r for r in report["rows"] if "error" not in r]
    fig, axes = plt.subplots(1, 3, figsize=(15, 1.6 + 0.55 * len(rows)), sharey=True)
    labels = [r["label"] for r in rows]
    for ax, (key, title) in zip(axes, (("output_tok_s", "output tok/s (higher is better)"),
                                       ("ttft_p99_ms", "TTFT p99, ms (lower is better)"),
                                       ("tpot_p50_ms", "TPOT p50, ms (lower is better)")), strict=True):
        values = [r[key] for r in rows]
        colors = {"vllm": "tab:orange", "llama": "tab:green"}
        ax.barh(labels, values, color=[colors.get(r["kind"], "tab:blue") for r in rows])
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.0f}", va="center", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.invert_yaxis()
    cpu = report["cpu"]
    fig.suptitle(f"{report['model']} on {cpu['model_name']} ({cpu['cpus']} CPUs; {' '.join(cpu['flags'])})"
                 f"{forced(report)}",
                 fontsize=10)
    return save_figure(fig, path)


def run_peers(specs: list[ServerSpec], *, model: str = "smollm2-135m", served_name: str | None = None,
              vllm_venv: str | Path | None = None, llama_dir: str | Path | None = None,
              work: Workload | None = None, reference: str | None = None,
              out_dir: str | Path | None = None, startup_timeout_s: float = 900.0, timeout_s: float = 3600.0,
              plots: bool = True, progress: bool = False, rounds: int = 1, isa: str | None = None
              ) -> dict[str, Any]:
    """Each server alone, one after the other (rounds=1), or all up at once and measured in `rounds`
    interleaved rounds (the median of each figure); `isa` forces every server onto that instruction set."""
    if not specs:
        raise ValueError("name at least one server with --serve")
    from quantize.methods import get_method

    for spec in specs:  # an unknown variant fails here, before any server starts
        if spec.kind == "quantgate" and spec.weights:
            get_method(spec.weights)
    work = work or Workload()
    if work.concurrency is not None and work.concurrency < 1:
        raise ValueError(f"--concurrency must be at least 1, got {work.concurrency}")
    if rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {rounds}")
    out = output_dir(out_dir, "peers")
    check_isa(isa)
    peers = PeerPaths(Path(vllm_venv) if vllm_venv else home() / "peers" / "vllm",
                      Path(llama_dir) if llama_dir else home() / "peers" / llama_dir_name(isa), isa)
    report: dict[str, Any] = {"benchmark": "peers", "model": model, "workload": asdict(work), "rounds": rounds,
                              "cpu": cpu_info(), "forced_isa": isa, "machine": machine(), "rows": [],
                              "reference": None}
    common = dict(model=model, served_name=served_name or model, peers=peers, work=work, out=out,
                  startup_timeout_s=startup_timeout_s, timeout_s=timeout_s, progress=progress)
    if rounds > 1:
        report["rows"] = run_rounds(specs, rounds, **common)
    else:
        for spec in specs:  # one after the other: each server has the machine to itself
            report["rows"].append(run_one(spec, **common))
            write_json(out / "peers.json", report)  # what was measured survives a later failure
    ref = pick_reference(report["rows"], reference)
    report["reference"] = report["rows"][ref]["label"] if ref is not None else None
    add_ratios(report["rows"], ref)
    (out / "peers.md").write_text(markdown(report))
    if plots and any("error" not in r for r in report["rows"]):
        report["png"] = str(plot(report, out / "peers.png"))
    report["json"] = str(write_json(out / "peers.json", report))
    return report


def _pair(text: str) -> tuple[int, int]:
    return token_range(text, lowest=0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="quantgate bench peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", action="append", type=parse_serve, default=[], metavar="SPEC",
                   help="quantgate[:[VARIANT] ARGS] | vllm[:ARGS] | llama[:[TYPE] ARGS] | url=URL; repeat, "
                        "measured in this order")
    p.add_argument("--model", default="smollm2-135m", help="model reference (vLLM gets its plain HF dir)")
    p.add_argument("--served-model-name", default=None, help="the `model` requested (default: --model)")
    p.add_argument("--vllm-venv", default=None, help="default: $QUANTGATE_HOME/peers/vllm")
    p.add_argument("--llama-dir", default=None,
                   help="llama.cpp build (default: $QUANTGATE_HOME/peers/llama.cpp, or llama.cpp-ISA with --isa)")
    p.add_argument("--isa", default=None, choices=ISAS,
                   help="force every server (torch, quantgate's kernels, vLLM's kernel library; llama.cpp as built) "
                        "onto this instruction set: what a CPU with only it runs (benchmarks/peer_isa.py)")
    p.add_argument("--reference", default=None, help="row number or label substring (default: first vLLM row)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1,
                   help="start every server at once and measure them in N interleaved rounds (median of each "
                        "figure); default 1: each server alone, one after the other")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight at most (default: all at once; 1 measures single-stream decode)")
    p.add_argument("--prompt-tokens", type=_pair, default=(16, 256), metavar="LO-HI")
    p.add_argument("--output-tokens", type=_pair, default=(8, 256), metavar="LO-HI")
    p.add_argument("--token-ids", type=_pair, default=(1000, 49151), metavar="LO-HI", help="prompt token id range")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for a server to become healthy")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for one server's whole run")
    p.add_argument("--out-dir", default=None, help="default: benchmarks/results/peers")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    apply_defaults()
    args = parse_args(argv)
    if args.output_tokens[0] < 2 or args.prompt_tokens[0] < 1:
        raise ValueError("outputs need at least 2 tokens (TPOT) and prompts at least 1")
    work = Workload(args.num_requests, args.prompt_tokens, args.output_tokens, args.token_ids, args.seed,
                    args.concurrency)
    report = run_peers(args.serve, model=args.model, served_name=args.served_model_name, vllm_venv=args.vllm_venv,
                       llama_dir=args.llama_dir,
                       work=work, reference=args.reference, out_dir=args.out_dir,
                       startup_timeout_s=args.startup_timeout, timeout_s=args.timeout, plots=args.plots,
                       progress=sys.stdout.isatty(), rounds=args.rounds, isa=args.isa)
    print_report(report)
    return 0 if all("error" not in r and r["exact"] for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
