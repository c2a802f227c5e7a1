"""GGUF -> HF conversion tensor by tensor (quantgate/gguf_convert.py), and the random 8B-shaped model writer.

The streamed conversion must equal what quantgate wrote before it (transformers' whole-model GGUF load in
fp32, then `save_pretrained`) bit for bit; bad input is refused before anything lands in the model cache.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from quantgate.models import ModelReferenceError, default_gguf_path, resolve_model

_NOT_WEIGHTS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja")


def _todays_conversion(gguf: Path, out: Path) -> None:
    """quantgate's converter before the streamed one (main 85a20fc `_convert`): the reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _tensors(model_dir: Path) -> dict:
    """Every tensor of a safetensors directory (single file or sharded), by name."""
    from safetensors.torch import load_file

    tensors: dict = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        part = load_file(str(file))
        assert not set(part) & set(tensors), f"{file.name} repeats tensors"
        tensors.update(part)
    return tensors


def _bit_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype == torch.float32 and a.shape == b.shape and torch.equal(
        a.view(torch.int32), b.view(torch.int32))


def test_streamed_conversion_is_bit_identical_to_todays(default_model_dir, tmp_path):
    """The default model as `resolve_model` now converts it, against the converter it replaced."""
    import torch

    from quantgate.loading import load_causal_lm

    reference = tmp_path / "reference"
    _todays_conversion(default_gguf_path(), reference)
    ours, theirs = _tensors(default_model_dir), _tensors(reference)
    assert set(ours) == set(theirs)  # the tied lm_head saved by neither
    assert "lm_head.weight" not in ours
    differing = [name for name in theirs if not _bit_equal(ours[name], theirs[name])]
    assert not differing, differing[:5]
    for name in _NOT_WEIGHTS:
        assert (default_model_dir / name).read_bytes() == (reference / name).read_bytes(), name
    assert json.loads((default_model_dir / "quantgate-converted.json").read_text())["converter"]
    index = json.loads((default_model_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ours)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in ours.values())
    state = load_causal_lm(default_model_dir, dtype=torch.float32).state_dict()  # refuses missing weights
    assert all(_bit_equal(state[name], theirs[name]) for name in theirs)
    assert torch.equal(state["lm_head.weight"], theirs["model.embed_tokens.weight"])  # tied
    shutil.rmtree(reference)  # 0.5 GB, and pytest keeps its last three runs' temp dirs


def test_shards_fill_up_to_the_cap_in_order():
    from quantgate.gguf_convert import PlannedTensor, _split

    elements = [30, 30, 50, 10, 200, 5]  # fp32: 120, 120, 200, 40, 800, 20 bytes
    tensors = [PlannedTensor(f"t{i}", None, (n,)) for i, n in enumerate(elements)]
    shards = _split(tensors, shard_bytes=400)  # a tensor over the cap gets a shard of its own
    assert [[t.name for t in shard] for shard in shards] == [["t0", "t1"], ["t2", "t3"], ["t4"], ["t5"]]


def test_an_older_conversion_is_done_again(tmp_path):
    from quantgate.models import _current_conversion

    target = tmp_path / "model"
    target.mkdir()
    assert not _current_conversion(target)
    old_marker = {"source": "x", "note": "dequantized from GGUF"}
    (target / "quantgate-converted.json").write_text(json.dumps(old_marker))
    assert not _current_conversion(target)  # the whole-model converter's marker names no converter
    (target / "quantgate-converted.json").write_text("{not json")
    assert not _current_conversion(target)


@pytest.mark.parametrize("keep", ["header", "half", "all_but_16_bytes"])
def test_a_truncated_gguf_is_refused_before_anything_is_written(tmp_path, monkeypatch, keep):
    home = tmp_path / "home"
    monkeypatch.setenv("QUANTGATE_HOME", str(home))
    source = default_gguf_path()
    size = source.stat().st_size
    cut = {"header": 1000, "half": size // 2, "all_but_16_bytes": size - 16}[keep]
    broken = tmp_path / "cut.gguf"
    with open(source, "rb") as src, open(broken, "wb") as dst:
        dst.write(src.read(cut))
    with pytest.raises(ModelReferenceError, match="truncated"):
        resolve_model(broken)
    assert not (home / "models").exists()


def _crafted_gguf(path: Path, architecture: str) -> Path:
    """A few-KB GGUF of `architecture`, with one small tensor."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("architecture", "message"), [
    ("mystery", "transformers cannot convert GGUF architecture 'mystery'"),
    ("qwen2moe", "across tensors"),
])
def test_an_architecture_that_cannot_convert_is_refused(tmp_path, monkeypatch, architecture, message):
    home = tmp_path / "home"
    monkeypatch.setenv("QUANTGATE_HOME", str(home))
    gguf = _crafted_gguf(tmp_path / f"{architecture}.gguf", architecture)
    with pytest.raises(ModelReferenceError, match=message) as info:
        resolve_model(gguf)
    assert "llama" in str(info.value) and "qwen2" in str(info.value)  # says what does convert
    assert not (home / "models").exists()


def test_random_llama_writes_one_shard_per_layer(tmp_path):
    import torch

    from benchmarks.scale_model import TINY_LLAMA, write_random_llama
    from quantgate.loading import load_causal_lm

    out = write_random_llama(tmp_path / "tiny", TINY_LLAMA, seed=0)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == TINY_LLAMA.layers + 2
    assert index["model.embed_tokens.weight"] == files[0].name
    assert index["lm_head.weight"] == index["model.norm.weight"] == files[-1].name
    for layer in range(TINY_LLAMA.layers):
        in_layer = {v for k, v in index.items() if k.startswith(f"model.layers.{layer}.")}
        assert in_layer == {files[layer + 1].name}
    assert not list(out.glob("tokenizer*"))
    model = load_causal_lm(out)  # refuses missing weights
    assert model.dtype == torch.bfloat16 and not model.config.tie_word_embeddings
    assert model.config.num_key_value_heads == TINY_LLAMA.kv_heads
    weights = model.model.layers[1].mlp.down_proj.weight.float()
    assert weights.shape == (TINY_LLAMA.hidden, TINY_LLAMA.intermediate) and 0.015 < weights.std() < 0.025
    again = _tensors(write_random_llama(tmp_path / "again", TINY_LLAMA, seed=0))
    assert all(torch.equal(again[k].float(), v.float()) for k, v in _tensors(out).items())  # seeded


def test_random_llama_refuses_when_the_disk_is_short(tmp_path, monkeypatch):
    from benchmarks import scale_model

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(scale_model.shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 10**9, 10**9))
    with pytest.raises(scale_model.NotEnoughDiskError, match=r"needs 16\.1 GB"):
        scale_model.write_random_llama(tmp_path / "big")
    assert not (tmp_path / "big").exists()


def test_random_llama_leaves_nothing_when_it_fails(tmp_path, monkeypatch):
    from benchmarks import scale_model

    def fail(*args, **kwargs):
        raise RuntimeError("disk went away")

    monkeypatch.setattr(scale_model, "write_index", fail)
    with pytest.raises(RuntimeError, match="disk went away"):
        scale_model.write_random_llama(tmp_path / "tiny", scale_model.TINY_LLAMA)
    assert not (tmp_path / "tiny").exists()
    assert shutil.disk_usage(tmp_path).free > 0 and os.listdir(tmp_path) == []
