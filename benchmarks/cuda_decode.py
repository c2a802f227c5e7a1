"""The device check's benchmark (scripts/gpu_check.sh): the engine on CUDA against HF, its decode and prefill
throughput, and the batch-64 bf16 decode as a share of the device's HBM bandwidth, judged against
docs/cuda.md's targets (each printed PASS, MISS, or n/a where its rows were not run).

Models are built on the device with random weights from configs (the default model's shape, a ~1B
Llama-class shape, the tests' tiny shape), so nothing is downloaded or carried. In order:

1. identity: the tiny shape (random weights, init range 0.2 as the tests' tiny models) in fp32 and bf16,
   five prompts greedy through the engine (Triton attention, graphs on, chunked prefill) against HF's own
   `generate` (sdpa) on the same weights: fp32 token-identical, bf16 within tests/test_triton_kernels.py's
   tolerance (the first 3 tokens agree; logprob gaps where the tokens agree: mean < 0.05, max < 0.5).
2. per shape and variant (bf16; int8wo / int4wo: the decoder's Linears weight-only, int4 in groups of 32):
   for each batch size, `batch` requests with `--prompt` token prompts are prefilled in one step, decoded
   `--warmup` steps (a graph bucket is captured there), then `--steps` decode steps timed; then a
   `--prefill`-token prompt prefilled alone, `--prefill-repeats` times after one untimed run (JIT).
3. targets (docs/cuda.md), per shape: bf16 batch-64 decode >= 50 % of HBM bandwidth; int4wo >= 1.5x bf16
   tok/s at batch 1; smollm2-135m bf16 batch-1 >= 1 000 tok/s (all graphs on).

A decode step's HBM bytes: every weight once (a tied embedding once, as the LM head; an untied one only for
the rows looked up) plus each sequence's K/V read over its context and its new token's K/V written;
activations left out. The share is those bytes over the step time, divided by the bandwidth of a
device-to-device copy measured in the same run (read + written bytes): that is what the target is judged
against; the share of the vendor's nominal figure (H200 4.8 TB/s, H100 SXM 3.35 TB/s) is printed beside it.

The defaults are the trimmed device check (llama-1b; batches 1 and 64; graphs on); `--full` is the sweep
(both shapes, batches 1-256, graphs on and off, weight-only at 1, 16, 64). Options given win over both.

    python -m benchmarks.cuda_decode --out results/    # --dry-run: the plan and byte counts, no CUDA call
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
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
    # the tests' tiny Llama (tests/words_llama.py): the identity check, and this script on CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
}
VARIANTS = ("bf16", "int4wo", "int8wo")  # int4wo before int8wo: a target needs it, should the budget run out
# The trimmed device check (the defaults) and the sweep (--full); options given on the command line win.
PRESETS = {
    "trimmed": dict(shapes="llama-1b", batches="1,64", wo_batches="1,64", graphs="on"),
    "full": dict(shapes="smollm2-135m,llama-1b", batches="1,2,4,8,16,32,64,128,256", wo_batches="1,16,64",
                 graphs="on,off"),
}
# Vendor spec sheets' HBM bandwidth, bytes/s, by a word of torch.cuda.get_device_name() (first match wins).
NOMINAL_HBM = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100", 2.0e12))
# Five prompts of mixed lengths: the 70-token one spans three 32-token prefill chunks, and as sequences
# finish the decode batch steps down through the graph buckets 8, 4, 2, 1.
IDENTITY_PROMPTS = ((5, 12), (21, 9), (40, 16), (3, 7), (70, 10))  # (prompt tokens, new tokens)
BF16_TOLERANCE = dict(agree=3, mean_gap=0.05, max_gap=0.5)  # tests/test_triton_kernels.py's bf16 test


class TokenIdsOnly:
    """The engine's tokenizer for prompts given as token ids: it never decodes text."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""

    def encode(self, text: str) -> list[int]:
        raise ValueError("this benchmark's engine takes token ids only")


def build_model(shape: str, device: str, dtype: torch.dtype, max_len: int, paged: bool = True, **overrides):
    """`paged`: attention through the engine (serving/model/attention.py); False keeps HF's own (the reference)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from serving.model import attention

    config = LlamaConfig(**SHAPES[shape] | overrides, max_position_embeddings=max_len)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if paged:
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


def nominal_bandwidth(device_name: str) -> float | None:
    """The spec sheet's HBM bytes/s for a device name torch reports; None when not listed (or a CPU)."""
    return next((bw for word, bw in NOMINAL_HBM if word in device_name), None)


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


# ---- 1. identity against HF -------------------------------------------------------------------------------
def compare_greedy(ref: list[list[int]], ref_lps: list[list[float]], out: list[list[int]],
                   out_lps: list[list[float]], exact: bool) -> dict:
    """The engine's greedy tokens and logprobs (`out`) against HF's (`ref`), prompt by prompt. `exact`: every
    token equal (fp32); else BF16_TOLERANCE over the tokens up to the first difference (a bf16 near tie may
    part the texts, after which they are not comparable)."""
    agreed, gaps = [], []
    for a, b, la, lb in zip(out, ref, out_lps, ref_lps, strict=True):
        same = next((t for t, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        agreed.append(same)
        gaps += [abs(x - y) for x, y in zip(la[:same], lb[:same], strict=True)]
    mean_gap, max_gap = (statistics.fmean(gaps), max(gaps)) if gaps else (float("inf"), float("inf"))
    if exact:
        ok = out == ref
    else:
        head = all(a >= min(BF16_TOLERANCE["agree"], len(b)) for a, b in zip(agreed, ref, strict=True))
        ok = head and mean_gap < BF16_TOLERANCE["mean_gap"] and max_gap < BF16_TOLERANCE["max_gap"]
    return {"ok": ok, "exact": exact, "agreed": agreed, "lengths": [len(b) for b in ref], "mean_gap": mean_gap,
            "max_gap": max_gap}


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """HF's own `generate`, batch of one, greedy: the tokens and each one's logprob."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    lps = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, tokens, strict=True)]
    return tokens, lps


def identity_check(device: str, dtype: torch.dtype, kv_gb: float) -> dict:
    """The tiny shape's greedy output through the engine (Triton attention, graphs on) against HF's."""
    from serving import LLMEngine, SamplingParams
    from serving.model import attention

    torch.manual_seed(0)  # no EOS: both run to their lengths
    model = build_model("tiny", device, dtype, 128, paged=False, initializer_range=0.2, bos_token_id=None,
                        eos_token_id=None)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n, _ in IDENTITY_PROMPTS]
    ref = [hf_greedy(model, p, m) for p, (_, m) in zip(prompts, IDENTITY_PROMPTS, strict=True)]
    model.set_attn_implementation(attention.register())
    engine = LLMEngine(model, TokenIdsOnly(), device=device, max_num_batched_tokens=32, max_model_len=128,
                       attention="triton", cuda_graphs=True, kv_cache_memory_gb=kv_gb)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=0) for _, m in IDENTITY_PROMPTS]
    outs = engine.generate(prompts, params)
    verdict = compare_greedy([r[0] for r in ref], [r[1] for r in ref], [o.token_ids for o in outs],
                             [[lp.logprob for lp in o.logprobs] for o in outs], exact=dtype == torch.float32)
    graphs = sorted(engine.runner.graphs.graphs) if engine.runner.graphs else []
    return {"dtype": str(dtype).removeprefix("torch."), **verdict, "graph_buckets": graphs}


# ---- 2. throughput ----------------------------------------------------------------------------------------
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


def prefill_run(engine, prompt: int, repeats: int, vocab: int) -> dict:
    """One `prompt`-token request at a time, to its first token (one engine step: the prompt fits the step's
    token budget); the first run compiles this length's kernels and is not timed. Each prompt is new random
    tokens, so the prefix cache never serves one."""
    from serving import SamplingParams

    rng = random.Random(prompt)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    seconds = []
    for _ in range(repeats + 1):
        engine.add_request([rng.randrange(vocab) for _ in range(prompt)], params)
        _sync(engine.device)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        _sync(engine.device)
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds[1:])
    return {"prompt": prompt, "repeats": repeats, "seconds": median, "tok_s": prompt / median}


def decode_row(model, run: dict, batch: int, bandwidth: float, nominal: float | None) -> dict:
    """The step's HBM bytes and their share of the copy's (and the nominal) bandwidth."""
    hbm = weight_bytes(model, batch) + batch * (run["mean_context"] + 1) * kv_bytes_per_token(model, torch.bfloat16)
    per_s = hbm / run["step_s"]
    return {**run, "hbm_bytes": hbm, "hbm_bytes_per_s": per_s, "hbm_fraction": per_s / bandwidth,
            "hbm_fraction_nominal": per_s / nominal if nominal else None}


def variant_model(shape: str, variant: str, args):
    """bf16, or the decoder's Linears weight-only (quantize/; serving/kernels/cuda/wo_gemm.py's kernels; int4 in
    groups of 32 where they fit, as the release's int4wo). The lm_head and embeddings stay bf16."""
    model = build_model(shape, args.device, torch.bfloat16, args.max_len)
    if variant != "bf16":
        from serving.model.quant.int4 import DEFAULT_GROUP_SIZE
        from serving.model.quant.int8 import replace_linears

        replace_linears(model.model, from_weights=True, group_size=DEFAULT_GROUP_SIZE if variant == "int4wo" else None)
    return model


def bench_shape(shape: str, variant: str, args, clock: Clock, result: dict) -> None:
    """Appends a row per (graphs, batch) to result['rows'] and one to result['prefill'], saving the JSON after
    each (a timeout keeps them). Weight-only variants: graphs on, at --wo-batches only."""
    from serving import LLMEngine

    if clock.out(f"{shape} {variant}", result):  # before building its model (llama-1b: 2.5 GB, quantized)
        return
    model = variant_model(shape, variant, args)
    batches = args.batches if variant == "bf16" else args.wo_batches
    for graphs in args.graphs if variant == "bf16" else [True]:
        # every prompt in one prefill step, so all sequences decode in lockstep
        engine = LLMEngine(model, TokenIdsOnly(), device=args.device, max_num_seqs=max(batches),
                           max_num_batched_tokens=max(max(batches) * (args.prompt + 1), args.prefill),
                           max_model_len=args.max_len, attention="triton", cuda_graphs=graphs,
                           kv_cache_memory_gb=args.kv_gb)
        for batch in batches:
            if clock.out(f"{shape} {variant} graphs={graphs} batch {batch}", result):
                return
            run = decode_run(engine, batch, args.prompt, args.warmup, args.steps, model.config.vocab_size)
            row = {"shape": shape, "variant": variant, "graphs": graphs, "batch": batch,
                   **decode_row(model, run, batch, result["copy_bytes_per_s"], result["nominal_bytes_per_s"])}
            _record(result, "rows", row, args.out)
            print(f"{shape:13s} {variant:6s} graphs={'on ' if graphs else 'off'} batch {batch:4d}: "
                  f"{row['tok_s']:10.0f} tok/s  step {row['step_s'] * 1e3:7.3f} ms  HBM {row['hbm_bytes'] / 1e6:8.1f} MB"
                  f"  {100 * row['hbm_fraction']:5.1f} % of copy bandwidth{_nominal_percent(row)}", flush=True)
        if graphs and args.prefill and not clock.out(f"{shape} {variant} prefill {args.prefill}", result):
            row = {"shape": shape, "variant": variant, **prefill_run(engine, args.prefill, args.prefill_repeats,
                                                                      model.config.vocab_size)}
            _record(result, "prefill", row, args.out)
            print(f"{shape:13s} {variant:6s} prefill {args.prefill} tokens: {row['tok_s']:10.0f} tok/s  "
                  f"{row['seconds'] * 1e3:7.2f} ms", flush=True)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _nominal_percent(row: dict) -> str:
    share = row["hbm_fraction_nominal"]
    return f", {100 * share:5.1f} % of nominal" if share else ""


class Clock:
    """The benchmark's own time budget: past it, the remaining runs are skipped (and listed) rather than cut
    off by the check's timeout, so the targets are still judged and printed."""

    def __init__(self, budget_s: float | None):
        self.start, self.budget_s = time.monotonic(), budget_s

    def out(self, what: str, result: dict) -> bool:
        if self.budget_s is None or time.monotonic() - self.start < self.budget_s:
            return False
        result.setdefault("skipped", []).append(what)
        print(f"skipped (time budget {self.budget_s:.0f} s spent): {what}", flush=True)
        return True


# ---- 3. targets -------------------------------------------------------------------------------------------
def _target(shape: str, name: str, value: float | None, threshold: float, note: str = "") -> dict:
    status = "n/a" if value is None else "PASS" if value >= threshold else "MISS"
    return {"shape": shape, "target": name, "value": value, "threshold": threshold, "status": status, "note": note}


def _nominal_note(row: dict | None) -> str:
    share = row and row.get("hbm_fraction_nominal")
    return f"{share:.3g} of the nominal bandwidth" if share else ""


def evaluate_targets(rows: list[dict]) -> list[dict]:
    """docs/cuda.md's targets per shape measured, from the decode rows (graphs on); n/a where a row is missing."""
    targets = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        on = {(r["variant"], r["batch"]): r for r in rows if r["shape"] == shape and r["graphs"]}
        b64, b1, int4 = on.get(("bf16", 64)), on.get(("bf16", 1)), on.get(("int4wo", 1))
        targets.append(_target(shape, "bf16 batch-64 decode, share of the measured copy bandwidth",
                               b64["hbm_fraction"] if b64 else None, 0.5, _nominal_note(b64)))
        targets.append(_target(shape, "int4wo / bf16 decode tok/s at batch 1",
                               int4["tok_s"] / b1["tok_s"] if int4 and b1 else None, 1.5))
        if shape == "smollm2-135m":
            targets.append(_target(shape, "bf16 batch-1 decode tok/s", b1["tok_s"] if b1 else None, 1000.0))
    return targets


def target_line(t: dict) -> str:
    value = "-" if t["value"] is None else f"{t['value']:.3g}"
    note = f"; {t['note']}" if t.get("note") else ""
    return f"target {t['shape']}: {t['target']} = {value} (>= {t['threshold']:g}) {t['status']}{note}"


def _record(result: dict, key: str, row: dict, out: Path | None) -> None:
    result[key].append(row)
    result["targets"] = evaluate_targets(result["rows"])
    _save(result, out)


def _save(result: dict, out: Path | None) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "cuda_decode.json").write_text(json.dumps(result, indent=1))


def dry_run(args) -> dict:
    """Configs, weight bytes and the runs planned, on the meta device: everything before the first CUDA call."""
    plan = {}
    for shape in args.shapes:
        model = build_model(shape, "meta", torch.bfloat16, args.max_len)
        plan[shape] = {"weight_bytes": weight_bytes(model, 1),
                       "kv_bytes_per_token": kv_bytes_per_token(model, torch.bfloat16)}
        print(f"{shape}: {plan[shape]['weight_bytes'] / 1e6:.1f} MB of bf16 weights, "
              f"{plan[shape]['kv_bytes_per_token']} B of K/V a token")
    runs = [f"{v} graphs={'on' if g else 'off'} batches {args.batches if v == 'bf16' else args.wo_batches}"
            for v in args.variants for g in (args.graphs if v == "bf16" else [True])]
    print("identity:", "tiny fp32 and bf16 vs HF" if args.identity else "off")
    print("decode:", "; ".join(runs), f"| prompt {args.prompt}, {args.warmup} + {args.steps} steps")
    print(f"prefill: {args.prefill} tokens x {args.prefill_repeats} per variant" if args.prefill else "prefill: off")
    return {"shapes": plan, "runs": runs}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--full", action="store_true", help="the sweep: every shape, batch and graphs on/off")
    parser.add_argument("--shapes", help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--batches", help="bf16 batch sizes")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of bf16, int8wo, int4wo")
    parser.add_argument("--wo-batches", help="batch sizes for int8wo and int4wo")
    parser.add_argument("--graphs", help="bf16 with CUDA graphs on, off or on,off (weight-only: on)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per decode request")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=512, help="the prefill run's prompt tokens (0: none)")
    parser.add_argument("--prefill-repeats", type=int, default=5)
    parser.add_argument("--no-identity", dest="identity", action="store_false", help="skip the check against HF")
    parser.add_argument("--max-len", type=int, default=640)
    parser.add_argument("--kv-gb", type=float, default=8.0)
    parser.add_argument("--time-budget", type=float, default=None, help="seconds; later runs are skipped")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="folder for cuda_decode.json")
    args = parser.parse_args(argv)
    for key, value in PRESETS["full" if args.full else "trimmed"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return check_args(args)


def _ints(text: str) -> list[int]:
    return [int(b) for b in text.split(",") if b]


def check_args(args: argparse.Namespace) -> argparse.Namespace:
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.variants = [v for v in args.variants.split(",") if v]
    args.batches, args.wo_batches = _ints(args.batches), _ints(args.wo_batches)
    graphs = [g for g in args.graphs.split(",") if g]
    if set(graphs) - {"on", "off"} or not graphs:
        raise SystemExit(f"--graphs takes on, off or on,off, not {args.graphs!r}")
    args.graphs = [g == "on" for g in graphs]
    if set(args.variants) - set(VARIANTS):
        raise SystemExit(f"unknown variants {args.variants}")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown or not args.batches or min(args.batches + args.wo_batches) < 1:
        raise SystemExit(f"unknown shapes {unknown} or bad batches {args.batches} {args.wo_batches}")
    if max(args.prompt + args.warmup + args.steps, args.prefill) + 1 > args.max_len:
        raise SystemExit("--prompt + --warmup + --steps, and --prefill, must fit --max-len")
    return args


def print_ratios(result: dict, shapes: list[str]) -> None:
    for shape in shapes:
        def tok_s(variant, graphs, shape=shape):
            return {r["batch"]: r["tok_s"] for r in result["rows"]
                    if r["shape"] == shape and r["variant"] == variant and r["graphs"] == graphs}
        on, off = tok_s("bf16", True), tok_s("bf16", False)
        if off:
            print(shape, "bf16 graphs on/off:", {b: round(on[b] / off[b], 2) for b in on if b in off})
        for variant in ("int8wo", "int4wo"):
            wo = tok_s(variant, True)
            print(shape, f"{variant}/bf16 (graphs on):", {b: round(wo[b] / on[b], 2) for b in wo if b in on})


def run_identity(args, result: dict) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        row = identity_check(args.device, dtype, min(args.kv_gb, 0.05))
        result["identity"].append(row)
        _save(result, args.out)
        verdict = "PASS" if row["ok"] else "FAIL"
        print(f"identity tiny {row['dtype']} engine (Triton, graphs {row['graph_buckets']}) vs HF generate: "
              f"{verdict}  tokens agreed {row['agreed']} of {row['lengths']}  logprob gap mean "
              f"{row['mean_gap']:.2g} max {row['max_gap']:.2g}", flush=True)


def main(argv: list[str] | None = None) -> dict:
    """The result (also `--out`/cuda_decode.json); result['ok'] is False when the identity check failed."""
    args = parse_args(argv)
    if args.dry_run:
        return {"dry_run": dry_run(args), "ok": True}
    clock = Clock(args.time_budget)
    bandwidth = copy_bandwidth(args.device, 2**30 if args.device == "cuda" else 2**26)
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    nominal = nominal_bandwidth(name) if args.device == "cuda" else None
    print(f"device {name}: copy {bandwidth / 1e12:.2f} TB/s (read + write); nominal HBM "
          f"{f'{nominal / 1e12:.2f} TB/s' if nominal else 'not listed'}", flush=True)
    result = {"device": name, "torch": torch.__version__, "copy_bytes_per_s": bandwidth,
              "nominal_bytes_per_s": nominal, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                       for k, v in vars(args).items()},
              "identity": [], "rows": [], "prefill": [], "targets": []}
    if args.identity:
        run_identity(args, result)
    for shape in args.shapes:
        for variant in args.variants:
            bench_shape(shape, variant, args, clock, result)
    print_ratios(result, args.shapes)
    for t in result["targets"]:
        print(target_line(t))
    result["ok"] = all(row["ok"] for row in result["identity"])
    _save(result, args.out)
    return result


if __name__ == "__main__":
    raise SystemExit(0 if main()["ok"] else 1)
