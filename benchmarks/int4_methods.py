"""INT4 methods side by side: round-to-nearest vs GPTQ vs AWQ (int8wo as the reference) on one model.

Each recipe quantizes a copy of the float32 model in memory (quantize/calibrated.py, the code the
`int4-gptq` / `int4-awq` methods run) and is measured on its dequantized weights in float32, so the figures
are the methods' and not the kernels' (every recipe here has int4wo's layout, served by the same kernels at
the same speed): next-token top-1 agreement and KL(source || variant) against the source model, and bits per
byte, on held text (LAMBADA passages: an eval set, so disjoint from the calibration text), plus the time the
quantization took.

    nice -n 10 .venv/bin/python -m benchmarks.int4_methods --model smollm2-135m --json int4_methods.json

`--model` takes what `quantgate` takes (a .gguf, a HF dir, `smollm2-135m`) or `tiny-llama` / `tiny-qwen2`:
the tests' randomly initialised 2-layer models (tests/conftest.py, tests/test_parallel.py), rebuilt here
with the same configs and seeds.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from serving.kernels.cpu import isa as isas

DEFAULT_RECIPES = ("rtn-g32", "gptq-g32", "awq-g32", "rtn-g64", "gptq-g64", "awq-g64",
                   "rtn-g64-b3", "gptq-g64-b3", "awq-g64-b3", "rtn-g32-headfp", "gptq-g32-headfp", "int8wo")


@dataclass(frozen=True)
class Recipe:
    name: str
    algorithm: str  # rtn, gptq, awq, int8wo
    group_size: int = 32
    bits: int = 4
    quantize_lm_head: bool = True
    gptq_lm_head: bool = True


@dataclass
class Row:
    recipe: str
    top1_agreement: float
    kl_nats: float
    bits_per_byte: float
    bits_per_byte_delta: float
    quantize_seconds: float
    quantize_cpu_seconds: float  # process CPU time: what the wall time would be alone on the cores used


def parse_recipe(name: str) -> Recipe:
    """`int8wo`, or `<rtn|gptq|awq>-g<group>[-b<bits>][-headfp|-headrtn]` (lm_head/embedding kept float,
    or round-to-nearest under GPTQ)."""
    parts = name.split("-")
    if parts == ["int8wo"]:
        return Recipe(name, "int8wo")
    if parts[0] not in ("rtn", "gptq", "awq") or len(parts) < 2 or not parts[1].startswith("g"):
        raise ValueError(f"recipe {name!r}: want int8wo or <rtn|gptq|awq>-g<group>[-b<bits>][-headfp]")
    bits, head, gptq_head = 4, True, True
    for part in parts[2:]:
        if part.startswith("b"):
            bits = int(part[1:])
        elif part in ("headfp", "headrtn"):
            head, gptq_head = part == "headrtn", False
        else:
            raise ValueError(f"recipe {name!r}: unknown part {part!r}")
    return Recipe(name, parts[0], int(parts[1][1:]), bits, head, gptq_head)


TINY_MODELS = ("tiny-llama", "tiny-qwen2")


def tiny_model(name: str, directory: Path) -> Path:
    """The tests' tiny random model `name` (same config and seed as its fixture), saved into `directory`
    with the default model's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from quantgate.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
                 tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config_class, model_class, seed = {"tiny-llama": (LlamaConfig, LlamaForCausalLM, 0),
                                       "tiny-qwen2": (Qwen2Config, Qwen2ForCausalLM, 1)}[name]
    torch.manual_seed(seed)
    model_class(config_class(**shape)).to(torch.float32).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def held_text(tokenizer, tokens: int) -> list[list[int]]:
    """LAMBADA passages, whole, in file order, until `tokens` tokens are predicted; tokenized as the
    tokenizer does by default (Gemma's <bos> first: without it Gemma's predictions are not its own)."""
    from evals.tasks.packages import lambada_test

    sequences, predicted = [], 0
    with open(lambada_test(), encoding="utf-8") as handle:
        for line in handle:
            ids = tokenizer(json.loads(line)["text"])["input_ids"]
            sequences.append(ids)
            predicted += len(ids) - 1
            if predicted >= tokens:
                break
    return sequences


@torch.inference_mode()
def log_probs(model: nn.Module, sequences: list[list[int]]) -> list[torch.Tensor]:
    return [torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1) for ids in sequences]


def score(base: list[torch.Tensor], ours: list[torch.Tensor], sequences: list[list[int]], text_bytes: int) -> tuple:
    agree = kl = nll = count = 0.0
    for b, o, ids in zip(base, ours, sequences, strict=True):
        agree += (b.argmax(-1) == o.argmax(-1)).sum().item()
        kl += (b.exp() * (b - o)).sum().item()
        nll -= o.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
        count += len(ids) - 1
    return agree / count, kl / count, nll / math.log(2) / text_bytes


def quantize_copy(source: nn.Module, recipe: Recipe,
                  calibration_ids: torch.Tensor | None) -> tuple[nn.Module, float, float]:
    from quantize.calibrated import Recipe as Calibrated
    from quantize.calibrated import calibrate
    from serving.model.quant.int8 import quantize_per_channel

    model = copy.deepcopy(source)
    start, cpu = time.perf_counter(), time.process_time()
    if recipe.algorithm == "int8wo":
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.Linear):
                    q, scales = quantize_per_channel(module.weight.float())
                    module.weight.copy_(q.float() * scales[:, None])
    else:
        ids = calibration_ids if recipe.algorithm != "rtn" else None
        calibrate(model, ids, Calibrated(recipe.algorithm, recipe.group_size, recipe.bits,
                                         quantize_lm_head=recipe.quantize_lm_head, gptq_lm_head=recipe.gptq_lm_head))
    return model, time.perf_counter() - start, time.process_time() - cpu


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--recipes", default=",".join(DEFAULT_RECIPES))
    parser.add_argument("--eval-tokens", type=int, default=512, help="predicted tokens of held text")
    parser.add_argument("--calibration-tokens", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    recipes = [parse_recipe(r.strip()) for r in args.recipes.split(",") if r.strip()]

    from transformers import AutoTokenizer

    from quantgate.loading import load_causal_lm
    from quantgate.models import resolve_model
    from quantize.calibration import calibration_set

    if args.model in TINY_MODELS:
        import tempfile

        path = tiny_model(args.model, Path(tempfile.mkdtemp(prefix=f"{args.model}-")))
    else:
        path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    source = load_causal_lm(path, dtype=torch.float32).eval()
    sequences = held_text(tokenizer, args.eval_tokens)
    text_bytes = sum(len(tokenizer.decode(ids[1:]).encode("utf-8")) for ids in sequences)
    calibration = calibration_set(tokenizer, args.calibration_tokens, args.seq_len)
    base = log_probs(source, sequences)
    _, _, base_bpb = score(base, base, sequences, text_bytes)
    rows = []
    for recipe in recipes:
        model, seconds, cpu_seconds = quantize_copy(source, recipe, calibration.ids)
        top1, kl, bpb = score(base, log_probs(model, sequences), sequences, text_bytes)
        rows.append(Row(recipe.name, round(top1, 4), round(kl, 5), round(bpb, 4), round(bpb - base_bpb, 4),
                        round(seconds, 1), round(cpu_seconds, 1)))
        print(f"{recipe.name:>16}  top-1 {top1:.4f}  KL {kl:.5f}  bpb {bpb:.4f} ({bpb - base_bpb:+.4f})  "
              f"quantized in {seconds:.1f} s ({cpu_seconds:.1f} s CPU)", flush=True)
        del model
        if args.json:  # after every row: a long run that is stopped keeps what it measured
            args.json.write_text(json.dumps({
                "model": args.model, "model_type": source.config.model_type,
                "parameters": sum(p.numel() for p in source.parameters()),
                "machine": isas.cpu_model(), "threads": torch.get_num_threads(),
                "eval": {"text": "LAMBADA (OpenAI) test passages, in order", "sequences": len(sequences),
                         "predicted_tokens": sum(len(s) - 1 for s in sequences), "bytes": text_bytes},
                "baseline_bits_per_byte": round(base_bpb, 4), "calibration": calibration.record,
                "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
