"""A real model a user would bring, end to end: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF) converted,
quantized to int8wo and to int4-awq (streamed one decoder layer at a time), and served by the engine
token for token as HF runs the same dequantized weights.

Opt-in (about 4 minutes on 2 cores): `scripts/real_models.sh --only 0.5b`, then
`QUANTGATE_REAL_MODELS=$QUANTGATE_HOME/models .venv/bin/pytest tests/test_real_model.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantgate import settings

GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
PROMPTS = ["def fibonacci(n):", "# Sort a list of numbers in Python\n", "SELECT name FROM users WHERE"]
TOKENS = 8


@pytest.fixture(scope="module")
def qwen_source(tmp_path_factory) -> Path:
    folder = settings.REAL_MODELS.raw()
    if not folder or not (Path(folder) / GGUF).is_file():
        pytest.skip(f"set QUANTGATE_REAL_MODELS to a folder holding {GGUF} (scripts/real_models.sh)")
    from quantgate.gguf_convert import convert_gguf

    out = tmp_path_factory.mktemp("qwen") / "source"
    convert_gguf(Path(folder) / GGUF, out)
    return out


def _hf_with(variant: Path, source: Path):
    """The source in plain HF with each quantized layer's dequantized weight (and the variant's other
    tensors: AWQ's folded norms)."""
    from transformers import AutoModelForCausalLM

    import quantize

    model = quantize.load_model(variant, "cpu", None)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "dequantized_weight") and name:
                hf.get_submodule(name).weight.copy_(module.dequantized_weight(torch.float32))
            elif type(module).__name__ in ("Int8Embedding", "Int4Embedding") and not module.weight.is_meta:
                hf.get_submodule(name).weight.copy_(module.weight.float())  # untied (a tied one is the head's)
        for name, parameter in model.named_parameters():
            hf.get_parameter(name).copy_(parameter)
    return hf


def _served_and_reference(variant: Path, source: Path) -> list[tuple[list[int], list[int], torch.Tensor]]:
    from transformers import AutoTokenizer

    from serving import LLMEngine, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(source)
    engine = LLMEngine.from_pretrained(str(variant), device="cpu", dtype="float32")
    hf = _hf_with(variant, source)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    found = []
    for text in PROMPTS:
        prompt = tokenizer(text)["input_ids"]
        served = engine.generate([prompt], params)[0].token_ids
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + served])).logits[0, len(prompt) - 1:-1]
        found.append((prompt, served, logits))
    return found


def test_int8wo_of_the_real_model_serves_hf_greedy_tokens(qwen_source, tmp_path):
    import quantize

    variant = quantize.quantize(qwen_source, "int8wo", tmp_path / "int8wo")
    assert quantize.read_manifest(variant)["probe"]["kind"] == "per-tensor"
    for _, served, logits in _served_and_reference(variant, qwen_source):
        assert served == logits.argmax(-1).tolist()


def test_int4_awq_of_the_real_model_streams_and_serves(qwen_source, tmp_path):
    """Built one decoder layer at a time: its probe sees the source's logits; the engine's tokens are HF's
    on the dequantized weights up to the int4 kernels' bf16 rounding of activations."""
    import quantize

    variant = quantize.quantize(qwen_source, "int4-awq", tmp_path / "int4-awq")
    manifest = quantize.read_manifest(variant)
    assert manifest["probe"]["kind"] == "layer by layer" and manifest["probe"]["logit_cosine"] > 0.8
    assert len(manifest["probe"]["layers"]) == 24
    same = steps = 0
    for _, served, logits in _served_and_reference(variant, qwen_source):
        for row, token in zip(logits, served, strict=True):
            assert row.max() - row[token] <= 0.3, f"the engine's token trails HF's best by {row.max() - row[token]:.3f}"
            same += int(row.argmax()) == token
            steps += 1
    assert same >= 0.9 * steps
