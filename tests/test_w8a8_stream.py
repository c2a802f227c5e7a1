"""w8a8 streamed one decoder layer at a time (quantize/w8a8_stream.py): the in-memory build's tensors, metadata and
smoothing choices bit for bit, tied and untied, sharded or not; a tensor never written is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_quantize_stream import _assert_same

import quantize
from quantize import streaming
from quantize.methods import get_method
from quantize.variant_writer import open_variant_file
from quantize.w8a8_stream import plan_w8a8, stream_w8a8


def _both(source: Path, tmp: Path, **options) -> tuple[Path, Path, dict, dict]:
    spec = get_method("w8a8")
    opts = spec.options({"calibration_tokens": 256, "seq_len": 64, **options})
    old, new = tmp / "in-memory", tmp / "streamed"
    model = spec.build(source, opts)
    spec.save(model, old)
    chosen = model.quantgate_record["algorithm"]["chosen"]
    del model
    streamed = stream_w8a8(source, opts, new, show_progress=False)
    return old, new, chosen, streamed


@pytest.fixture(scope="module")
def untied_sharded(tiny_model_dir, tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM

    source = tmp_path_factory.mktemp("w8a8-untied") / "sharded"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.tie_word_embeddings = False
    generator = torch.Generator().manual_seed(3)
    head = model.lm_head.weight.detach().clone() * 1.5
    head[:, :4] *= 1 + 30 * torch.rand(head.shape[0], 4, generator=generator)  # wide columns: worth smoothing
    model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(source, max_shard_size="200KB")
    for file in tiny_model_dir.iterdir():  # the tokenizer the calibration reads
        if "token" in file.name:
            shutil.copy2(file, source / file.name)
    assert (source / "model.safetensors.index.json").is_file()
    return source


def test_streamed_equals_the_in_memory_build_on_a_tied_model(tiny_model_dir, tmp_path):
    old, new, chosen, streamed = _both(tiny_model_dir, tmp_path)
    _assert_same(old, new, "w8a8")
    assert streamed["record"]["algorithm"]["chosen"] == chosen
    assert chosen["lm_head"] is None and any(a is not None for a in chosen.values())
    assert streamed["probe"]["logit_cosine"] > 0.99 and len(streamed["probe"]["layers"]) == 2


@pytest.mark.parametrize("options", [{}, {"quantize_embeddings": False}, {"quantize_lm_head": False}])
def test_streamed_equals_the_in_memory_build_untied_and_sharded(untied_sharded, tmp_path, options):
    old, new, chosen, streamed = _both(untied_sharded, tmp_path, **options)
    _assert_same(old, new, "w8a8")
    assert streamed["record"]["algorithm"]["chosen"] == chosen
    if not options:  # the head's own smoothing, searched over its row blocks
        assert chosen["lm_head"] is not None and streamed["tensors"]["lm_head"]["smoothed"] is True


def test_quantize_streams_w8a8_and_records_it(tiny_model_dir, tmp_path):
    out = quantize.quantize(tiny_model_dir, "w8a8", tmp_path / "v", calibration_tokens=256, seq_len=64)
    manifest = quantize.read_manifest(out)
    assert manifest["algorithm"]["streamed"] == "one decoder layer at a time"
    assert manifest["probe"]["kind"] == "layer by layer" and manifest["probe"]["logit_cosine"] > 0.99
    ids = torch.tensor([[5, 900, 17, 3000, 42, 7]])
    with torch.inference_mode():
        logits = quantize.load_model(out, "cpu", torch.float32)(input_ids=ids).logits
    assert torch.isfinite(logits).all()


def test_a_tensor_never_written_is_refused(tiny_model_dir, tmp_path):
    plan, tied = plan_w8a8(tiny_model_dir, get_method("w8a8").options({}))
    assert tied
    with pytest.raises(ValueError, match="never written"):
        with open_variant_file(tmp_path / "w8a8.safetensors", plan.specs, plan.metadata) as writer:
            for key in list(plan.specs)[1:]:
                writer.write(key, torch.zeros(plan.specs[key][1]))
    assert streaming.streamable(tiny_model_dir)
