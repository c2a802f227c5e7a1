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
from quantgate import settings  # noqa: E402
from serving.kernels.cpu import wo_bf16  # noqa: E402
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
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    p.add_argument("--layers", type=int, default=30, help="copies of the 7 projections (SmolLM2-135M: 30)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per row count (best kept)")
    add_kernel_bench_options(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
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


if __name__ == "__main__":
    sys.exit(main())
