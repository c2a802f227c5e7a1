"""Streaming int8wo / int4wo (quantize/streaming.py): the same tensors and metadata as the in-memory build, bit for
bit; the per-tensor probe; a variant loaded without a second copy; bad input refused before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import quantize
from quantgate.loading import UnmaterialisedModelError
from quantize import streaming
from quantize.methods import get_method
from quantize.probe import check_streamed
from serving.model.quant.checkpoint import load_weight_only


def _both_builds(source: Path, method: str, tmp: Path, **options) -> tuple[Path, Path, streaming.Plan]:
    spec = get_method(method)
    opts = spec.options(options)
    old, new = tmp / "in-memory", tmp / "streamed"
    model = spec.build(source, opts)
    spec.save(model, old)
    del model
    plan = streaming.plan_stream(source, method, opts)
    streaming.write_stream(plan, new)
    return old, new, plan


def _assert_same(old: Path, new: Path, method: str) -> None:
    file = streaming.WEIGHTS_FILES[method]
    with safe_open(str(old / file), "pt") as a, safe_open(str(new / file), "pt") as b:
        assert a.metadata() == b.metadata()
        assert sorted(a.keys()) == sorted(b.keys())
        for key in a.keys():
            x, y = a.get_tensor(key), b.get_tensor(key)
            assert x.dtype == y.dtype and torch.equal(x, y), key
    for name in ("config.json", "generation_config.json"):
        assert json.loads((old / name).read_text()) == json.loads((new / name).read_text()), name


@pytest.mark.parametrize("method", ["int8wo", "int4wo"])
def test_streamed_build_equals_the_in_memory_build_on_the_default_model(default_model_dir, tmp_path, method):
    old, new, plan = _both_builds(default_model_dir, method, tmp_path)
    _assert_same(old, new, method)
    assert json.loads(plan.metadata["tied"])  # SmolLM2 ties lm_head to the embedding: stored once
    check = check_streamed(plan, new / streaming.WEIGHTS_FILES[method])
    assert check.tensors == len(plan.jobs) and check.worst_ratio <= 1.0
    assert check.relative_error < (0.02 if method == "int8wo" else 0.2)


@pytest.mark.parametrize("method,options", [
    ("int8wo", {"quantize_lm_head": False}),
    ("int8wo", {"quantize_embeddings": False, "dtype": "bfloat16"}),
    ("int4wo", {"group_size": 64, "quantize_lm_head": False}),
    ("int4wo", {"dtype": "bfloat16"}),
])
def test_streamed_build_equals_the_in_memory_build_for_every_option(tiny_model_dir, tmp_path, method, options):
    old, new, _ = _both_builds(tiny_model_dir, method, tmp_path, **options)
    _assert_same(old, new, method)


def test_sharded_untied_bf16_source_streams_and_loads_like_the_in_memory_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    source = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 1.5)
    model.save_pretrained(source, max_shard_size="200KB")
    assert (source / "model.safetensors.index.json").is_file()
    old, new, _ = _both_builds(source, "int8wo", tmp_path, dtype="bfloat16")
    _assert_same(old, new, "int8wo")
    ids = torch.tensor([[5, 900, 17, 3000, 42]])
    with torch.inference_mode():
        ours = load_weight_only(new, method="int8wo")(input_ids=ids).logits
        theirs = _in_memory_model(source, "int8wo", dtype="bfloat16")(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs)


def _in_memory_model(source: Path, method: str, **options):
    spec = get_method(method)
    return spec.build(source, spec.options(options))


@pytest.mark.parametrize("method", ["int8wo", "int4wo"])
def test_quantize_streams_checks_per_tensor_and_the_variant_serves_as_before(tiny_model_dir, tmp_path, method):
    out = quantize.quantize(tiny_model_dir, method, tmp_path / method)
    probe = quantize.read_manifest(out)["probe"]
    assert probe["kind"] == "per-tensor" and probe["worst_error_over_bound"] <= 1.0, probe
    ids = torch.tensor([[5, 900, 17, 3000, 42, 7]])
    with torch.inference_mode():
        ours = quantize.load_model(out)(input_ids=ids).logits
        theirs = _in_memory_model(tiny_model_dir, method)(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs)


def test_per_tensor_probe_catches_values_that_are_not_the_sources(tiny_model_dir, tmp_path):
    spec = get_method("int8wo")
    plan = streaming.plan_stream(tiny_model_dir, "int8wo", spec.options({}))
    weights = streaming.write_stream(plan, tmp_path / "v")
    name = next(j.outputs[0] for j in plan.jobs if j.kind == "int8" and "layers.1" in j.outputs[0])
    start, _ = plan.offsets[name]
    with open(weights, "r+b") as handle:  # one row of codes zeroed, as a write that never happened
        header = int.from_bytes(handle.read(8), "little")
        handle.seek(8 + header + start)
        handle.write(bytes(64))
    with pytest.raises(UnmaterialisedModelError, match=name.replace(".", r"\.")):
        check_streamed(plan, weights)


def test_missing_shard_is_refused_before_any_work_and_nothing_is_left(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    source = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(source, max_shard_size="200KB")
    shards = sorted(source.glob("model-*.safetensors"))
    shards[1].unlink()
    root = quantize.variants_root()
    before = sorted(p.name for p in root.iterdir()) if root.exists() else []
    for method in ("int8wo", "nf4"):
        with pytest.raises(ValueError, match=f"missing: {shards[1].name}"):
            quantize.quantize(source, method)
        with pytest.raises(ValueError, match="missing"):
            quantize.quantize(source, method, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert (sorted(p.name for p in root.iterdir()) if root.exists() else []) == before


def test_a_config_the_engine_cannot_build_is_refused_before_any_work(tiny_model_dir, tmp_path):
    source = tmp_path / "bad-config"
    shutil.copytree(tiny_model_dir, source)
    config = json.loads((source / "config.json").read_text())
    config["num_attention_heads"] = 0  # no attention heads: the model cannot be built
    (source / "config.json").write_text(json.dumps(config))
    root = quantize.variants_root()
    before = sorted(p.name for p in root.iterdir()) if root.exists() else []
    with pytest.raises(ValueError, match="cannot build this model from its config.json"):
        quantize.quantize(source, "int8wo")
    with pytest.raises(ValueError, match="cannot build this model"):
        quantize.quantize(source, "int4wo", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert (sorted(p.name for p in root.iterdir()) if root.exists() else []) == before


def test_loading_a_variant_holds_its_weights_once(default_model_dir, tmp_path):
    """Peak anonymous memory while loading stays well under twice the weights (the old load held the zeroed
    layers and the file's copy at once)."""
    import subprocess
    import sys

    out = quantize.quantize(default_model_dir, "int8wo", tmp_path / "v")
    size = (out / "int8wo.safetensors").stat().st_size
    code = ("import sys, torch, threading, time\n"
            "from pathlib import Path\n"
            "from serving.model.quant.checkpoint import load_weight_only\n"
            "from transformers import LlamaForCausalLM  # imported before the baseline\n"
            "def anon():\n"
            "    line = [l for l in open('/proc/self/status') if l.startswith('RssAnon')][0]\n"
            "    return int(line.split()[1]) * 1024\n"
            "peak, done = [0], []\n"
            "def watch():\n"
            "    while not done:\n"
            "        peak[0] = max(peak[0], anon()); time.sleep(0.01)\n"
            "base = anon(); t = threading.Thread(target=watch); t.start()\n"
            "model = load_weight_only(Path(sys.argv[1]), method='int8wo')\n"
            "done.append(1); t.join(); print(peak[0] - base)\n")
    result = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, check=True)
    grown = int(result.stdout.strip().splitlines()[-1])
    assert grown < 1.6 * size, (grown, size)
