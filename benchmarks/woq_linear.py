"""Linear layers on CPU as a decode step streams them: quantgate's kernels (serving/kernels/cpu/wo_bf16) for bf16,
int8 and int4 weights beside oneDNN's packed bf16 and torch's own int8/int4 CPU kernels, in one run.

One pass = SmolLM2-135M's 7 projection shapes for each of `--layers` layers (30: the model's weights,
too big for any cache, as a real step reads them) plus its tied lm_head (49152 x 576), at every row count
a decode batch or a prefill chunk hands a layer. `bf16` is the engine's baseline (our kernel, pair-packed
weights); `bf16_onednn` what it used before; torch's paths are the ones int8wo/int4wo took before the
kernel: int8 `_weight_int8pack_mm` up to 8 rows, dequantize-then-matmul beyond; int4
`_weight_int4pack_mm_for_cpu`. On a CPU with AMX, `*_dpbf16` is our kernel with its AMX tiles off (int8 packed in pairs).
Prints ms per pass and each path's ratio to bf16; writes woq_linear.json
and woq_linear.png.

    python benchmarks/woq_linear.py [--rows 1,2,4,8,16,32,64,128] [--layers 30] [--threads N]
        [--out-dir DIR] [--no-plots]

`--ab REV` is the paired A/B a kernel change is judged by: the kernel sources at git revision REV (built into a
temp dir under names of their own) and the working tree's, loaded in one process, on the same weights and
inputs, each build x format (the path's baseline weight, int8, int4 g32) timed in interleaved rounds in a
shuffled order, at each path (amx, avx512bf16: bf16 activations, bf16 baseline; avx512, avx2: fp32 activations
and baseline, as the engine serves them there), shape and row count. Each round's ratios (baseline ÷ variant,
REV ÷ new) give a geometric mean with its 95 % t interval. Writes woq_ab.json.

    python benchmarks/woq_linear.py --ab HEAD [--paths amx,avx2] [--rows 1,16,32,64,512] [--rounds 7]
        [--shapes 1536x576,...] [--mib 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repo's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import (  # noqa: E402
    add_kernel_bench_options,
    mean_seconds,
    output_dir,
    pyplot,
    save_figure,
    write_rows_report,
)
from benchmarks.peers import cpu_info  # noqa: E402
from quantgate import settings  # noqa: E402
from serving.kernels.cpu import isa as isas  # noqa: E402
from serving.kernels.cpu import wo_bf16  # noqa: E402
from serving.kernels.cpu.isa import supported  # noqa: E402
from serving.loadgen.report import write_json  # noqa: E402
from serving.model.packed_linear import PackedLinear  # noqa: E402
from serving.model.quant.int4 import pack_for_cpu, quantize_groups, unpack_nibbles  # noqa: E402
from serving.model.quant.int8 import FAST_PATH_MAX_ROWS, quantize_per_channel  # noqa: E402

# (out, in) of q, k, v, o, gate, up, down, then the lm_head
SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536), (49152, 576))
PATHS = ("bf16", "bf16_onednn", "int8_torch", "int8_ours", "int4_torch", "int4_ours")
if wo_bf16.cpu_has_amx():  # our kernel's build without AMX tiles: what they buy
    PATHS = (*PATHS, "bf16_dpbf16", "int8_dpbf16", "int4_dpbf16")


def _layer_calls(out_features: int, in_features: int, seed: int) -> dict[str, Callable[[torch.Tensor], object]]:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    linear.weight.data = weight.bfloat16()
    onednn, pairs = PackedLinear(linear), wo_bf16.pack_bf16(linear.weight.data)
    q, scales = quantize_per_channel(weight)
    int8_packed, int8_pairs, scales_bf16 = wo_bf16.pack_int8(q), wo_bf16.pack_int8(q, 2), scales.bfloat16()
    no_amx = "avx512bf16"  # the build without AMX tiles
    codes, sz = quantize_groups(weight, 32)
    int4_torch, int4_ours = pack_for_cpu(unpack_nibbles(codes)), wo_bf16.pack_int4(unpack_nibbles(codes))

    def int8_torch(x: torch.Tensor):
        if x.shape[0] <= FAST_PATH_MAX_ROWS:
            return torch._weight_int8pack_mm(x, q, scales_bf16)
        return F.linear(x, q.to(torch.bfloat16)) * scales

    return {
        "bf16": lambda x: wo_bf16.bf16_linear(x, pairs, torch.bfloat16),
        "bf16_onednn": onednn,
        "int8_torch": int8_torch,
        "int8_ours": lambda x: wo_bf16.int8_linear(x, int8_packed, scales, torch.bfloat16),
        "int4_torch": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4_torch, 32, sz),
        "int4_ours": lambda x: wo_bf16.int4_linear(x, int4_ours, sz, 32, out_features, torch.bfloat16),
        "bf16_dpbf16": lambda x: wo_bf16.bf16_linear(x, pairs, torch.bfloat16, no_amx),
        "int8_dpbf16": lambda x: wo_bf16.int8_linear(x, int8_pairs, scales, torch.bfloat16, no_amx),
        "int4_dpbf16": lambda x: wo_bf16.int4_linear(x, int4_ours, sz, 32, out_features, torch.bfloat16, no_amx),
    }


def model_layers(layers: int) -> list[tuple[int, dict[str, Callable[[torch.Tensor], object]]]]:
    """(in_features, calls) for every projection of `layers` layers and the lm_head, weights distinct."""
    shapes = [*SHAPES[:-1] * layers, SHAPES[-1]]
    return [(k, _layer_calls(n, k, seed)) for seed, (n, k) in enumerate(shapes)]


def measure(rows: int, layers: list[tuple[int, dict]], rounds: int = 3) -> dict:
    """ms per pass of each path: the best of `rounds` interleaved rounds (this VM's speed drifts)."""
    inputs = {k: torch.randn(rows, k).bfloat16() for k in {k for k, _ in layers}}
    totals = dict.fromkeys(PATHS, float("inf"))
    with torch.inference_mode():
        for _ in range(rounds):
            for name in PATHS:
                seconds = mean_seconds(lambda name=name: [calls[name](inputs[k]) for k, calls in layers], 4)
                totals[name] = min(totals[name], seconds)
    row = {"rows": rows, **{f"{name}_ms": seconds * 1e3 for name, seconds in totals.items()}}
    row.update({f"{name}_vs_bf16": totals["bf16"] / totals[name] for name in PATHS[1:]})
    return row


def _plot(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = [r["rows"] for r in rows]
    for name in PATHS[1:]:
        ax.plot(xs, [r[f"{name}_vs_bf16"] for r in rows], marker="o", label=name.replace("_", " "))
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows per call (decode batch / prefill chunk)")
    ax.set_ylabel("speed vs bf16 (our kernel)")
    ax.legend()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=None, help="row counts (default 1,2,4,8,16,32,64,128; with --ab 1,16,32,64,512)")
    p.add_argument("--layers", type=int, default=30, help="copies of the 7 projections (SmolLM2-135M: 30)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per row count (default 3; --ab 7)")
    p.add_argument("--ab", default=None, metavar="REV", help="paired A/B: REV's kernel sources (git) against the "
                   "working tree's, per path, shape and row count ('none': the working tree's alone)")
    p.add_argument("--paths", default=None, help="--ab: kernel paths (default: every one this CPU runs)")
    p.add_argument("--shapes", default=None, help="--ab: NxK,... (default: SmolLM2-135M's and an 8B up_proj)")
    p.add_argument("--mib", type=int, default=256, help="--ab: baseline weight MiB streamed per pass")
    add_kernel_bench_options(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ab:
        args.rows = args.rows or ",".join(map(str, AB_ROWS))
        args.rounds = args.rounds or 7
        args.paths = args.paths or ",".join(i for i in ("amx", "avx512bf16", "avx512", "avx2") if i in supported())
        return ab_main(args)
    args.rows, args.rounds = args.rows or "1,2,4,8,16,32,64,128", args.rounds or 3
    if not wo_bf16.available():
        print("quantgate's weight-only kernel does not run here (no AVX-512-BF16, no compiler, or "
              f"{settings.WOQ_KERNEL.name}=0)")
        return 1
    cpu = cpu_info()
    print(f"{cpu['model_name']}, {torch.get_num_threads()} threads, flags: {' '.join(cpu['flags'])}")
    print("rows   bf16 ms  " + "  ".join(f"{name:>16}" for name in PATHS[1:]))
    rows, layers = [], model_layers(args.layers)
    for count in (int(r) for r in args.rows.split(",")):
        row = measure(count, layers, args.rounds)
        rows.append(row)
        cells = "  ".join(f"{row[name + '_ms']:7.2f} {row[name + '_vs_bf16']:5.2f}x  " for name in PATHS[1:])
        print(f"{count:4d}  {row['bf16_ms']:8.2f}  {cells}")
    path = write_rows_report(args.out_dir, "woq_linear", rows, _plot, args.plots, threads=torch.get_num_threads(),
                             cpu=cpu, shapes=SHAPES, layers=args.layers)
    print(f"wrote {path}")
    return 0


# ---- paired A/B: the kernels at a git revision against the working tree's, in one process ------------------
# (out, in): SmolLM2-135M's up/gate, down, q/o, k/v projections, then an 8B model's up/gate
AB_SHAPES = ((1536, 576), (576, 1536), (576, 576), (192, 576), (14336, 4096))
AB_ROWS = (1, 16, 32, 64, 512)
FORMATS = ("base", "int8", "int4")  # base: the engine's baseline weight on the path (bf16 pairs; fp32 tiles)
GROUP = 32


def reference_ops(rev: str, path: str):
    """The op namespace of path `path`'s kernel built from `rev`'s sources (copied into a temp dir), under
    names of its own so it loads beside the working tree's build."""
    import subprocess
    import tempfile

    from serving.kernels.cpu import build, wo_fp32

    root = Path(__file__).resolve().parents[1]
    folder = "serving/kernels/cpu"
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, f"{folder}/"], cwd=root, check=True,
                           capture_output=True, text=True).stdout.split()
    tmp = Path(tempfile.mkdtemp(prefix=f"woq-ref-{path}-"))
    for name in (n for n in names if n.endswith((".cpp", ".h"))):
        text = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=root, check=True, capture_output=True).stdout
        (tmp / Path(name).name).write_bytes(text)
    bf16 = path in ("amx", "avx512bf16")
    namespace = f"quantgate_{'woq' if bf16 else 'wo'}_{path}_ref"
    if bf16:
        cflags = build.CFLAGS + (isas.NO_AMX_CFLAGS if path == "avx512bf16" else [])
    else:
        cflags = [f for f in wo_fp32.cflags(path) if not f.startswith("-DQG_NAMESPACE")]
    source = tmp / ("wo_bf16.cpp" if bf16 else "wo_fp32.cpp")
    if not build.load(source, [*cflags, f"-DQG_NAMESPACE={namespace}"], name=f"{source.stem}_{path}_ref"):
        raise RuntimeError(f"{rev}'s {source.name} did not build for {path}")
    ops = getattr(torch.ops, namespace)
    rows = None if bf16 else wo_fp32.torch_gemm_rows(path)
    if rows is not None and hasattr(ops, "use_torch_gemm_from"):  # as wo_fp32.ops sets the current build's
        ops.use_torch_gemm_from(*rows)
    return ops


def current_ops(path: str):
    from serving.kernels.cpu import wo_fp32

    return wo_bf16.ops(path) if path in ("amx", "avx512bf16") else wo_fp32.ops(path)


def _copies(nbytes: int, rows: int, n: int, k: int, mib: int) -> int:
    """Distinct weight copies per pass: enough bytes that the pass streams them from memory as a decode step
    does (`mib` of the baseline), but no more than ~20 GFLOP of work once many rows make it compute-bound."""
    by_bytes = -(-(mib << 20) // nbytes)
    by_flops = -(-int(2e10) // (2 * rows * n * k))
    return max(1, min(by_bytes, by_flops))


def _formats(ops, path: str, weight: torch.Tensor) -> dict[str, tuple]:
    """format -> (op, weight tensors, trailing args) for one build: each build packs int8 its own way."""
    from serving.kernels.cpu import wo_fp32

    n, k = weight.shape
    q, scales = quantize_per_channel(weight)
    codes, sz = quantize_groups(weight, GROUP)
    if path in ("amx", "avx512bf16"):
        out = torch.bfloat16
        width = 4 if ops.amx_int8_ready(k) else 2
        return {"base": (ops.woq_linear_bf16.default, (wo_bf16.pack_bf16(weight.bfloat16()),), (out,)),
                "int8": (ops.woq_linear_int8.default, (wo_bf16.pack_int8(q, width), scales), (out,)),
                "int4": (ops.woq_linear_int4.default, (wo_bf16.pack_int4(unpack_nibbles(codes)), sz), (GROUP, n, out))}
    return {"base": (ops.linear_f32.default, (wo_fp32.tile(weight.float()),), ()),
            "int8": (ops.linear_int8.default, (wo_fp32.tile(q), scales), ()),
            "int4": (ops.linear_int4.default, (wo_fp32.tile(codes), sz), (GROUP,))}


def _pass(op, copies: list[tuple], args: tuple, x: torch.Tensor) -> float:
    start = time.perf_counter()
    for tensors in copies:
        op(x, *tensors, *args)
    return time.perf_counter() - start


# Student's t, 97.5th percentile, by degrees of freedom (1-15; beyond, 20, 30 and the normal's)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)


def _t975(df: int) -> float:
    if df <= len(_T975):
        return _T975[df - 1]
    return 2.086 if df <= 20 else 2.042 if df <= 30 else 1.96


def ratio_ci(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of per-round ratios with its 95 % t interval (on the logs)."""
    import math
    import statistics

    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), float("nan"), float("nan")
    half = _t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def _interleaved_copies(path: str, builds: dict, weight: torch.Tensor, rows: int, mib: int) -> dict:
    """(build, format) -> (op, weight copies, args), the copies allocated round-robin across the calls: built
    one call after the other, the later calls' copies landed in other memory and ran ~10 % faster (an A/A of
    identical machine code read 0.60-0.95x at one row)."""
    n, k = weight.shape
    packed = {(b, f): call for b, ops in builds.items() for f, call in _formats(ops, path, weight).items()}
    counts = {key: _copies(sum(t.numel() * t.element_size() for t in tensors), rows, n, k, mib)
              for key, (_, tensors, _) in packed.items()}
    copies: dict[tuple, list] = {key: [] for key in packed}
    for i in range(max(counts.values())):
        for key, (_, tensors, _) in packed.items():
            if i < counts[key]:
                copies[key].append(tuple(t.clone() for t in tensors))
    return {key: (op, copies[key], args) for key, (op, _, args) in packed.items()}


def ab_cell(path: str, builds: dict, n: int, k: int, rows: int, rounds: int, mib: int, seed: int) -> dict:
    """One shape at one row count: every build x format timed in interleaved rounds (order shuffled per
    round), ratios taken within each round."""
    import random

    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    dtype = torch.bfloat16 if path in ("amx", "avx512bf16") else torch.float32
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    calls = _interleaved_copies(path, builds, weight, rows, mib)
    identical = {}
    with torch.inference_mode():  # the A/B's changes are meant to reorder work, not results: say where they differ
        for fmt in FORMATS if "ref" in builds else ():
            (op_new, new, args_new), (op_ref, ref, args_ref) = calls[("new", fmt)], calls[("ref", fmt)]
            identical[fmt] = torch.equal(op_new(x, *new[0], *args_new), op_ref(x, *ref[0], *args_ref))
    times: dict[tuple, list[float]] = {key: [] for key in calls}
    order = list(calls)
    shuffle = random.Random(seed)
    with torch.inference_mode():
        for op, copies, args in calls.values():
            _pass(op, copies, args, x)  # warm-up: first-touch and code paths
        for _ in range(rounds):
            shuffle.shuffle(order)
            for key in order:
                op, copies, args = calls[key]
                times[key].append(_pass(op, copies, args, x) / len(copies))
    return {**_cell_row(path, n, k, rows, times, builds), **{f"{fmt}_identical": v for fmt, v in identical.items()}}


def _cell_row(path: str, n: int, k: int, rows: int, times: dict, builds: dict) -> dict:
    row = {"path": path, "n": n, "k": k, "rows": rows}
    for (build_name, fmt), seconds in times.items():
        row[f"{build_name}_{fmt}_us"] = 1e6 * min(seconds)
    for build_name in builds:
        for fmt in FORMATS[1:]:  # baseline / variant, per round: > 1 is the variant faster
            base, variant = times[(build_name, "base")], times[(build_name, fmt)]
            row[f"{build_name}_{fmt}_speedup"] = ratio_ci([b / v for b, v in zip(base, variant, strict=True)])
    if "ref" in builds:
        for fmt in FORMATS:  # new over old, per round
            old, new = times[("ref", fmt)], times[("new", fmt)]
            row[f"{fmt}_new_vs_ref"] = ratio_ci([o / w for o, w in zip(old, new, strict=True)])
    return row


def _fmt(ci: tuple[float, float, float]) -> str:
    return f"{ci[0]:.2f}x [{ci[1]:.2f}, {ci[2]:.2f}]"


def ab_main(args) -> int:
    import os

    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = AB_SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    load = os.getloadavg()
    print(f"{cpu_info()['model_name']}, {torch.get_num_threads()} threads, load {load[0]:.1f}, ref {args.ab}")
    report = []
    for path in args.paths.split(","):
        builds = {"new": current_ops(path)}
        if args.ab != "none":
            builds["ref"] = reference_ops(args.ab, path)
        for n, k in shapes:
            for rows in rows_list:
                row = ab_cell(path, builds, n, k, rows, args.rounds, args.mib, seed=n * 7 + k + rows)
                row["load"] = os.getloadavg()[0]
                report.append(row)
                cells = [f"{fmt}/base {_fmt(row[f'new_{fmt}_speedup'])}" for fmt in FORMATS[1:]]
                if "ref" in builds:
                    cells += [f"ref {fmt}/base {_fmt(row[f'ref_{fmt}_speedup'])}" for fmt in FORMATS[1:]]
                    cells += [f"{fmt} new/ref {_fmt(row[f'{fmt}_new_vs_ref'])}{'' if row[f'{fmt}_identical'] else ' (differs)'}"
                              for fmt in FORMATS]
                base_us = row["new_base_us"]
                print(f"{path:10s} {n:5d}x{k:<5d} rows {rows:3d} base {base_us:9.1f} us  " + "  ".join(cells),
                      flush=True)
    out = write_json(output_dir(args.out_dir, "woq_ab") / "woq_ab.json",
                     {"ref": args.ab, "threads": torch.get_num_threads(), "rounds": args.rounds, "mib": args.mib,
                      "load_start": load, "machine": cpu_info(), "rows": report})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
