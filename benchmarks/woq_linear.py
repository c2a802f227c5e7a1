"""Weight-only int8/int4 linear on CPU: quantgate's kernel (quantize/kernels) beside torch's own CPU
kernels for the same formats and beside the bf16 baseline (oneDNN-packed weights), in one run.

One pass = SmolLM2-135M's 7 projection shapes once each plus its tied lm_head (49152 x 576), at every
row count a decode batch or a prefill chunk hands a layer. torch's paths are the ones int8wo/int4wo took
before the kernel: int8 `_weight_int8pack_mm` up to 8 rows, dequantize-then-matmul beyond; int4
`_weight_int4pack_mm_for_cpu`. Prints ms per pass and each path's ratio to bf16; writes woq_linear.json
and woq_linear.png.

    python benchmarks/woq_linear.py [--rows 1,2,4,8,16,32,64,128] [--threads N] [--out-dir DIR] [--no-plots]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repo's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import add_kernel_bench_options, mean_seconds, pyplot, save_figure, write_rows_report  # noqa: E402
from benchmarks.peers import cpu_info  # noqa: E402
from quantize import kernels as woq  # noqa: E402
from quantize.int4 import pack_for_cpu, quantize_groups, unpack_nibbles  # noqa: E402
from quantize.weight_only import FAST_PATH_MAX_ROWS, quantize_per_channel  # noqa: E402
from serving.packed_linear import PackedLinear  # noqa: E402

# (out, in) of q, k, v, o, gate, up, down, then the lm_head
SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536), (49152, 576))
PATHS = ("bf16", "int8_torch", "int8_ours", "int4_torch", "int4_ours")


def _layer_calls(out_features: int, in_features: int, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(out_features))
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    linear.weight.data = weight.bfloat16()
    packed_bf16 = PackedLinear(linear)
    q, scales = quantize_per_channel(weight)
    int8_packed, scales_bf16 = woq.pack_int8(q), scales.bfloat16()
    codes, sz = quantize_groups(weight, 32)
    int4_torch, int4_ours = pack_for_cpu(unpack_nibbles(codes)), woq.pack_int4(unpack_nibbles(codes))
    rows = x.shape[0]

    def int8_torch():
        if rows <= FAST_PATH_MAX_ROWS:
            return torch._weight_int8pack_mm(x, q, scales_bf16)
        return F.linear(x, q.to(torch.bfloat16)) * scales

    return {
        "bf16": lambda: packed_bf16(x),
        "int8_torch": int8_torch,
        "int8_ours": lambda: woq.int8_linear(x, int8_packed, scales, torch.bfloat16),
        "int4_torch": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4_torch, 32, sz),
        "int4_ours": lambda: woq.int4_linear(x, int4_ours, sz, 32, out_features, torch.bfloat16),
    }


def measure(rows: int, shapes: tuple[tuple[int, int], ...]) -> dict:
    totals = dict.fromkeys(PATHS, 0.0)
    with torch.inference_mode():
        for out_features, in_features in shapes:
            x = torch.randn(rows, in_features).bfloat16()
            reps = 4 if out_features > 10_000 else 20
            for name, call in _layer_calls(out_features, in_features, x).items():
                totals[name] += mean_seconds(call, reps)
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
    ax.set_ylabel("speed vs bf16 (packed)")
    ax.legend()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    add_kernel_bench_options(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not woq.available():
        print("quantgate's weight-only kernel does not run here (no AVX-512-BF16, no compiler, or "
              f"{woq.ENV}=0)")
        return 1
    cpu = cpu_info()
    print(f"{cpu['model_name']}, {torch.get_num_threads()} threads, flags: {' '.join(cpu['flags'])}")
    print("rows   bf16 ms  " + "  ".join(f"{name:>16}" for name in PATHS[1:]))
    rows = []
    for count in (int(r) for r in args.rows.split(",")):
        row = measure(count, SHAPES)
        rows.append(row)
        cells = "  ".join(f"{row[name + '_ms']:7.2f} {row[name + '_vs_bf16']:5.2f}x  " for name in PATHS[1:])
        print(f"{count:4d}  {row['bf16_ms']:8.2f}  {cells}")
    path = write_rows_report(args.out_dir, "woq_linear", rows, _plot, args.plots, threads=torch.get_num_threads(),
                             cpu=cpu, shapes=SHAPES)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
