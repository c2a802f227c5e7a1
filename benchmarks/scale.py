"""`quantgate bench scale`: peak memory and wall time of each stage (convert, quantize, load) against parameters.

Every stage runs in its own process, watched from outside: peak anonymous memory (the sum of `RssAnon` over
the process and its children, sampled every 50 ms: heap and tensors, not the mmap'd file pages that
`ru_maxrss` also counts), `ru_maxrss` from wait4, and wall time. Models: the Qwen2.5-Coder GGUFs
(scripts/real_models.sh puts them in QUANTGATE_HOME/models), converted once, and a random-weight model of
Llama-3-8B's shapes written as bf16 shards (benchmarks/scale_model.py where it exists). Prints a table,
writes scale.json and scale.png (peak anon and wall per stage against parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import fmt, pyplot, save_figure, write_rows_report

SAMPLE_SECONDS = 0.05
GGUFS = {"qwen-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}
RANDOM_8B = "llama3-8b-random"
LLAMA_PAIRS = (("int8wo", "Q8_0"), ("int4wo", "Q4_0"))


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = _earlier_rows(args.merge)
    for name in args.models if not args.merge else []:
        rows += _model_rows(name, args, workdir)
    _print(rows)
    beside_llama = llama_ratios(rows)
    for r in beside_llama:
        print(f"{r['model']}: {r['ours']} / llama-quantize {r['llama']} wall {r['wall_ratio']:.2f}x "
              f"[{r['low']:.2f}, {r['high']:.2f}] over {r['rounds']} rounds; peak anon {r['ours_anon_gb']:.2f} GB "
              f"vs {r['llama_anon_gb']:.2f} GB")
    path = write_rows_report(args.out_dir, "scale", rows, _plot, args.plots, cpu=_cpu_name(), beside_llama=beside_llama,
                             methods=args.methods, sample_seconds=SAMPLE_SECONDS)
    print(f"wrote {path}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantgate bench scale", description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=[*GGUFS, RANDOM_8B], help=f"of {[*GGUFS, RANDOM_8B]}")
    p.add_argument("--methods", nargs="+", default=["int8wo", "int4wo"])
    p.add_argument("--workdir", default="/work/qg-scale", help="converted models and variants (deleted after "
                                                               "unless --keep)")
    p.add_argument("--in-memory-up-to", type=float, default=1e9,
                   help="also time the in-memory build (the old path) for models up to this many parameters")
    p.add_argument("--keep", action="store_true", help="keep the converted models and variants")
    p.add_argument("--llama-quantize", default=None, metavar="BIN",
                   help="also time llama.cpp's llama-quantize (scripts/peers_setup_llama.sh builds it) on the GGUFs: "
                        "Q4_K_M -> F16 once, then int8wo beside Q8_0 and int4wo beside Q4_0 in alternated rounds")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the llama-quantize comparison")
    p.add_argument("--no-load", dest="load", action="store_false", help="skip loading each variant")
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="measure nothing: print and plot the rows of earlier runs' scale.json (a later file's row "
                        "replaces an earlier one's for the same model, stage and path)")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # internal: run one stage in this process
    p.add_argument("--source", default=None, help=argparse.SUPPRESS)
    p.add_argument("--target", default=None, help=argparse.SUPPRESS)
    p.add_argument("--method", default=None, help=argparse.SUPPRESS)
    return p


def _model_rows(name: str, args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    source, rows = workdir / name, []
    if not (source / "config.json").is_file():
        stage = "write-random" if name == RANDOM_8B else "convert"
        _need_disk(workdir, 20e9 if name == RANDOM_8B else 8e9)
        rows.append(_row(name, None, stage, "streamed", _watch(stage, source)))
    params = _parameters(source)
    for row in rows:
        row["parameters"] = params
    if args.llama_quantize and name in GGUFS:  # the paired rounds beside llama-quantize instead
        rows += _llama_rows(name, params, source, args, workdir)
    for method in [] if args.llama_quantize and name in GGUFS else args.methods:
        variant = workdir / f"{name}-{method}"
        rows.append(_row(name, params, f"quantize {method}", "streamed", _watch("quantize", source, variant, method)))
        if args.load:
            rows.append(_row(name, params, f"load {method}", "no copy", _watch("load", variant)))
        if params <= args.in_memory_up_to:
            rows.append(_row(name, params, f"quantize {method}", "in-memory (before)",
                             _watch("in-memory", source, workdir / f"{name}-{method}-old", method)))
            shutil.rmtree(workdir / f"{name}-{method}-old", ignore_errors=True)
        shutil.rmtree(variant, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(source, ignore_errors=True)
    return rows


def _earlier_rows(paths: list[str]) -> list[dict[str, Any]]:
    merged: dict[tuple[str, str, str], dict[str, Any]] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            merged[(row["model"], row["stage"], row["path"])] = row
    return list(merged.values())


def _row(model: str, params: int | None, stage: str, path: str, measured: dict[str, float]) -> dict[str, Any]:
    row = {"model": model, "parameters": params, "stage": stage, "path": path, **measured}
    print(f"{model:18s} {stage:18s} {path:20s} anon {fmt(measured['peak_anon_gb'], 2)} GB  "
          f"maxrss {fmt(measured['maxrss_gb'], 2)} GB  {fmt(measured['wall_s'], 1)} s", flush=True)
    return row


def _watch(stage: str, source: Path, target: Path | None = None, method: str | None = None) -> dict[str, float]:
    """Run one stage in a child process; its peak anonymous memory, ru_maxrss and wall time."""
    cmd = [sys.executable, "-m", "benchmarks.scale", "--stage", stage, "--source", str(source)]
    cmd += ["--target", str(target)] if target else []
    cmd += ["--method", method] if method else []
    return _watch_command(cmd, f"stage {stage} on {source}")


def _watch_command(cmd: list[str], what: str) -> dict[str, float]:
    """Run `cmd` watched from outside: peak anonymous memory of its process tree, ru_maxrss, wall time."""
    start = time.perf_counter()
    child = subprocess.Popen(cmd)
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _tree_anon(child.pid))
            done.wait(SAMPLE_SECONDS)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    if child.returncode:
        raise RuntimeError(f"{what} failed ({child.returncode})")
    return {"peak_anon_gb": peak[0] / 1e9, "maxrss_gb": usage.ru_maxrss * 1024 / 1e9,
            "wall_s": time.perf_counter() - start}


def _llama_rows(name: str, params: int, source: Path, args: argparse.Namespace, workdir: Path) -> list[dict]:
    """Ours beside llama.cpp's `llama-quantize` on the same model, in alternated rounds: its GGUF (Q4_K_M) to F16
    once (llama.cpp's full-width source, as our converted safetensors are ours), then per round int8wo and
    Q8_0, int4wo and Q4_0 (the formats nearest each other), each reading its source by mmap."""
    from quantgate.env import home

    binary, gguf, rows = Path(args.llama_quantize), home() / "models" / GGUFS[name], []
    f16 = workdir / f"{name}-F16.gguf"
    convert = _watch_command([str(binary), "--allow-requantize", str(gguf), str(f16), "F16"], "llama-quantize F16")
    rows.append(_row(name, params, "convert F16", "llama-quantize", convert))
    for round_ in range(args.rounds):
        for method, kind in LLAMA_PAIRS:
            variant, target = workdir / f"{name}-{method}", workdir / f"{name}-{kind}.gguf"
            ours = _watch("quantize", source, variant, method)
            theirs = _watch_command([str(binary), str(f16), str(target), kind], f"llama-quantize {kind}")
            rows.append({**_row(name, params, f"quantize {method}", "streamed", ours), "round": round_})
            rows.append({**_row(name, params, f"quantize {kind}", "llama-quantize", theirs), "round": round_})
            shutil.rmtree(variant, ignore_errors=True)
            target.unlink(missing_ok=True)
    f16.unlink(missing_ok=True)
    return rows


def llama_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and format pair: our wall time over llama-quantize's, round by round (geometric mean, 95 % t
    interval over the rounds), and the peak anonymous memory of each (the largest round)."""
    from gates.judging.speed_verdicts import ratio_ci

    out = []
    for model in dict.fromkeys(r["model"] for r in rows if "round" in r):
        for method, kind in LLAMA_PAIRS:
            ours = {r["round"]: r for r in rows if r["model"] == model and r["stage"] == f"quantize {method}"
                    and "round" in r}
            theirs = {r["round"]: r for r in rows if r["model"] == model and r["stage"] == f"quantize {kind}"
                      and "round" in r}
            ratios = [ours[k]["wall_s"] / theirs[k]["wall_s"] for k in sorted(ours) if k in theirs]
            if len(ratios) < 2:
                continue
            ci = ratio_ci(ratios)
            out.append({"model": model, "ours": method, "llama": kind, "rounds": len(ratios),
                        "wall_ratio": round(ci.estimate, 3), "low": round(ci.low, 3), "high": round(ci.high, 3),
                        "ours_anon_gb": max(r["peak_anon_gb"] for r in ours.values()),
                        "llama_anon_gb": max(r["peak_anon_gb"] for r in theirs.values())})
    return out


def _tree_anon(pid: int) -> int:
    """RssAnon of `pid` and its descendants, bytes (0 for a process gone meanwhile)."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


def _parameters(source: Path) -> int:
    """Parameters stored in the source's safetensors (an untied head counted), from the headers alone."""
    import math

    from safetensors import safe_open

    from quantize.streaming import open_source

    total = 0
    files = open_source(source).files
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="pt") as handle:
            total += sum(math.prod(handle.get_slice(k).get_shape()) for k in handle.keys())
    return total


def _need_disk(path: Path, needed: float) -> None:
    free = shutil.disk_usage(path).free
    if free < needed * 1.2:
        raise SystemExit(f"{path}: {free / 1e9:.1f} GB free, this model needs ~{needed / 1e9:.0f} GB")


def _cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"


def _print(rows: list[dict[str, Any]]) -> None:
    print("\n| model | parameters | stage | path | peak anon GB | ru_maxrss GB | wall s | anon B/param | s/B param |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        per = r["parameters"] or 0
        print(f"| {r['model']} | {per / 1e9:.2f}B | {r['stage']} | {r['path']} | {r['peak_anon_gb']:.2f} | "
              f"{r['maxrss_gb']:.2f} | {r['wall_s']:.1f} | {r['peak_anon_gb'] * 1e9 / per if per else 0:.2f} | "
              f"{r['wall_s'] / (per / 1e9) if per else 0:.0f} |")


def _plot(rows: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    fig, (mem, wall) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = sorted({(r["stage"], r["path"]) for r in rows if r["parameters"]})
    for stage, kind in series:
        points = sorted((r["parameters"] / 1e9, r["peak_anon_gb"], r["wall_s"]) for r in rows
                        if (r["stage"], r["path"]) == (stage, kind) and r["parameters"])
        label = f"{stage} ({kind})"
        mem.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
        wall.plot([p[0] for p in points], [p[2] / p[0] for p in points], "o-", label=label)
    mem.axhline(4, color="grey", ls="--", lw=0.8, label="target (int8wo, int4wo): 4 GB")
    for ax, what in ((mem, "peak anonymous memory (GB)"), (wall, "wall seconds per billion parameters")):
        ax.set_xscale("log")
        ax.set_xlabel("parameters (billions)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    wall.set_yscale("log")  # flat cost per parameter is a flat line
    mem.legend(fontsize=7)
    return save_figure(fig, path)


def run_stage(args: argparse.Namespace) -> None:
    """One stage, in this process (the parent watches it)."""
    import logging

    from quantgate.env import apply_defaults

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    apply_defaults()
    source, target = Path(args.source), Path(args.target) if args.target else None
    if args.stage == "convert":
        _convert(source)
    elif args.stage == "write-random":
        _write_random(source)
    elif args.stage == "quantize":
        from quantize.variant import quantize

        quantize(source, args.method, target, force=True)
    elif args.stage == "in-memory":  # the same quantize() with the method's streaming taken away: the old path
        from dataclasses import replace

        from quantize import methods
        from quantize.variant import quantize

        methods.METHODS[args.method] = replace(methods.METHODS[args.method], stream=None)
        quantize(source, args.method, target, force=True)
    elif args.stage == "load":
        import torch

        from serving.model.quant.loader import load_variant

        model = load_variant(source)
        with torch.inference_mode():
            model(input_ids=torch.arange(8)[None])
    else:
        raise SystemExit(f"unknown stage {args.stage}")


def _convert(target: Path) -> None:
    """A Qwen GGUF from QUANTGATE_HOME/models to a safetensors directory, tensor by tensor where
    quantgate/gguf_convert.py exists (else transformers' whole-model conversion)."""
    from quantgate.env import home

    gguf = home() / "models" / GGUFS[target.name]
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        from quantgate.gguf_convert import convert_gguf
    except ImportError:
        from quantgate.models import resolve_model

        shutil.copytree(resolve_model(gguf), tmp)
    else:
        convert_gguf(gguf, tmp)
    tmp.rename(target)


def _write_random(target: Path) -> None:
    """Llama-3-8B's shapes, random bf16 weights, written shard by shard (benchmarks/scale_model.py), with the
    default model's tokenizer: int4-awq / int4-gptq tokenize their calibration text with it."""
    from benchmarks.scale_model import write_random_llama
    from quantgate.models import resolve_model

    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_random_llama(tmp, tokenizer_from=resolve_model("smollm2-135m"))
    tmp.rename(target)


if __name__ == "__main__":
    parsed = _parser().parse_args()
    if parsed.stage:
        run_stage(parsed)
    else:
        main(sys.argv[1:])
