"""Decode throughput of the engine on CUDA, per batch size, with CUDA graphs on and off, against the
device's bandwidth (scripts/gpu_check.sh runs it on a lent GPU; docs/cuda.md has the figures).

Models are built on the device with random weights from configs (the default model's shape and a ~1B
Llama-class shape), so nothing is downloaded or carried. For each batch size, `batch` requests with
`--prompt` token prompts are prefilled, decoded `--warmup` steps (a graph bucket is captured there), then
`--steps` decode steps are timed. The step's HBM bytes: every weight once (a tied embedding once, as the LM
head; an untied one only for the rows looked up) plus each sequence's K/V read over its context and its new
token's K/V written; activations are left out. The fraction is those bytes over the step time, divided by
the bandwidth of a device-to-device copy measured in the same run (bytes read + written).

    python -m benchmarks.cuda_decode --out results/    # --dry-run: configs and byte counts, no CUDA call
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

SHAPES = {
    # SmolLM2-135M-Instruct, the default model
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
    # Llama-3.2-1B's shape
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                     rope_theta=500000.0),
    # a smoke test of this script on CPU (TRITON_INTERPRET=1 ... --device cpu --shapes tiny)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class TokenIdsOnly:
    """The engine's tokenizer for prompts given as token ids: it never decodes text."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""

    def encode(self, text: str) -> list[int]:
        raise ValueError("this benchmark's engine takes token ids only")


def build_model(shape: str, device: str, dtype: torch.dtype, max_len: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from serving.model import attention

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=max_len)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.set_attn_implementation(attention.register())
    return model.eval()


def weight_bytes(model, batch: int) -> int:
    """Every parameter and persistent buffer (int8 codes and scales) once, by storage."""
    seen, params = set(), 0
    tensors = [*model.parameters(), *(b for name, b in model.named_buffers() if not name.endswith("_unit_scales"))]
    for t in tensors:  # a tied matrix, and views into fused weights, counted once
        key = id(t) if t.device.type == "meta" else (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            params += t.numel() * t.element_size()
    if not model.config.tie_word_embeddings:
        table = model.get_input_embeddings().weight
        params -= table.numel() * table.element_size() - batch * table.shape[1] * table.element_size()
    return params


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    """K and V of one token over every layer."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * dtype.itemsize


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int = 2**30, repeats: int = 20) -> float:
    """Bytes per second a device-to-device copy moves (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def decode_run(engine, batch: int, prompt: int, warmup: int, steps: int, vocab: int) -> dict:
    from serving import SamplingParams

    rng = random.Random(batch)
    params = SamplingParams(max_tokens=1 + warmup + steps, temperature=0, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(vocab) for _ in range(prompt)], params) for _ in range(batch)]
    produced = dict.fromkeys(ids, 0)
    while min(produced.values()) < 1 + warmup:  # prefill, then warm-up decode steps (graph capture)
        for out in engine.step():
            produced[out.request_id] = len(out.token_ids)
    _sync(engine.device)
    start = time.perf_counter()
    done = tokens = 0
    while engine.has_unfinished():
        done += 1
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    _sync(engine.device)
    seconds = time.perf_counter() - start
    return {"steps": done, "tokens": tokens, "seconds": seconds, "step_s": seconds / done,
            "tok_s": tokens / seconds, "mean_context": prompt + warmup + 1 + (done - 1) / 2}


def bench_shape(shape: str, variant: str, args, bandwidth: float | None, result: dict) -> None:
    """Appends a row per (graphs, batch) to result['rows'], saving the JSON after each (a timeout keeps them).
    int8wo / int4wo: the decoder's Linears weight-only (quantize/; serving/model/cuda/woq.py's kernels; int4 in
    groups of 32 where they fit, as the release's int4wo), graphs on, at --wo-batches only."""
    from serving import LLMEngine

    model = build_model(shape, args.device, torch.bfloat16, args.max_len)
    batches = args.batches
    if variant != "bf16":
        from quantize.int4 import DEFAULT_GROUP_SIZE
        from quantize.weight_only import replace_linears

        replace_linears(model.model, from_weights=True, group_size=DEFAULT_GROUP_SIZE if variant == "int4wo" else None)
        batches = args.wo_batches
    for graphs in (True, False) if variant == "bf16" else (True,):
        # every prompt in one prefill step, so all sequences decode in lockstep
        engine = LLMEngine(model, TokenIdsOnly(), device=args.device, max_num_seqs=max(args.batches),
                           max_num_batched_tokens=max(args.batches) * (args.prompt + 1),
                           max_model_len=args.max_len, attention="triton", cuda_graphs=graphs,
                           kv_cache_memory_gb=args.kv_gb)
        for batch in batches:
            run = decode_run(engine, batch, args.prompt, args.warmup, args.steps, model.config.vocab_size)
            hbm = weight_bytes(model, batch) + batch * (run["mean_context"] + 1) * kv_bytes_per_token(
                model, torch.bfloat16)
            row = {"shape": shape, "variant": variant, "graphs": graphs, "batch": batch, **run, "hbm_bytes": hbm,
                   "hbm_fraction": hbm / run["step_s"] / bandwidth if bandwidth else None}
            result["rows"].append(row)
            _save(result, args.out)
            print(f"{shape:13s} {variant:6s} graphs={'on ' if graphs else 'off'} batch {batch:4d}: {row['tok_s']:10.0f} tok/s  "
                  f"step {row['step_s'] * 1e3:7.3f} ms  HBM {hbm / 1e6:8.1f} MB  "
                  f"{100 * (row['hbm_fraction'] or 0):5.1f} % of copy bandwidth", flush=True)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _save(result: dict, out: Path | None) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "cuda_decode.json").write_text(json.dumps(result, indent=1))


def dry_run(args) -> dict:
    """Configs and weight bytes on the meta device: everything before the first CUDA call."""
    plan = {}
    for shape in args.shapes:
        model = build_model(shape, "meta", torch.bfloat16, args.max_len)
        plan[shape] = {"weight_bytes": weight_bytes(model, 1),
                       "kv_bytes_per_token": kv_bytes_per_token(model, torch.bfloat16)}
        print(f"{shape}: {plan[shape]['weight_bytes'] / 1e6:.1f} MB of bf16 weights, "
              f"{plan[shape]['kv_bytes_per_token']} B of K/V a token; batches {list(args.batches)}")
    return plan


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="smollm2-135m,llama-1b", help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--variants", default="bf16,int8wo,int4wo", help="comma list of bf16, int8wo, int4wo")
    parser.add_argument("--wo-batches", default="1,16,64", help="batch sizes for int8wo and int4wo")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--kv-gb", type=float, default=8.0)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="folder for cuda_decode.json")
    args = parser.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.variants = [v for v in args.variants.split(",") if v]
    args.wo_batches = [int(b) for b in args.wo_batches.split(",") if b]
    if set(args.variants) - {"bf16", "int8wo", "int4wo"}:
        raise SystemExit(f"unknown variants {args.variants}")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown or not args.batches or min(args.batches) < 1:
        raise SystemExit(f"unknown shapes {unknown} or bad batches {args.batches}")
    if args.prompt + args.warmup + args.steps + 1 > args.max_len:
        raise SystemExit("--prompt + --warmup + --steps must fit --max-len")
    if args.dry_run:
        return {"dry_run": dry_run(args)}
    bandwidth = copy_bandwidth(args.device, 2**30 if args.device == "cuda" else 2**26)
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"device {name}: copy {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    result = {"device": name, "torch": torch.__version__, "copy_bytes_per_s": bandwidth,
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "rows": []}
    for shape in args.shapes:
        for variant in args.variants:
            bench_shape(shape, variant, args, bandwidth, result)
    for shape in args.shapes:
        def tok_s(variant, graphs, shape=shape):
            return {r["batch"]: r["tok_s"] for r in result["rows"]
                    if r["shape"] == shape and r["variant"] == variant and r["graphs"] == graphs}
        on, off = tok_s("bf16", True), tok_s("bf16", False)
        print(shape, "bf16 graphs on/off:", {b: round(on[b] / off[b], 2) for b in on if b in off})
        for variant in ("int8wo", "int4wo"):
            wo = tok_s(variant, True)
            print(shape, f"{variant}/bf16 (graphs on):", {b: round(wo[b] / on[b], 2) for b in wo if b in on})
    return result


if __name__ == "__main__":
    main()
