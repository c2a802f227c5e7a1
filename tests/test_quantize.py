"""Variants: every method loads back and serves through the engine exactly as HF generate runs it;
the content-addressed cache, integrity checks and refusals of bad input."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import quantize
from quantgate.cli import main as cli_main
from quantgate.models import content_hash
from serving.model.quant.integrity import CorruptVariantError, safetensors_header, verify_variant

METHODS = ["int8", "nf4", "fp4", "int8wo", "int4wo"]
LAYER_TYPES = {"int8": "Linear8bitLt", "nf4": "Linear4bit", "fp4": "Linear4bit", "int8wo": "Int8WeightOnlyLinear",
               "int4wo": "Int4WeightOnlyLinear"}


@pytest.fixture(scope="module")
def variants(tiny_model_dir) -> dict[str, Path]:
    return {m: quantize.quantize(tiny_model_dir, m) for m in METHODS}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(3, 40))] for _ in range(n)]


@torch.inference_mode()
def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _serving():
    try:
        from serving import LLMEngine, SamplingParams
    except ImportError as exc:  # the engine is a higher layer; this file still tests quantize/ alone
        pytest.skip(f"serving not importable: {exc}")
    return LLMEngine, SamplingParams


@pytest.mark.parametrize("method", METHODS)
def test_variant_manifest_and_layers(variants, tiny_model_dir, method):
    directory = variants[method]
    manifest = quantize.read_manifest(directory)
    assert manifest["method"] == method
    assert manifest["bits"] == (4 if method in ("nf4", "fp4", "int4wo") else 8)
    assert manifest["source"]["content_hash"] == content_hash(tiny_model_dir)
    assert directory.name == f"{manifest['source']['content_hash'][:16]}-{method}"
    assert manifest["versions"]["torch"] == torch.__version__.split("+")[0] or manifest["versions"]["torch"] == torch.__version__
    # weight bytes are the tensors actually saved, and every file is listed with size and hash
    weights = [f for f in manifest["files"] if f.endswith(".safetensors")]
    assert weights and manifest["weight_bytes"] == sum(
        info["data_offsets"][1] - info["data_offsets"][0]
        for f in weights for info in safetensors_header(directory / f).values()
    )
    for name, entry in manifest["files"].items():
        assert (directory / name).stat().st_size == entry["size"]
    assert {"tokenizer.json", "config.json"} <= set(manifest["files"])
    model = quantize.load_model(directory, "cpu", None)
    assert type(model.model.layers[0].mlp.down_proj).__name__ == LAYER_TYPES[method]
    assert model.config.model_type == "llama"


def test_bitsandbytes_variants_load_with_plain_from_pretrained(variants):
    from transformers import AutoModelForCausalLM

    for method in ("int8", "nf4"):
        model = AutoModelForCausalLM.from_pretrained(variants[method], device_map={"": "cpu"})
        assert type(model.model.layers[1].self_attn.q_proj).__name__ == LAYER_TYPES[method]
    # our own format is not mistaken for plain weights: from_pretrained finds no model file
    with pytest.raises(OSError):
        AutoModelForCausalLM.from_pretrained(variants["int8wo"])


@pytest.mark.parametrize("method", METHODS)
def test_engine_greedy_matches_hf_generate_on_the_variant(variants, method):
    LLMEngine, SamplingParams = _serving()
    engine = LLMEngine.from_pretrained(variants[method], device="cpu")
    assert type(engine.model.model.layers[0].mlp.up_proj).__name__ == LAYER_TYPES[method]
    reference = quantize.load_model(variants[method], "cpu", None)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for prompt in _prompts(3):
        # one request at a time: LLM.int8 picks outlier columns over the whole batch, so batching changes its numerics
        out = engine.generate([prompt], params)[0]
        assert out.token_ids == _hf_greedy(reference, prompt, 10), f"prompt of {len(prompt)} tokens"
    assert not engine.has_unfinished()


def test_weight_bytes_shrink(variants, tiny_model_dir):
    baseline = json.loads((tiny_model_dir / "config.json").read_text())
    assert baseline["tie_word_embeddings"]
    source = quantize.read_manifest(variants["nf4"])["source"]["weight_bytes"]
    by = {m: quantize.read_manifest(variants[m])["weight_bytes"] for m in METHODS}
    assert by["nf4"] < by["int8"] < source
    assert by["int8wo"] < source / 3  # embeddings are int8 too, shared with the tied lm_head
    assert by["int4wo"] < by["int8wo"] * 0.6  # nibbles + a bf16-sized scale and zero per 64 weights
    # exact layouts: the 2 layers hold 73,728 projection weights
    linear_params = 2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 128 * 64)
    assert quantize.read_manifest(variants["int8"])["weight_bytes_by_dtype"]["I8"] == linear_params
    nf4_u8 = quantize.read_manifest(variants["nf4"])["weight_bytes_by_dtype"]["U8"]
    assert linear_params // 2 < nf4_u8 < linear_params // 2 * 1.2  # packed nibbles + 8-bit block scales


def test_cache_hit_returns_the_same_directory_untouched(variants, tiny_model_dir):
    directory = variants["nf4"]
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in directory.iterdir()}
    created = quantize.read_manifest(directory)["created"]
    again = quantize.quantize(str(tiny_model_dir), "nf4")
    assert again == directory
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in directory.iterdir()} == before
    assert quantize.read_manifest(again)["created"] == created
    # other options are another variant, never the cached one
    other = quantize.quantize(tiny_model_dir, "nf4", compute_dtype="bfloat16")
    assert other != directory and other.name.startswith(directory.name + "-")
    assert quantize.read_manifest(other)["options"]["compute_dtype"] == "bfloat16"


def test_truncated_safetensors_is_detected_never_served_and_rebuilt(tiny_model_dir):
    directory = quantize.quantize(tiny_model_dir, "fp4")
    weights = directory / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size - 1000)
    with pytest.raises(CorruptVariantError, match="model.safetensors"):
        verify_variant(directory, full=False)
    with pytest.raises(CorruptVariantError):
        quantize.load_model(directory, "cpu", None)
    rebuilt = quantize.quantize(tiny_model_dir, "fp4")
    assert rebuilt == directory and weights.stat().st_size == size
    verify_variant(directory, full=True)


def test_same_size_corruption_is_caught_by_the_hash_and_rebuilt(tiny_model_dir):
    directory = quantize.quantize(tiny_model_dir, "int8wo")
    weights = directory / "int8wo.safetensors"
    original = {k: v.clone() for k, v in load_file(weights).items()}  # load_file maps the file
    damaged = bytearray(weights.read_bytes())
    damaged[-10] ^= 0xFF
    weights.write_bytes(bytes(damaged))
    verify_variant(directory, full=False)  # sizes and header still fine
    with pytest.raises(CorruptVariantError, match="sha256"):
        verify_variant(directory, full=True)
    with pytest.raises(CorruptVariantError):
        quantize.load_model(directory, "cpu", None)  # small variants are hashed before every load
    assert quantize.quantize(tiny_model_dir, "int8wo") == directory
    rebuilt = load_file(weights)  # the bytes differ (safetensors writes metadata in hash order), tensors not
    assert rebuilt.keys() == original.keys() and all(torch.equal(rebuilt[k], original[k]) for k in original)
    verify_variant(directory, full=True)


def test_partial_directory_under_the_cache_key_is_rebuilt(tiny_model_dir):
    directory = quantize.quantize(tiny_model_dir, "int8")
    (directory / "quantgate.json").unlink()  # as if the build had died before the manifest
    assert not quantize.is_variant(directory)
    assert quantize.quantize(tiny_model_dir, "int8") == directory
    verify_variant(directory, full=True)


def test_out_dir_fresh_empty_and_reused(tiny_model_dir, tmp_path):
    out = quantize.quantize(tiny_model_dir, "int8wo", tmp_path / "fresh")
    assert out == (tmp_path / "fresh").resolve() and quantize.is_variant(out)
    (tmp_path / "empty").mkdir()
    assert quantize.is_variant(quantize.quantize(tiny_model_dir, "int8wo", tmp_path / "empty"))
    manifest = quantize.read_manifest(out)
    assert quantize.quantize(tiny_model_dir, "int8wo", out) == out
    assert quantize.read_manifest(out)["created"] == manifest["created"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_out_dir_with_other_content_is_refused_untouched(tiny_model_dir, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="other content"):
        quantize.quantize(tiny_model_dir, "nf4", out)
    with pytest.raises(ValueError, match="other content"):
        quantize.quantize(tiny_model_dir, "nf4", out, force=True)  # force rebuilds variants, never foreign dirs
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
    # a directory holding a different variant is not overwritten either
    other = quantize.quantize(tiny_model_dir, "int8wo", tmp_path / "other")
    files = {p.name: p.read_bytes() for p in other.iterdir()}
    with pytest.raises(ValueError, match="nothing overwritten"):
        quantize.quantize(tiny_model_dir, "nf4", other)
    assert {p.name: p.read_bytes() for p in other.iterdir()} == files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_bad_input_is_refused_before_any_work(tiny_model_dir, variants, tmp_path):
    root = quantize.variants_root()
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(ValueError, match="unknown quantization method 'int3'.*int8.*nf4"):
        quantize.quantize(tiny_model_dir, "int3")
    with pytest.raises(ValueError, match="no option 'group_size'"):
        quantize.quantize(tiny_model_dir, "nf4", group_size=128)
    with pytest.raises(ValueError, match="compute_dtype"):
        quantize.quantize(tiny_model_dir, "nf4", compute_dtype="int8")
    with pytest.raises(ValueError, match="dtype must be one of"):
        quantize.quantize(tiny_model_dir, "int8wo", dtype="float64")
    with pytest.raises(ValueError, match="already a quantgate variant"):
        quantize.quantize(variants["nf4"], "int8")
    assert sorted(p.name for p in root.iterdir()) == before


def test_non_causal_architecture_is_refused(tmp_path):
    from transformers import BertConfig, BertModel

    encoder = tmp_path / "bert"
    BertModel(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                         vocab_size=100)).save_pretrained(encoder)
    with pytest.raises(ValueError, match="BertModel, not a causal language model"):
        quantize.quantize(encoder, "int8", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_quantize_and_errors(tiny_model_dir, tmp_path, capsys):
    assert cli_main(["quantize", "--model", str(tiny_model_dir), "--method", "int4", "--out", str(tmp_path / "v")]) == 0
    assert quantize.read_manifest(tmp_path / "v")["method"] == "int4-awq"  # int4: AWQ codes, our int4 kernels
    assert str(tmp_path / "v") in capsys.readouterr().out
    assert cli_main(["quantize", "--model", str(tiny_model_dir), "--method", "int3"]) == 2
    assert "unknown quantization method" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    assert cli_main(["quantize", "--model", str(tiny_model_dir), "--method", "nf4", "--out", str(tmp_path / "busy")]) == 2
    assert "other content" in capsys.readouterr().err


def test_load_model_serves_plain_directories_too(tiny_model_dir):
    model = quantize.load_model(tiny_model_dir, "cpu", None)
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "Linear" and model.dtype == torch.float32
    assert quantize.load_model(tiny_model_dir, "cpu", torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.slow
def test_default_model_nf4_through_the_engine(default_model_dir):
    """The real model, one method: greedy through the engine follows HF generate on the same variant.

    Exact up to the first step where HF's own top two tokens are within reduced-precision noise:
    bitsandbytes' CPU 4-bit kernel (like int8wo's bf16 kernel) turns the engine's and HF's tiny attention
    differences into ~0.1-nat logprob noise, enough to flip a near-tie. (With fp32 compute in the
    quantized layers both follow HF exactly; on the tiny model every method matches exactly.)
    """
    LLMEngine, SamplingParams = _serving()
    directory = quantize.quantize("smollm2-135m", "nf4")
    manifest = quantize.read_manifest(directory)
    assert manifest["weight_bytes"] < 0.35 * manifest["source"]["weight_bytes"]
    engine = LLMEngine.from_pretrained(directory, device="cpu")
    reference = quantize.load_model(directory, "cpu", None)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for text in ("The capital of France is", "def fibonacci(n):"):
        prompt = engine.tokenizer(text).input_ids
        ours = engine.generate([prompt], params)[0].token_ids
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            hf = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                                    do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        theirs = hf.sequences[0, len(prompt):].tolist()
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        if first is not None:
            logprobs = torch.log_softmax(hf.scores[first][0].float(), dim=-1)
            margin = float(logprobs[theirs[first]] - logprobs[ours[first]])
            assert margin < 0.2, f"{text!r}: token {first} differs with HF's margin {margin:.3f} (not a near-tie)"


@pytest.mark.parametrize("rows", [1, 4, 16, 40])
def test_int8wo_bf16_paths_match_the_dequantized_weight(rows):
    """The bf16 kernel path (scales inside the kernel) and the wide path agree with x @ dequant(W)^T
    to within bf16 rounding of the output."""
    from serving.model.quant.int8 import Int8WeightOnlyLinear

    torch.manual_seed(rows)
    linear = torch.nn.Linear(256, 192, bias=True).to(torch.bfloat16)
    module = Int8WeightOnlyLinear.from_linear(linear)
    x = torch.randn(1, rows, 256, dtype=torch.bfloat16)
    ref = x.float() @ module.dequantized_weight().T + linear.bias.float()
    out = module(x)
    assert out.dtype == torch.bfloat16 and out.shape == (1, rows, 192)
    assert ((out.float() - ref).abs() <= 0.02 * ref.abs() + 0.02).all()
