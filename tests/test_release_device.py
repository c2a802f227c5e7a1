"""The release's device is detected (or named), not pinned: it picks the default methods, the engine's device
and attention path, and it is in every measurement's key and the machine line. Without a GPU a CUDA release
is refused, or rehearsed in Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py): the CUDA
attention path on CPU tensors."""

from __future__ import annotations

import argparse

import pytest
import torch

from flows import machine
from flows.data import MeasureConfig, SpeedPlan, Variant
from quantize.methods import default_methods

pytest.importorskip("triton")


@pytest.fixture
def gpu_detected(monkeypatch):
    """Device detection answers CUDA, as on a machine with a GPU; torch itself still has none here."""
    monkeypatch.delenv("QUANTGATE_DEVICE", raising=False)
    monkeypatch.setattr(machine, "detect_device", lambda: "cuda")


def _release_args(*argv: str) -> argparse.Namespace:
    from flows import cli

    parser = argparse.ArgumentParser()
    cli._event_args(parser)
    return parser.parse_args(list(argv))


def test_a_detected_gpu_plans_the_cuda_methods_and_the_cpu_is_still_named(gpu_detected, monkeypatch):
    from flows.cli import chosen_methods

    assert machine.resolve_device() == "cuda"
    assert chosen_methods(_release_args()) == list(default_methods("cuda"))
    assert set(default_methods("cuda")) > set(default_methods("cpu"))
    assert chosen_methods(_release_args("--device", "cpu")) == list(default_methods("cpu"))
    monkeypatch.setenv("QUANTGATE_DEVICE", "cpu")
    assert machine.resolve_device() == "cpu"
    assert chosen_methods(_release_args("--methods", "int8wo")) == ["int8wo"]


def test_a_bad_or_missing_device_is_refused_before_anything_runs(monkeypatch):
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        machine.resolve_device("tpu")
    with pytest.raises(ValueError, match="unknown device"):
        machine.resolve_device("cuda:x")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="no CUDA GPU"):
            machine.resolve_device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rehearsal is what runs where no GPU is")
def test_the_device_is_in_the_keys_and_the_machine_line():
    cpu, cuda = machine.describe("cpu"), machine.describe("cuda")
    assert cpu["device"] == "cpu" and cuda["device"] == "cuda"
    assert machine.key(cpu) != machine.key(cuda)
    assert "on cuda (rehearsed: CPU tensors, Triton's interpreter)" in machine.line(cuda)
    assert "rehearsed" not in machine.line(cpu)
    assert MeasureConfig(device="cpu").key() != MeasureConfig(device="cuda").key()
    assert SpeedPlan(device="cpu").key() != SpeedPlan(device="cuda").key()
    assert machine.engine_placement("cuda") == {"device": "cpu", "attention": "triton"}
    assert machine.engine_placement("cpu") == {"device": "cpu", "attention": "auto"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rehearsal is what runs where no GPU is")
def test_the_flows_engines_serve_a_cuda_release_through_the_triton_attention_path(tmp_path, gpu_detected):
    """The measure and speed stages' engines for the detected device: Triton attention (on CPU tensors, in
    the interpreter), greedy fp32 tokens identical to the CPU release's torch path."""
    from words_llama import build_words_llama, word_prompts

    from flows import measuring
    from flows import speed_rounds as speed
    from serving import SamplingParams

    path = str(build_words_llama(tmp_path / "llama"))
    variant = Variant("baseline", None, path, "x")
    device = machine.resolve_device()
    cuda_engine = measuring.load_engine(variant, MeasureConfig(device=device, kv_cache_memory_gb=0.01))
    cpu_engine = measuring.load_engine(variant, MeasureConfig(device="cpu", kv_cache_memory_gb=0.01))
    assert cuda_engine.config.attention == "triton" and cpu_engine.config.attention == "torch"
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = word_prompts()[:3]
    outs = [[o.token_ids for o in e.generate(prompts, params)] for e in (cuda_engine, cpu_engine)]
    assert outs[0] == outs[1]
    engines = speed.load_engines([variant], SpeedPlan(decode_batches=(1,), device=device))
    assert engines["baseline"].config.attention == "triton"
