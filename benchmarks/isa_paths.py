"""Weight-only linear on every kernel path this CPU runs, against the fp32 baseline, in paired rounds.

One pass = SmolLM2-135M's 7 projection shapes for each of `--layers` layers plus its tied lm_head, with
fp32 activations (the engine's dtype on CPUs without native bf16), at each row count. Paths: `fp32` is the
baseline (torch's F.linear: MKL), then serving/kernels/cpu/wo_fp32's int8, int4 (groups of 32) and bf16
weights for each ISA build the CPU runs (avx512, avx2, scalar), and torch's own int8/int4 CPU ops.
Every round times every path once (interleaved, in a rotating order), the ratio to fp32 is taken per round,
and the report gives their geometric mean and 95% t interval (`gates.judging.speed_verdicts.ratio_ci`, as the release does). At 1 row it prints the weight bytes each path
streams per second beside the machine's read bandwidth, measured in the same run.

    python benchmarks/isa_paths.py [--rows 1,4,16,32,128,512] [--layers 30] [--rounds 5] [--isas avx512,avx2]
        [--threads N] [--out-dir DIR] [--no-plots]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repo's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import add_kernel_bench_options, pyplot, save_figure, write_rows_report  # noqa: E402
from gates.judging.speed_verdicts import ratio_ci  # noqa: E402
from serving.kernels.cpu import isa as isas  # noqa: E402
from serving.kernels.cpu import wo_fp32  # noqa: E402
from serving.model.quant.int4 import pack_for_cpu, quantize_groups, unpack_nibbles  # noqa: E402
from serving.model.quant.int8 import quantize_per_channel  # noqa: E402

SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536), (49152, 576))
Call = Callable[[torch.Tensor], object]


def read_bandwidth_gbs(megabytes: int = 256, reps: int = 5) -> float:
    """The machine's read bandwidth with torch's threads: best of `reps` sums over a buffer past any cache."""
    buf = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def _layer(n: int, k: int, seed: int, paths: list[str]) -> dict[str, Call]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    q, scales = quantize_per_channel(w)
    codes, sz = quantize_groups(w, 32)
    calls: dict[str, Call] = {"fp32": lambda x: F.linear(x, w)}
    q8, q4, b16 = wo_fp32.tile(q), wo_fp32.tile(codes), wo_fp32.tile(w.bfloat16())
    for isa in paths:
        calls[f"int8_{isa}"] = lambda x, isa=isa: wo_fp32.linear_int8(isa, x, q8, scales)
        calls[f"int4_{isa}"] = lambda x, isa=isa: wo_fp32.linear_int4(isa, x, q4, sz, 32)
        calls[f"bf16_{isa}"] = lambda x, isa=isa: wo_fp32.linear_bf16(isa, x, b16)
    ones, torch4 = torch.ones(n, dtype=torch.bfloat16), pack_for_cpu(unpack_nibbles(codes))
    calls["int8_torch"] = lambda x: torch._weight_int8pack_mm(x.bfloat16(), q, ones).float() * scales
    calls["int4_torch"] = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), torch4, 32, sz)
    return calls


def weight_bytes(path: str, params: int, groups: int) -> float:
    """Bytes a pass streams: 4/2/1/0.5 per weight, int4 plus its bf16 scale and zero per group."""
    if path == "fp32":
        return 4.0 * params
    if path.startswith("bf16"):
        return 2.0 * params
    if path.startswith("int8"):
        return 1.0 * params
    return 0.5 * params + 4.0 * groups


def measure(rows: int, layers: list[tuple[int, dict[str, Call]]], rounds: int) -> dict:
    inputs = {k: torch.randn(rows, k) for k in {k for k, _ in layers}}
    names = list(layers[0][1])
    seconds: dict[str, list[float]] = {name: [] for name in names}
    with torch.inference_mode():
        for name in names:  # warm-up: builds, first calls
            [calls[name](inputs[k]) for k, calls in layers]
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:  # a rotating order
                start = time.perf_counter()
                [calls[name](inputs[k]) for k, calls in layers]
                seconds[name].append(time.perf_counter() - start)
    row: dict = {"rows": rows}
    for name in names:
        ci = ratio_ci([b / s for b, s in zip(seconds["fp32"], seconds[name], strict=True)])
        row[f"{name}_ms"] = statistics.median(seconds[name]) * 1e3
        row[f"{name}_vs_fp32"], row[f"{name}_ci"] = ci.estimate, [ci.low, ci.high]
    return row


def _plot(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    xs = [r["rows"] for r in rows]
    for name in [k[: -len("_vs_fp32")] for k in rows[0] if k.endswith("_vs_fp32") and not k.startswith("fp32")]:
        ax.plot(xs, [r[f"{name}_vs_fp32"] for r in rows], marker="o", label=name.replace("_", " "))
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows per call (decode batch / prefill chunk)")
    ax.set_ylabel("speed vs fp32 (torch, MKL)")
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16,32,128,512")
    p.add_argument("--layers", type=int, default=30, help="copies of the 7 projections (SmolLM2-135M: 30)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per row count")
    p.add_argument("--isas", default=None, help="wo_linear builds to time (default: every one this CPU runs but scalar)")
    add_kernel_bench_options(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = args.isas.split(",") if args.isas else [i for i in wo_fp32.PATHS if i != "scalar" and i in isas.supported()]
    for isa in paths:
        isas.check(isa)
    cpu = isas.describe()
    bandwidth = read_bandwidth_gbs()
    print(f"{cpu['cpu_model']}, {torch.get_num_threads()} threads, flags: {' '.join(cpu['cpu_flags'])}; "
          f"read bandwidth {bandwidth:.1f} GB/s; paths: {', '.join(paths)}")
    shapes = [*SHAPES[:-1] * args.layers, SHAPES[-1]]
    layers = [(k, _layer(n, k, seed, paths)) for seed, (n, k) in enumerate(shapes)]
    params, groups = sum(n * k for n, k in shapes), sum(n * k // 32 for n, k in shapes)
    rows = []
    for count in (int(r) for r in args.rows.split(",")):
        row = measure(count, layers, args.rounds)
        rows.append(row)
        names = [k[:-3] for k in row if k.endswith("_ms")]
        print(f"rows {count}: fp32 {row['fp32_ms']:.2f} ms; " + "; ".join(
            f"{n} {row[n + '_vs_fp32']:.2f}x [{row[n + '_ci'][0]:.2f}, {row[n + '_ci'][1]:.2f}]" for n in names[1:]))
        if count == 1:
            row["gbs"] = {n: weight_bytes(n, params, groups) / (row[n + "_ms"] / 1e3) / 1e9 for n in names}
            print("  weights streamed at 1 row, GB/s (share of the read bandwidth): " + "; ".join(
                f"{n} {g:.1f} ({g / bandwidth:.0%})" for n, g in row["gbs"].items()))
    path = write_rows_report(args.out_dir, "isa_paths", rows, _plot, args.plots, threads=torch.get_num_threads(),
                             cpu=cpu, read_bandwidth_gbs=bandwidth, paths=paths, layers=args.layers)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
