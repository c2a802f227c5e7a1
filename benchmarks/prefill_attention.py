"""A fresh prompt's causal attention: prefill_attention.cpp (bf16: AMX tiles on `amx`, VDPBF16PS on
`avx512bf16`) or prefill_attention_fp32.cpp (`--dtype float32`: every path's own build) beside torch's flash
kernel, paired.

Each (model shape, prompt length) is timed in interleaved rounds in one process, the order alternating; a
round's ratio is torch's time over ours; the table gives each side's median ms a call and the ratio's
geometric mean with its 95 % t interval over the rounds. One layer's attention a call, q/k/v as the
engine slices them out of a step's projections. Writes prefill_attention.json (fp32: prefill_attention_fp32.json;
and .png).

    python benchmarks/prefill_attention.py [--lengths 16,64,136,256,512,1024,2048] [--rounds 7]
        [--shapes smollm2,qwen2.5-0.5b,qwen2.5-1.5b,llama-8b] [--isa PATH] [--dtype bfloat16|float32] [--out-dir DIR]
        [--no-plots]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repo's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import fmt, pyplot, save_figure, write_rows_report  # noqa: E402
from gates.judging.speed_verdicts import ratio_ci  # noqa: E402
from serving.kernels.cpu import decoder_ops  # noqa: E402
from serving.kernels.cpu import isa as isas  # noqa: E402

SHAPES = {  # query heads, KV heads, head_dim
    "smollm2": (9, 3, 64),
    "qwen2.5-0.5b": (14, 2, 64),
    "qwen2.5-1.5b": (12, 2, 128),
    "llama-8b": (32, 8, 128),
}


def case(length: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype = torch.bfloat16):
    """q [length, heads, dim], k and v [kv_heads, length, dim]: views of [tokens, heads * dim] rows."""
    q = torch.randn(length, heads * dim).to(dtype).view(length, heads, dim)
    k = torch.randn(length, kv_heads * dim).to(dtype).view(length, kv_heads, dim).transpose(0, 1)
    v = torch.randn(length, kv_heads * dim).to(dtype).view(length, kv_heads, dim).transpose(0, 1)
    return q, k, v


def timed(fn, budget_s: float) -> float:
    """Seconds a call, over as many calls as fit the budget (at least 3), after a warm-up call."""
    fn()
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < budget_s:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def measure(op, shape: tuple[int, int, int], length: int, rounds: int, budget_s: float,
            dtype: torch.dtype = torch.bfloat16) -> dict:
    heads, kv_heads, dim = shape
    q, k, v = case(length, heads, kv_heads, dim, dtype)
    scale, gqa = dim**-0.5, heads != kv_heads

    def ours():
        return op(q, k, v, scale)

    def theirs():
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], is_causal=True,
                                              scale=scale, enable_gqa=gqa)

    times = {"ours": [], "torch": []}
    for r in range(rounds):
        order = (("ours", ours), ("torch", theirs)) if r % 2 == 0 else (("torch", theirs), ("ours", ours))
        for name, fn in order:
            times[name].append(timed(fn, budget_s))
    ci = ratio_ci([t / o for t, o in zip(times["torch"], times["ours"], strict=True)])
    flops = 2 * 2 * heads * dim * length * (length + 1) / 2  # QK^T and PV over the causal half
    ours_s = statistics.median(times["ours"])
    return {"length": length, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
            "ours_ms": 1e3 * ours_s, "torch_ms": 1e3 * statistics.median(times["torch"]),
            "speedup": ci.estimate, "ci_low": ci.low, "ci_high": ci.high, "rounds": ci.n,
            "ours_gflops": flops / ours_s / 1e9}


def plot(rows: list[dict], path: Path, dtype: str = "bfloat16") -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in sorted({r["shape"] for r in rows}):
        mine = [r for r in rows if r["shape"] == name]
        ax.errorbar([r["length"] for r in mine], [r["speedup"] for r in mine],
                    yerr=[[r["speedup"] - r["ci_low"] for r in mine], [r["ci_high"] - r["speedup"] for r in mine]],
                    marker="o", capsize=3, label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="prompt tokens", ylabel="torch flash time / ours (95 % CI)", title=f"prefill attention, {dtype}")
    ax.legend()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="16,64,136,256,512,1024,2048")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--budget-s", type=float, default=0.1, help="seconds of calls per side per round")
    p.add_argument("--isa", default=None, help="kernel path (default: the best this CPU has)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--out-dir", default=None)
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    path = isas.resolve(args.isa)
    dtype = getattr(torch, args.dtype)
    op = decoder_ops.prefill_attention("cpu", path, dtype)
    if op is None:
        print(f"no {args.dtype} prefill kernel on path {path} (bf16: amx and avx512bf16; fp32: all but torch)")
        return 1
    print(f"path {path}, {args.dtype}, {torch.get_num_threads()} threads")
    rows = []
    print(f"{'shape':<14}{'tokens':>7}{'ours ms':>10}{'torch ms':>10}  speedup [95 % CI]   ours GFLOP/s")
    for name in args.shapes.split(","):
        for length in (int(n) for n in args.lengths.split(",")):
            row = {"shape": name, **measure(op, SHAPES[name], length, args.rounds, args.budget_s, dtype)}
            rows.append(row)
            print(f"{name:<14}{length:>7}{row['ours_ms']:>10.3f}{row['torch_ms']:>10.3f}  {fmt(row['speedup'], 2)}x "
                  f"[{fmt(row['ci_low'], 2)}, {fmt(row['ci_high'], 2)}]  {row['ours_gflops']:>8.0f}")
    report = write_rows_report(args.out_dir, "prefill_attention" + ("_fp32" if args.dtype == "float32" else ""), rows,
                               lambda rows, out: plot(rows, out, args.dtype), not args.no_plots,
                               threads=torch.get_num_threads(), rounds=args.rounds, isa=path, dtype=args.dtype)
    print(f"wrote {report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
