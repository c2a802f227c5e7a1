"""int4-gptq / int4-awq built one decoder layer at a time (quantize/calibrated_stream.py): the same tensors,
bit for bit, as the in-memory build on tied and untied models, with its probe run layer by layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quantize.calibrated_build import build_calibrated, recipe_of
from quantize.calibrated_stream import stream_calibrated
from quantize.methods import get_method

CALIBRATION = {"calibration_tokens": 512, "seq_len": 128}


@pytest.fixture(scope="module")
def untied_llama_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """The tiny Llama with its own lm_head (an 8B-style untied head), q/k/v biases off."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("untied") / "model"
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = False
    torch.manual_seed(3)
    LlamaForCausalLM(config).to(torch.float32).eval().save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


def _tensors(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    with safe_open(str(path / "int4wo.safetensors"), "pt") as handle:
        return handle.metadata(), {k: handle.get_tensor(k) for k in handle.keys()}


@pytest.mark.parametrize(("algorithm", "model"), [("gptq", "tied"), ("awq", "untied")])
def test_streamed_equals_in_memory(tiny_model_dir, untied_llama_dir, tmp_path, algorithm, model):
    source = tiny_model_dir if model == "tied" else untied_llama_dir
    spec = get_method(f"int4-{algorithm}")
    opts = spec.options(CALIBRATION)
    built = build_calibrated(source, opts, algorithm, show_progress=False)
    spec.save(built, tmp_path / "in-memory")
    streamed = stream_calibrated(source, opts, recipe_of(algorithm, opts), tmp_path / "streamed", show_progress=False)
    (meta_a, a), (meta_b, b) = _tensors(tmp_path / "in-memory"), _tensors(tmp_path / "streamed")
    assert meta_a == meta_b and sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert json.loads((tmp_path / "in-memory/config.json").read_text()) == json.loads(
        (tmp_path / "streamed/config.json").read_text())
    probe = streamed["probe"]
    assert probe["kind"] == "layer by layer" and len(probe["layers"]) == 2
    assert probe["logit_cosine"] > 0.5 and all(0 < e < 1 for e in probe["layers"])
    assert streamed["record"]["calibration"]["tokens"] == 512


def test_quantize_streams_a_calibrated_variant_and_serves_it(tiny_model_dir, tmp_path):
    """Through the public API: the manifest says the build was streamed, and the engine serves it."""
    import quantize
    from serving import LLMEngine, SamplingParams

    out = tmp_path / "awq"
    quantize.quantize(str(tiny_model_dir), "int4-awq", out, **CALIBRATION)
    manifest = json.loads((out / "quantgate.json").read_text())
    assert manifest["probe"]["kind"] == "layer by layer"
    assert manifest["algorithm"]["streamed"] == "one decoder layer at a time"
    engine = LLMEngine.from_pretrained(str(out), dtype="float32")
    tokens = engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids
    assert len(tokens) == 4
