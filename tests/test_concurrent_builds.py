"""Model construction from several threads of one process: variants built side by side are the same
bytes and the same greedy tokens as those built one after the other; a build that leaves weights on
the meta device or freshly initialised is refused before anything is written."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import quantize
from quantgate.loading import UnmaterialisedModelError, load_causal_lm
from quantize import methods as methods_mod
from quantize.methods import Method

PROMPT = [101, 2002, 3003, 404, 5005, 66, 7007]


def _greedy(directory: Path) -> list[int]:
    model = quantize.load_model(directory, "cpu", None)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _build_in_threads(source: Path, out_root: Path, methods: list[str]) -> dict[str, Path]:
    results: dict[str, Path] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(methods))

    def work(method: str) -> None:
        try:
            barrier.wait()
            results[method] = quantize.quantize(source, method, out_root / method)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(m,)) for m in methods]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


def test_two_threads_build_the_same_variants_as_one_after_the_other(tiny_model_dir, tmp_path):
    methods = ["int8", "nf4"]
    serial = {m: quantize.quantize(tiny_model_dir, m, tmp_path / "serial" / m) for m in methods}
    for attempt in range(3):  # the race it guards against struck about every second try
        parallel = _build_in_threads(tiny_model_dir, tmp_path / f"parallel-{attempt}", methods)
        for m in methods:
            ours, theirs = _tensors(parallel[m]), _tensors(serial[m])
            assert sorted(ours) == sorted(theirs), m
            for key in theirs:
                assert torch.equal(ours[key], theirs[key]), (m, key)
            assert _greedy(parallel[m]) == _greedy(serial[m]), m
            probe = quantize.read_manifest(parallel[m])["probe"]
            assert probe["logit_cosine"] > 0.9, (m, probe)


def _register(monkeypatch, name: str, build) -> None:
    spec = Method(name=name, bits=8, backend="quantgate", description="test-only", group_size=None,
                  build=build, save=lambda model, out: model.save_pretrained(out), defaults={})
    monkeypatch.setitem(methods_mod.METHODS, name, spec)


def test_a_weight_left_on_the_meta_device_fails_the_build(tiny_model_dir, tmp_path, monkeypatch):
    def build(source, opts):
        model = load_causal_lm(source, dtype=torch.float32)
        norm = model.model.layers[1].post_attention_layernorm
        norm.weight = torch.nn.Parameter(torch.empty_like(norm.weight, device="meta"))
        return model

    _register(monkeypatch, "metaleft", build)
    out = tmp_path / "variant"
    with pytest.raises(UnmaterialisedModelError, match=r"model\.layers\.1\.post_attention_layernorm\.weight"):
        quantize.quantize(tiny_model_dir, "metaleft", out)
    assert not out.exists()
    assert not list(tmp_path.glob(".variant.tmp-*"))  # the half-built directory is gone too


def test_freshly_initialised_weights_fail_the_probe_and_name_the_parameters(tiny_model_dir, tmp_path,
                                                                             monkeypatch):
    def build(source, opts):
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(1234)  # a different draw than the source's: what a broken load leaves
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source)).eval()

    _register(monkeypatch, "randomised", build)
    out = tmp_path / "variant"
    with pytest.raises(UnmaterialisedModelError, match=r"logit cosine.*model\.embed_tokens\.weight"):
        quantize.quantize(tiny_model_dir, "randomised", out)
    assert not out.exists()


def test_a_checkpoint_missing_weights_is_refused_on_load(tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for file in tiny_model_dir.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors"):
            (broken / file.name).write_bytes(file.read_bytes())
    state = _tensors(tiny_model_dir)
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnmaterialisedModelError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        load_causal_lm(broken, dtype=torch.float32)
