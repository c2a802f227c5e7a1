"""What each variant buys, through our engine: baseline vs int8wo / int4wo / bitsandbytes int8 / nf4 on
one model, one run, in the engine's dtype (auto: bf16 on CPUs with native bf16, else fp32). A variant
name may carry a KV-cache suffix: `int4wo+kv8` is int4wo weights served with an int8 KV cache,
`baseline+kvfp8` the source weights with an fp8 (e4m3) cache.

Per variant: weight bytes (as served: parameters and buffers in memory), engine load time, prefill tokens/s, decode
tokens/s at batch 1 and 32 (at high batch the KV reads dominate), top-1 agreement of next-token
predictions with the baseline and bits per byte on a fixed text (the engine's prompt logprobs), KV bytes
per block, and max concurrent sequences of --seq-len tokens at a fixed --memory-gb budget. Prints ratios
to the baseline side by side, writes JSON and a PNG bar chart.

    python benchmarks/variants.py [--model smollm2-135m] [--variants baseline,int8wo,int4wo,int8,nf4,int4wo+kv8]
        [--dtype auto] [--memory-gb 2] [--decode-tokens 32] [--batches 1,16,32] [--repeats 3] [--threads N]

All variants are loaded first and timed in interleaved rounds (each round times every variant once), so a
change in the machine's speed during the run falls on all of them alike; each figure is the best round, and
each speed ratio to the baseline is also given as the geometric mean of the rounds' paired ratios with its
95 % t interval (`gates.judging.speed_verdicts.ratio_ci`, as the release's speed gates compute it). Batch-1 decode is set
against the machine's read bandwidth measured in the same run (weight bytes x tokens/s / GB/s: the share
of the bound a step that reads every weight once can reach).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repo's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import peer_isa  # noqa: E402
from benchmarks.common import fmt, output_dir, pyplot, save_figure  # noqa: E402
from quantgate.env import apply_defaults  # noqa: E402
from serving.loadgen.report import machine, write_json  # noqa: E402

BLOCK_SIZE = 16
FIXED_TEXT = (
    "The water cycle describes how water moves between the oceans, the atmosphere and the land. "
    "Heat from the sun evaporates water from the surface of seas and lakes; the vapour rises, cools "
    "and condenses into clouds. When the droplets grow heavy enough they fall as rain or snow. Some of "
    "that water runs off into rivers and flows back to the sea, some soaks into the ground and "
    "refills aquifers, and some is taken up by plants, which release it again through their leaves. "
    "Over a year the same molecule may travel thousands of kilometres before it returns to the ocean."
)


@dataclass
class VariantResult:
    variant: str
    directory: str
    weight_bytes: int
    load_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: dict[int, float]
    top1_agreement: float | None
    kv_blocks: int
    max_seqs: int
    kv_cache_dtype: str = "auto"
    kv_bytes_per_block: int = 0
    bits_per_byte: float | None = None


def variant_dir(model: str, name: str) -> Path:
    """The weights of `name` (its KV suffix, if any, does not change them)."""
    from quantgate.models import resolve_model
    from quantize.capacity import split_variant

    name = split_variant(name)[0]
    if name == "baseline":
        return resolve_model(model)
    import quantize

    return quantize.quantize(model, name)


def time_prefill(engine, vocab: int, prompt_len: int, n: int, repeats: int, seed: int) -> float:
    from serving import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    best = float("inf")
    for _ in range(repeats):  # fresh prompts each time: no prefix-cache hits
        prompts = [[rng.randrange(1000, vocab) for _ in range(prompt_len)] for _ in range(n)]
        start = time.perf_counter()
        engine.generate(prompts, params)
        best = min(best, time.perf_counter() - start)
    return n * prompt_len / best


def time_decode(engine, vocab: int, batch: int, tokens: int, repeats: int, seed: int, context: int = 16) -> float:
    """Output tokens/s once every sequence of the batch (prompts of `context` tokens) is past its prefill."""
    from serving import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True)
    best = 0.0
    for _ in range(repeats):
        prompts = [[rng.randrange(1000, vocab) for _ in range(context)] for _ in range(batch)]
        outs = engine.generate(prompts, params)
        start = max(o.metrics.token_times[0] for o in outs)
        end = max(o.metrics.token_times[-1] for o in outs)
        produced = sum(sum(1 for t in o.metrics.token_times if t > start) for o in outs)
        best = max(best, produced / (end - start))
    return best


def score_text(engine, token_ids: list[int], text_bytes: int) -> tuple[list[int], float]:
    """Top-1 next-token predictions along the text, and its bits per byte (tokens after the first)."""
    from serving import SamplingParams

    out = engine.generate([token_ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    lps = out.prompt_logprobs[1:]
    bits = -sum(lp.logprob for lp in lps) / math.log(2)
    return [lp.top[0][0] for lp in lps], bits / text_bytes


def load_engine(name: str, args, text_tokens: int):
    """The variant's engine with a KV cache just big enough for the timings (all variants stay loaded)."""
    from quantize.capacity import split_variant
    from serving import LLMEngine

    longest = max(args.prompt_len, args.decode_context + args.decode_tokens + 1, text_tokens) + 1
    blocks = max(*args.batches, 4) * (-(-longest // BLOCK_SIZE) + 1)
    start = time.perf_counter()
    engine = LLMEngine.from_pretrained(str(variant_dir(args.model, name)), device=args.device, dtype=args.dtype,
                                       isa=args.isa, kv_cache_dtype=split_variant(name)[1], enable_prefix_caching=False,
                                       max_num_seqs=max(args.batches), block_size=BLOCK_SIZE, num_kv_blocks=blocks)
    return engine, time.perf_counter() - start


def measure_round(engine, args) -> tuple[float, dict[int, float]]:
    """One timing of prefill and of decode at every batch size."""
    vocab = engine.vocab_size
    prefill = time_prefill(engine, vocab, args.prompt_len, 4, 1, args.seed)
    decode = {b: time_decode(engine, vocab, b, args.decode_tokens, 1, args.seed, args.decode_context)
              for b in args.batches}
    return prefill, decode


def finish_variant(name: str, engine, load_s: float, speeds: list[tuple[float, dict[int, float]]], args,
                   baseline_top1: list[int] | None, text_ids: list[int]) -> tuple[VariantResult, list[int]]:
    """Best of the interleaved rounds, quality on the fixed text and the capacity row."""
    from quantgate.loading import resident_bytes
    from quantize.capacity import ModelShape, capacity_row, split_variant

    kv = split_variant(name)[1]
    weights = resident_bytes(engine.model)
    prefill = max(p for p, _ in speeds)
    decode = {b: max(d[b] for _, d in speeds) for b in args.batches}
    top1, bpb = score_text(engine, text_ids, len(FIXED_TEXT.encode()))
    agreement = None
    if baseline_top1 is not None:
        agreement = sum(a == b for a, b in zip(top1, baseline_top1, strict=True)) / len(top1)
    shape = ModelShape.from_config(engine.model.config.to_dict())
    row = capacity_row(name, shape, weights, int(args.memory_gb * 2**30), seq_len=args.seq_len,
                       block_size=engine.block_size, kv_dtype_bytes=engine.runner.shape.dtype.itemsize,
                       kv_cache_dtype=kv)
    assert row.kv_bytes_per_block == engine.runner.shape.bytes_per_block(engine.block_size)
    result = VariantResult(name, str(variant_dir(args.model, name)), weights, load_s, prefill, decode, agreement,
                           row.num_blocks, row.max_seqs, kv, row.kv_bytes_per_block, bpb)
    return result, top1


def run_all(names: list[str], args, text_ids: list[int]) -> tuple[list[VariantResult], dict[str, list]]:
    """Load every variant, then time them in interleaved rounds (baseline, a, b, baseline, a, b, ...), so
    that a change in the machine's speed during the run falls on every variant alike; best of the rounds."""
    engines = {}
    for name in names:
        print(f"[{name}] quantize (cached), load ...", flush=True)
        engines[name] = load_engine(name, args, len(text_ids))
    speeds: dict[str, list] = {name: [] for name in names}
    for round_ in range(args.repeats):
        print(f"round {round_ + 1}/{args.repeats}: " + ", ".join(names), flush=True)
        for name in names:
            speeds[name].append(measure_round(engines[name][0], args))
    results, baseline_top1 = [], None
    for name in names:
        engine, load_s = engines.pop(name)
        result, top1 = finish_variant(name, engine, load_s, speeds[name], args, baseline_top1, text_ids)
        baseline_top1 = top1 if name == "baseline" else baseline_top1
        results.append(result)
        del engine
        gc.collect()
    return results, speeds


def paired_ratios(speeds: dict[str, list], batches: list[int]) -> dict[str, dict[str, dict[str, float]]]:
    """Per variant and speed: the rounds' variant/baseline ratios, geometric mean and 95 % t interval."""
    from gates.judging.speed_verdicts import ratio_ci

    base = speeds["baseline"]
    if len(base) < 2:
        return {}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, rounds in speeds.items():
        if name == "baseline":
            continue
        columns = {"prefill": [r[0] / b[0] for r, b in zip(rounds, base, strict=True)]}
        columns |= {f"decode_b{n}": [r[1][n] / b[1][n] for r, b in zip(rounds, base, strict=True)] for n in batches}
        out[name] = {}
        for column, ratios in columns.items():
            ci = ratio_ci(ratios)
            out[name][column] = {"ratio": ci.estimate, "low": ci.low, "high": ci.high, "rounds": ci.n}
    return out


def b1_weight_rates(results: list[VariantResult]) -> dict[str, float]:
    """Per variant, the weight bytes a batch-1 decode step streams per second (GB/s)."""
    return {r.variant: r.weight_bytes * r.decode_tokens_per_s[1] / 1e9 for r in results if 1 in r.decode_tokens_per_s}


def print_paired(paired: dict, bandwidth: float, rates: dict[str, float]) -> None:
    for name, columns in paired.items():
        cells = [f"{c} {v['ratio']:.2f}x [{v['low']:.2f}, {v['high']:.2f}]" for c, v in columns.items()]
        print(f"{name:<15}paired, {next(iter(columns.values()))['rounds']} rounds: " + "  ".join(cells))
    for name, rate in rates.items():
        print(f"{name:<15}b1 reads {rate:.1f} GB/s of weights: {rate / bandwidth:.0%} of the {bandwidth:.1f} GB/s "
              "read bandwidth")


def plot(results: list[VariantResult], batches: list[int], path: Path) -> Path:
    plt = pyplot()
    metrics = [("weights (MiB)", [r.weight_bytes / 2**20 for r in results]),
               ("load (s)", [r.load_s for r in results]),
               ("prefill tokens/s", [r.prefill_tokens_per_s for r in results])]
    metrics += [(f"decode tokens/s, batch {b}", [r.decode_tokens_per_s[b] for r in results]) for b in batches]
    metrics += [("top-1 agreement", [r.top1_agreement or 1.0 for r in results]),
                ("bits per byte", [r.bits_per_byte or 0.0 for r in results]),
                ("max concurrent seqs", [r.max_seqs for r in results])]
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.0 * len(metrics), 3.4))
    names = [r.variant for r in results]
    for ax, (title, values) in zip(axes, metrics, strict=True):
        palette = ["#3b75af", "#e1812c", "#3a923a", "#c03d3e", "#8e6bb8", "#8c564b", "#d17ab8", "#7f7f7f"]
        ax.bar(names, values, color=["#777777"] + [palette[i % len(palette)] for i in range(len(names) - 1)])
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=8, rotation=30)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    apply_defaults()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default="baseline,int8wo,int4wo,int8,nf4")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto (the engine's choice), float32 or bfloat16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--decode-context", type=int, default=16,
                        help="prompt tokens before decode timing (long contexts make KV reads dominate)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved timing rounds over all variants; best of N for each")
    parser.add_argument("--memory-gb", type=float, default=2.0, help="fixed budget for the capacity column")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (1 keeps timings stable on a shared machine)")
    parser.add_argument("--out-dir", default=None, help="default: benchmarks/results/variants")
    parser.add_argument("--isa", default=None, help="kernel path for every engine: amx, avx512bf16, avx512, avx2, scalar "
                                                    "or torch (default: QUANTGATE_ISA, else the best this CPU runs)")
    parser.add_argument("--torch-native", action="store_true",
                        help="with --isa avx2: leave torch's own kernels (the baseline's GEMMs) at this CPU's best "
                             "instead of re-running with them forced onto AVX2, as an AVX2-only CPU runs them "
                             "(the report's torch_isa says which ran)")
    args = parser.parse_args(argv)
    if args.isa in peer_isa.ISAS and not args.torch_native and not peer_isa.torch_forced(args.isa):
        argv = sys.argv[1:] if argv is None else argv
        peer_isa.run_forced("benchmarks.variants", [*argv, "--torch-native"], args.isa)  # the child runs as is
        return json.loads((output_dir(args.out_dir, "variants") / "variants.json").read_text())
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    args.batches = [int(b) for b in args.batches.split(",")]
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if names[0] != "baseline":
        names.insert(0, "baseline")

    from transformers import AutoTokenizer

    from quantgate.models import resolve_model

    text_ids = AutoTokenizer.from_pretrained(resolve_model(args.model))(FIXED_TEXT).input_ids
    from benchmarks.isa_paths import read_bandwidth_gbs

    bandwidth = read_bandwidth_gbs()
    results, speeds = run_all(names, args, text_ids)
    paired = paired_ratios(speeds, args.batches)
    base = results[0]
    header = f"{'variant':<15}{'MiB':>8}{'load s':>8}{'prefill t/s':>13}" + "".join(
        f"{f'decode b{b} t/s':>16}" for b in args.batches) + f"{'top-1':>8}{'bpb':>7}{'KV B/blk':>10}{'max seqs':>11}"
    from serving.kernels.cpu import isa

    cpu = isa.describe()
    print(f"\n{args.model} on {args.device} ({cpu['cpu_model']}; {' '.join(cpu['cpu_flags'])}; kernel path "
          f"{isa.resolve(args.isa)}, torch {peer_isa.torch_isa()}): {len(text_ids)}-token fixed text, budget {args.memory_gb} GiB, "
          f"sequences of {args.seq_len} tokens\n{header}")
    for r in results:
        cells = [f"{r.weight_bytes / 2**20:>8.1f}", f"{r.load_s:>8.1f}",
                 f"{r.prefill_tokens_per_s:>7.0f} {r.prefill_tokens_per_s / base.prefill_tokens_per_s:>4.2f}x"]
        cells += [f"{r.decode_tokens_per_s[b]:>9.1f} {r.decode_tokens_per_s[b] / base.decode_tokens_per_s[b]:>4.2f}x"
                  for b in args.batches]
        cells += [f"{fmt(r.top1_agreement):>8}", f"{r.bits_per_byte:>7.3f}", f"{r.kv_bytes_per_block:>10}",
                  f"{r.max_seqs:>6} {r.max_seqs / max(base.max_seqs, 1):>3.2f}x"]
        print(f"{r.variant:<15}" + "".join(cells))
    rates = b1_weight_rates(results)
    print_paired(paired, bandwidth, rates)

    out = output_dir(args.out_dir, "variants")
    report = {"model": args.model, "device": args.device, "machine": machine(), "torch_isa": peer_isa.torch_isa(),
              "args": vars(args),
              "fixed_text_tokens": len(text_ids), "results": [asdict(r) for r in results],
              "ratios_to_baseline": {r.variant: {
                  "weight_bytes": r.weight_bytes / base.weight_bytes,
                  "prefill": r.prefill_tokens_per_s / base.prefill_tokens_per_s,
                  **{f"decode_b{b}": r.decode_tokens_per_s[b] / base.decode_tokens_per_s[b] for b in args.batches},
                  "max_seqs": r.max_seqs / max(base.max_seqs, 1),
                  "bits_per_byte_delta": r.bits_per_byte - base.bits_per_byte} for r in results},
              "paired_ratios": paired, "read_bandwidth_gbs": bandwidth,
              "b1_bandwidth_share": {name: rate / bandwidth for name, rate in rates.items()}}
    print(f"\nwrote {write_json(out / 'variants.json', report)} and {plot(results, args.batches, out / 'variants.png')}")
    return report


if __name__ == "__main__":
    main()
