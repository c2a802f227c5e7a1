"""W8A8 projections against the path's baseline, as a decode step or a prefill chunk streams them (issue 47).

At each row count and shape, `--layers` copies of the weight (so they come from memory, as an engine's 30
layers do) run through: the path's baseline (our bf16 kernel over pair-packed weights on amx / avx512bf16 with
bf16 rows; our fp32 kernel on avx512 / avx2 with fp32 rows), w8a8 on our VNNI kernel (w8a8_vnni.h, where the CPU
has AVX-512 VNNI) and w8a8 around torch's int8 GEMM (`at::_int_mm`). Interleaved rounds in a shuffled order;
each round's baseline ÷ variant ratio gives a geometric mean with its 95 % t interval. Writes w8a8_linear.json.
`--path` picks the baseline kernel only: torch's int8 GEMM runs at this CPU's best ISA (`quantgate bench variants
--isa avx2` forces it too).

    python benchmarks/w8a8_linear.py [--path avx512bf16] [--rows 1,16,64,512] [--shapes 960x576,...]
        [--layers 30] [--rounds 7] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repo's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from benchmarks.common import output_dir  # noqa: E402
from benchmarks.woq_linear import ratio_ci  # noqa: E402
from serving.kernels.cpu import isa as isas  # noqa: E402
from serving.kernels.cpu import w8a8, wo_bf16, wo_fp32  # noqa: E402
from serving.loadgen.report import machine  # noqa: E402
from serving.model.quant.kernel_path import bf16_op  # noqa: E402

SHAPES = "960x576,576x576,3072x576,576x1536"  # SmolLM2-135M's fused q/k/v, o, gate/up and down


def calls(path: str, n: int, k: int, copies: int) -> dict[str, tuple]:
    """{format: (op, [per-copy tensors], rows dtype, trailing args)} for the path."""
    g = torch.Generator().manual_seed(n * 31 + k)
    weights = [torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8) for _ in range(copies)]
    scales, inv_smooth = torch.rand(n, generator=g) + 0.01, 1.0 / (torch.rand(k, generator=g) + 0.5)
    out = {"w8a8_int_mm": (w8a8.linear_op(), [(w, scales, inv_smooth) for w in weights], ())}
    if w8a8.vnni_ready():
        packed = [(wo_bf16.pack_int8(w, 4), 128 * w.to(torch.int32).sum(1, dtype=torch.int32), scales, inv_smooth)
                  for w in weights]
        out["w8a8_vnni"] = (w8a8.vnni_op(), packed, ())
    if path in isas.BF16_PATHS:
        bf16 = [(wo_bf16.pack_bf16(w.to(torch.bfloat16)),) for w in weights]
        out["baseline"] = (bf16_op(path, "bf16"), bf16, (torch.bfloat16,))
    else:
        fp32 = [(wo_fp32.tile(w.float()),) for w in weights]
        out["baseline"] = (wo_fp32._op(path, "linear_f32"), fp32, ())
    return out


def one_pass(op, copies: list[tuple], x: torch.Tensor, args: tuple) -> float:
    start = time.perf_counter()
    for tensors in copies:
        op(x, *tensors, *args)
    return time.perf_counter() - start


def cell(path: str, rows: int, n: int, k: int, layers: int, rounds: int) -> dict:
    formats = calls(path, n, k, layers)
    dtype = torch.bfloat16 if path in isas.BF16_PATHS else torch.float32
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    times: dict[str, list[float]] = {name: [] for name in formats}
    order = list(formats)
    for r in range(rounds + 1):
        random.Random(r).shuffle(order)
        for name in order:
            op, copies, args = formats[name]
            seconds = one_pass(op, copies, x, args)
            if r:  # the first round warms up
                times[name].append(seconds / layers)
    row = {"path": path, "rows": rows, "n": n, "k": k, "ms": {f: 1e3 * min(t) for f, t in times.items()}}
    for name in formats:
        if name != "baseline":
            row[f"{name}_speedup"] = ratio_ci([b / v for b, v in zip(times["baseline"], times[name], strict=True)])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default=isas.resolve(), help="kernel path of the baseline (default: this CPU's)")
    parser.add_argument("--rows", default="1,16,64,512")
    parser.add_argument("--shapes", default=SHAPES, help="NxK,...")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    if w8a8.linear_op() is None:
        raise SystemExit("the w8a8 op could not be built here (no C++ compiler)")
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            row = cell(args.path, rows, n, k, args.layers, args.rounds)
            rows_out.append(row)
            ratios = "  ".join(f"{name.removesuffix('_speedup')} {row[name][0]:.2f}x [{row[name][1]:.2f}, "
                               f"{row[name][2]:.2f}]" for name in row if name.endswith("_speedup"))
            print(f"{args.path} {rows:5d} rows {n:5d}x{k:<5d} baseline {row['ms']['baseline']:.3f} ms  {ratios}",
                  flush=True)
    out = output_dir(args.out_dir, "w8a8_linear") / "w8a8_linear.json"
    out.write_text(json.dumps({"machine": machine(), "args": vars(args), "rows": rows_out}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
