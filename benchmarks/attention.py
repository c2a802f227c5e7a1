"""Paged decode attention: the compiled kernel (serving/kernels/cpu) beside the torch path it replaces
(gather every context's blocks, then two matmuls per group), on the same caches, in one run.

SmolLM2-135M's layer shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16), contexts scattered
over a cache bigger than the CPU's caches, one layer per call. Prints ms per call, the kernel's speedup
and the KV bytes it read per second; writes attention.json and attention.png.

With `--ab REF` it is the paired A/B of a kernel change instead: the kernel as it was at git revision REF
(its sources from `git show`, built in a temp dir under an op namespace of its own) and the working tree's,
on the same caches, interleaved round by round (the order alternating), on each kernel path named
(`--paths amx:bfloat16,avx512:float32`), for each thread count (`--thread-counts 1,2`); per shape the new/old
speed ratio's geometric mean with its 95 % t interval over the rounds, and the new kernel against its KV-read
bound (the KV bytes over the read bandwidth, probed in the same rounds). Writes attention_ab.json.

    python benchmarks/attention.py [--dtype bfloat16] [--threads N] [--out-dir DIR] [--no-plots]
    python benchmarks/attention.py --ab HEAD [--paths amx:bfloat16,avx512:float32,avx2:float32]
        [--thread-counts 1,2] [--rounds 7] [--ab-shapes 1x512,16x512,64x128,64x512,64x2048]
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

from benchmarks.common import (  # noqa: E402
    add_kernel_bench_options,
    mean_seconds,
    output_dir,
    pyplot,
    save_figure,
    write_rows_report,
)
from benchmarks.peers import cpu_info  # noqa: E402
from serving.kernels.cpu import decoder_ops as kernels  # noqa: E402
from serving.loadgen.report import machine, write_json  # noqa: E402
from serving.model import attention  # noqa: E402
from serving.model.kv_memory import huge_pages_wanted, zeroed_tensors  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = ((1, 256), (8, 256), (32, 320), (64, 256), (64, 512))  # (sequences, context tokens)
CACHE_BLOCKS = 16384  # 2 x 96 MiB of bf16 K/V: contexts come from DRAM, as in a real step


def measure(num_seqs: int, length: int, dtype: torch.dtype, reps: int = 20) -> dict:
    q, k, v, tables, _ = _case(num_seqs, length, dtype)
    width = tables.shape[1]
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
    p.add_argument("--ab", default=None, metavar="REF", help="paired A/B: the kernel at git revision REF vs now")
    p.add_argument("--paths", default="amx:bfloat16,avx512:float32,avx2:float32")
    p.add_argument("--thread-counts", default="1,2")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--ab-shapes", default="1x512,16x512,64x128,64x512,64x2048")
    add_kernel_bench_options(p)
    args = p.parse_args(argv)
    if args.ab:
        return run_ab(args)
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


# ---- the paired A/B of a kernel change (--ab REF) ----

def build_reference(ref: str, isa: str, workdir: Path):
    """The decode op as its sources were at git revision `ref`, built for path `isa` under a namespace of
    its own (`quantgate_ab_<isa>`), so it loads beside the working tree's build of the same source."""
    import subprocess

    from torch.utils.cpp_extension import load as load_extension

    from serving.kernels.cpu import build
    from serving.kernels.cpu import isa as isas

    root = Path(__file__).resolve().parents[1]
    folder = "serving/kernels/cpu"
    names = subprocess.run(["git", "ls-tree", "--name-only", ref, f"{folder}/"], cwd=root, check=True,
                           capture_output=True, text=True).stdout.split()
    src = workdir / f"{ref.replace('/', '_')}_{isa}"
    src.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name.endswith((".cpp", ".h")):
            text = subprocess.run(["git", "show", f"{ref}:{name}"], cwd=root, check=True, capture_output=True).stdout
            (src / Path(name).name).write_bytes(text)
    namespace = f"quantgate_ab_{isa}"
    flags = list(build.CFLAGS)
    if isa in kernels.OWN_FLAG_PATHS:
        flags = [f for f in flags if f != "-march=native"] + isas.ISA_CFLAGS[isa]
    elif isa == "avx512bf16":  # as decoder_ops builds it: without the `amx` path's tile code
        flags += isas.NO_AMX_CFLAGS
    load_extension(name=namespace, sources=[str(src / "paged_attention.cpp")], extra_cflags=[*flags,
                   f"-DQG_NAMESPACE={namespace}"], extra_ldflags=["-fopenmp"], build_directory=str(src),
                   is_python_module=False, verbose=False)
    return getattr(torch.ops, namespace).paged_decode


def _case(num_seqs: int, length: int, dtype: torch.dtype) -> tuple:
    gen = torch.Generator().manual_seed(num_seqs * 7919 + length)
    shape = (KV_HEADS, CACHE_BLOCKS * BLOCK, HEAD_DIM)
    k, v = zeroed_tensors([(shape, dtype)] * 2, "cpu", huge_pages_wanted(torch.device("cpu")))  # as a server holds it
    k.copy_(torch.randn(shape, generator=gen))
    v.copy_(torch.randn(shape, generator=gen))
    width = -(-length // BLOCK)
    tables = torch.randperm(CACHE_BLOCKS, generator=gen)[: num_seqs * width].view(num_seqs, width)
    q = torch.randn(num_seqs, HEADS, HEAD_DIM, generator=gen).to(dtype)
    return q, k, v, tables, torch.full((num_seqs,), length)


def _seconds(fn, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def paired_rounds(old, new, case: tuple, rounds: int, budget_s: float = 0.25) -> dict:
    """old and new on the same caches, interleaved (order alternating per round), with a read-bandwidth
    probe in each round; per round the old/new time ratio (> 1: the new kernel is faster)."""
    from benchmarks.isa_paths import read_bandwidth_gbs

    q, k, v, tables, lengths = case
    calls = {name: (lambda op=op: op(q, k, v, tables, lengths, BLOCK, HEAD_DIM**-0.5, None, None, 0))
             for name, op in (("old", old), ("new", new))}
    diff = (calls["old"]().float() - calls["new"]().float()).abs().max().item()
    reps = max(3, int(budget_s / max(_seconds(calls["new"], 2), 1e-6)))
    times: dict[str, list[float]] = {"old": [], "new": [], "bw": []}
    for r in range(rounds):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            calls[name]()  # warm: the caches are bigger than the CPU's, so this only warms code and tables
            times[name].append(_seconds(calls[name], reps))
        times["bw"].append(read_bandwidth_gbs(256, 2))
    return {"times": times, "reps": reps, "max_abs_diff": diff}


def _ab_row(isa: str, dtype: str, threads: int, shape: tuple, measured: dict, load: float) -> dict:
    from gates.judging.speed_verdicts import ratio_ci

    times, (num_seqs, length) = measured["times"], shape
    ci = ratio_ci([o / n for o, n in zip(times["old"], times["new"], strict=True)])
    kv_bytes = 2 * num_seqs * length * KV_HEADS * HEAD_DIM * (2 if dtype == "bfloat16" else 4)
    bound = [kv_bytes / (bw * 1e9) for bw in times["bw"]]
    x_bound = statistics.median(n / b for n, b in zip(times["new"], bound, strict=True))
    old_x_bound = statistics.median(o / b for o, b in zip(times["old"], bound, strict=True))
    return {"path": isa, "dtype": dtype, "threads": threads, "sequences": num_seqs, "context": length,
            "old_ms": statistics.median(times["old"]) * 1e3, "new_ms": statistics.median(times["new"]) * 1e3,
            "speedup": ci.estimate, "low": ci.low, "high": ci.high, "rounds": ci.n,
            "read_gb_s": statistics.median(times["bw"]), "new_x_bound": x_bound, "old_x_bound": old_x_bound,
            "max_abs_diff": measured["max_abs_diff"], "load_1m": load}


def run_ab(args) -> int:
    import os
    import tempfile

    shapes = [tuple(int(x) for x in s.split("x")) for s in args.ab_shapes.split(",")]
    cpu = cpu_info()
    rows = []
    with tempfile.TemporaryDirectory(prefix="attention_ab_") as tmp:
        for spec in args.paths.split(","):
            isa, dtype = spec.split(":")
            old, new = build_reference(args.ab, isa, Path(tmp)), kernels.paged_decode("cpu", isa)
            for length_shape in shapes:
                case = _case(*length_shape, getattr(torch, dtype))
                for threads in (int(t) for t in args.thread_counts.split(",")):
                    torch.set_num_threads(threads)
                    load = os.getloadavg()[0]
                    row = _ab_row(isa, dtype, threads, length_shape, paired_rounds(old, new, case, args.rounds), load)
                    rows.append(row)
                    print(f"{isa:>10} {dtype:>8} t{threads} {row['sequences']:3d}x{row['context']:<5d} old "
                          f"{row['old_ms']:8.3f} ms new {row['new_ms']:8.3f} ms  speedup {row['speedup']:.2f}x "
                          f"[{row['low']:.2f}, {row['high']:.2f}]  x bound new {row['new_x_bound']:.2f} old "
                          f"{row['old_x_bound']:.2f} (read {row['read_gb_s']:.1f} GB/s)  load {load:.1f}  "
                          f"diff {row['max_abs_diff']:.1e}", flush=True)
                del case
    out = output_dir(args.out_dir, "attention")
    path = write_json(out / "attention_ab.json", {"ref": args.ab, "cpu": cpu, "machine": machine(), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
