"""What the compiled decode step (serving/model/decode_step.py) buys: one engine per variant, its decode steps
timed with the plan and with the Python loop over the same ops, in interleaved rounds of one process.

Per variant and batch size: output tokens/s both ways, and the paired ratio's geometric mean with its 95 %
t interval (`gates.judging.speed_verdicts.ratio_ci`, as the release computes its speed gates); the first round is a warm-up.
It also prints the batch-1 weight bytes per second against the machine's read bandwidth measured in the
same run (the share of the bandwidth bound decode reaches).

    python benchmarks/decode_step.py [--model smollm2-135m] [--variants baseline,int8wo,int4wo] [--isa auto]
        [--dtype auto] [--batches 1,16] [--rounds 6] [--tokens 64] [--threads N] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repo's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import output_dir  # noqa: E402
from benchmarks.isa_paths import read_bandwidth_gbs  # noqa: E402
from quantgate.env import apply_defaults  # noqa: E402
from serving.loadgen.report import machine, write_json  # noqa: E402


def decode_rate(engine, batch: int, tokens: int, seed: int) -> float:
    """Output tokens/s once every sequence is past its prefill (prompts of 16 tokens)."""
    from serving import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, engine.vocab_size) for _ in range(16)] for _ in range(batch)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True))
    start = max(o.metrics.token_times[0] for o in outs)
    end = max(o.metrics.token_times[-1] for o in outs)
    return sum(sum(1 for t in o.metrics.token_times if t > start) for o in outs) / (end - start)


def measure(name: str, args) -> dict:
    from benchmarks.variants import variant_dir
    from serving import LLMEngine

    engine = LLMEngine.from_pretrained(str(variant_dir(args.model, name)), dtype=args.dtype, isa=args.isa,
                                       enable_prefix_caching=False, max_num_seqs=max(args.batches), block_size=16,
                                       num_kv_blocks=max(args.batches) * (args.tokens // 16 + 4))
    forward = engine.runner.fast_forward
    step = forward.step if forward is not None else None
    from quantgate.loading import resident_bytes

    # what a step reads of the weights: all of them (the tied embedding's rows are the lm_head's)
    row = {"variant": name, "plan": step is not None, "weight_bytes": resident_bytes(engine.model)}
    if step is None:
        print(f"{name}: no decode-step plan here (a projection is not one of quantgate's kernel calls)")
        return row
    from gates.judging.speed_verdicts import ratio_ci

    for batch in args.batches:
        rates: dict[str, list[float]] = {"plan": [], "python": []}
        for r in range(args.rounds + 1):
            order = ("plan", "python") if r % 2 else ("python", "plan")
            for mode in order:
                forward.step = step if mode == "plan" else None
                rate = decode_rate(engine, batch, args.tokens, seed=r)
                if r:  # round 0 warms both up
                    rates[mode].append(rate)
        forward.step = step
        ci = ratio_ci([a / b for a, b in zip(rates["plan"], rates["python"], strict=True)])
        best = {mode: max(v) for mode, v in rates.items()}
        row[f"b{batch}"] = {"plan_tok_s": best["plan"], "python_tok_s": best["python"], "speedup": ci.estimate,
                            "ci_low": ci.low, "ci_high": ci.high, "rounds": ci.n}
        print(f"{name:>9} b{batch:<3} plan {best['plan']:7.1f} tok/s  python {best['python']:7.1f}  "
              f"x{ci.estimate:.3f} [{ci.low:.3f}, {ci.high:.3f}]")
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default="baseline,int8wo,int4wo")
    parser.add_argument("--isa", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    apply_defaults()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth_gbs()
    rows = [measure(name, args) for name in args.variants.split(",")]
    for row in rows:
        if "b1" in row:
            for mode in ("plan", "python"):
                share = row["weight_bytes"] * row["b1"][f"{mode}_tok_s"] / 1e9 / bandwidth
                row["b1"][f"{mode}_bandwidth_share"] = share
            print(f"{row['variant']:>9} b1 weights {row['weight_bytes'] / 2**20:.0f} MiB: "
                  f"{row['b1']['plan_bandwidth_share']:.0%} of {bandwidth:.1f} GB/s with the plan, "
                  f"{row['b1']['python_bandwidth_share']:.0%} without")
    report = {"machine": machine(), "read_bandwidth_gbs": bandwidth, "args": vars(args) | {"isa": args.isa},
              "rows": rows, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    path = write_json(output_dir(args.out_dir, "decode_step") / "decode_step.json", report)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
