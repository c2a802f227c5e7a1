"""Useful output tokens/s: our engine vs HF `generate` in static batches vs transformers' continuous batching.

One run, one workload (64 requests, prompt lengths 16-256, forced output lengths 8-256, fixed seed),
three systems side by side on the same model and device. "Useful" counts only each request's own
requested tokens: the padding and over-generation of static batches is work, not output.

    python benchmarks/throughput.py [--model smollm2-135m] [--device cpu] [--num-requests 64]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repo's packages, not a module of this folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from quantgate.env import apply_defaults, home  # noqa: E402


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    system: str
    seconds: float
    useful_tokens: int
    raw_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds


def make_workload(vocab: int, n: int, seed: int, prompt_range=(16, 256), out_range=(8, 256)) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request([rng.randrange(1000, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*out_range))
        for _ in range(n)
    ]


def run_engine(model_dir: Path, device: str, dtype: torch.dtype, reqs: list[Request], args) -> Result:
    from serving import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(
        str(model_dir), device=device, dtype=dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    warm = engine.generate(reqs[0].prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert warm
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in reqs]
    _sync(device)
    start = time.perf_counter()
    outs = engine.generate([r.prompt for r in reqs], params, use_tqdm=True)
    _sync(device)
    seconds = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == sum(r.max_tokens for r in reqs)
    return Result("quantgate engine", seconds, produced, produced)


@torch.inference_mode()
def run_hf_static(model, device: str, reqs: list[Request], batch_size: int, pad_id: int) -> Result:
    from tqdm import tqdm

    raw = 0
    _sync(device)
    start = time.perf_counter()
    for i in tqdm(range(0, len(reqs), batch_size), desc="HF static batches"):
        batch = reqs[i : i + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt) :] = 1
        new = max(r.max_tokens for r in batch)
        model.generate(
            ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=pad_id,
        )
        raw += new * len(batch)
    _sync(device)
    seconds = time.perf_counter() - start
    return Result(f"HF generate, static batches of {batch_size}", seconds, sum(r.max_tokens for r in reqs), raw)


@torch.inference_mode()
def run_hf_continuous(model, device: str, reqs: list[Request]) -> Result:
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in reqs), eos_token_id=None)
    produced = 0
    _sync(device)
    start = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        for i, r in enumerate(reqs):
            manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.max_tokens)
        done = 0
        while done < len(reqs):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                done += 1
                produced += len(out.generated_tokens)
    finally:
        manager.stop(block=True)
    _sync(device)
    seconds = time.perf_counter() - start
    useful = min(produced, sum(r.max_tokens for r in reqs))
    return Result("transformers continuous batching", seconds, useful, produced)


def gemm_flops(device: str, dtype: torch.dtype, m: int, k: int, n: int, repeats: int = 20) -> float:
    """The GEMM rate this machine reaches on a model-shaped product, FLOP/s."""
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * m * k * n * repeats / (time.perf_counter() - start)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    apply_defaults()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16, help="HF static batch size")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip", default="", help="comma list of systems to skip: static,continuous")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from quantgate.models import resolve_model
    from serving.model.device import resolve_dtype

    dtype = resolve_dtype(args.dtype, args.device)
    model_dir = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    vocab = model.get_input_embeddings().weight.shape[0]
    params = sum(p.numel() for p in model.parameters())
    reqs = make_workload(vocab, args.num_requests, args.seed)
    skip = set(filter(None, args.skip.split(",")))

    results = [run_engine(model_dir, args.device, dtype, reqs, args)]
    if "static" not in skip:
        results.append(run_hf_static(model, args.device, reqs, args.batch_size, pad_id=0))
    if "continuous" not in skip:
        try:
            results.append(run_hf_continuous(model, args.device, reqs))
        except Exception as exc:  # report, don't hide: the comparison is then missing, not faked
            print(f"transformers continuous batching failed: {exc!r}")

    hidden = model.config.hidden_size
    rate = gemm_flops(args.device, dtype, 256, hidden, 4 * hidden)
    limit_tps = rate / (2 * params)
    ours = results[0]
    report = {
        "model": str(args.model),
        "device": args.device,
        "dtype": str(dtype),
        "params": params,
        "num_requests": len(reqs),
        "useful_tokens": ours.useful_tokens,
        "gemm_flops": rate,
        "machine_limit_tokens_per_s": limit_tps,
        "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results],
        "engine_fraction_of_limit": ours.tokens_per_s / limit_tps,
        "ratios": {r.system: ours.tokens_per_s / r.tokens_per_s for r in results[1:]},
    }
    print(f"\n{len(reqs)} requests, {ours.useful_tokens} useful output tokens, {args.device} {dtype}")
    for r in results:
        print(f"  {r.system:<40} {r.tokens_per_s:8.1f} useful tok/s  ({r.raw_tokens} raw tokens, {r.seconds:.1f} s)")
    for name, ratio in report["ratios"].items():
        print(f"  engine / {name:<31} {ratio:8.2f}x")
    print(f"  machine limit (2*params FLOPs/token at {rate / 1e9:.0f} GFLOP/s): {limit_tps:.0f} tok/s; "
          f"engine reaches {100 * report['engine_fraction_of_limit']:.0f} %")

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"throughput-{args.device}"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    _plot(results, args.out / f"{stem}.png", f"{args.model} on {args.device} ({dtype}), {len(reqs)} requests")
    print(f"wrote {args.out / stem}.json and .png")
    return report


def _plot(results: list[Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [r.system for r in results]
    ax.barh(names, [r.tokens_per_s for r in results], color=["tab:green"] + ["tab:gray"] * (len(results) - 1))
    ax.invert_yaxis()
    ax.set_xlabel("useful output tokens / s")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    _ = home()
    main()
