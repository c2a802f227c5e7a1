"""Paged decode attention: the compiled kernel (serving/kernels/cpu) beside the torch path it replaces
(gather every context's blocks, then two matmuls per group), on the same caches, in one run.

SmolLM2-135M's layer shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16), contexts scattered
over a cache bigger than the CPU's caches, one layer per call. Prints ms per call, the kernel's speedup
and the KV bytes it read per second; writes attention.json and attention.png.

    python benchmarks/attention.py [--dtype bfloat16] [--threads N] [--out-dir DIR] [--no-plots]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repo's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from benchmarks.common import add_kernel_bench_options, mean_seconds, pyplot, save_figure, write_rows_report  # noqa: E402
from benchmarks.peers import cpu_info  # noqa: E402
from serving.kernels.cpu import decoder_ops as kernels  # noqa: E402
from serving.model import attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = ((1, 256), (8, 256), (32, 320), (64, 256), (64, 512))  # (sequences, context tokens)
CACHE_BLOCKS = 16384  # 2 x 96 MiB of bf16 K/V: contexts come from DRAM, as in a real step


def measure(num_seqs: int, length: int, dtype: torch.dtype, reps: int = 20) -> dict:
    gen = torch.Generator().manual_seed(num_seqs * 7919 + length)
    k = torch.randn(KV_HEADS, CACHE_BLOCKS * BLOCK, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(KV_HEADS, CACHE_BLOCKS * BLOCK, HEAD_DIM, generator=gen).to(dtype)
    width = -(-length // BLOCK)
    tables = torch.randperm(CACHE_BLOCKS, generator=gen)[: num_seqs * width].view(num_seqs, width)
    q = torch.randn(num_seqs, HEADS, HEAD_DIM, generator=gen).to(dtype)
    ctx = attention.AttentionContext([k], [v], BLOCK, torch.zeros(0, dtype=torch.long))
    pad = torch.zeros(1, num_seqs, 1, width * BLOCK, dtype=torch.bool)
    group = attention.DecodeGroup(0, tables.reshape(-1), pad)
    op = kernels.paged_decode("cpu")
    lengths = torch.full((num_seqs,), length)
    kernel_s = mean_seconds(lambda: op(q, k, v, tables, lengths, BLOCK, HEAD_DIM**-0.5, None, None, 0), reps)
    torch_s = mean_seconds(lambda: attention._decode(q, ctx, 0, group, HEAD_DIM**-0.5), reps)
    kv_bytes = 2 * num_seqs * length * KV_HEADS * HEAD_DIM * k.element_size()
    return {"sequences": num_seqs, "context": length, "kernel_ms": kernel_s * 1e3, "torch_ms": torch_s * 1e3,
            "speedup": torch_s / kernel_s, "kernel_kv_gb_s": kv_bytes / kernel_s / 1e9}


def _plot(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['sequences']}x{r['context']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["torch_ms"] for r in rows], 0.4, label="torch path (gather + matmuls)")
    ax.bar([x + 0.2 for x in xs], [r["kernel_ms"] for r in rows], 0.4, label="paged kernel (in place)")
    ax.set_xticks(list(xs), labels)
    ax.set_xlabel("sequences x context tokens (one layer)")
    ax.set_ylabel("ms per call")
    ax.legend()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    add_kernel_bench_options(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if kernels.paged_decode("cpu") is None:
        print("the paged-attention kernel is not available here (QUANTGATE_PAGED_KERNEL=0 or no compiler)")
        return 1
    dtype = getattr(torch, args.dtype)
    cpu = cpu_info()
    print(f"{cpu['model_name']}, {torch.get_num_threads()} threads, flags: {' '.join(cpu['flags'])}; {args.dtype}")
    rows = []
    for num_seqs, length in SHAPES:
        row = measure(num_seqs, length, dtype)
        rows.append(row)
        print(f"{num_seqs:3d} seqs x {length:4d} tokens: kernel {row['kernel_ms']:7.3f} ms  torch "
              f"{row['torch_ms']:7.3f} ms  {row['speedup']:5.2f}x  ({row['kernel_kv_gb_s']:.1f} GB/s of KV)")
    path = write_rows_report(args.out_dir, "attention", rows, _plot, args.plots, dtype=args.dtype,
                             threads=torch.get_num_threads(), cpu=cpu,
                             layer={"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
