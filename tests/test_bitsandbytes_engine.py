"""bitsandbytes LLM.int8() and NF4 variants served by the engine: the release's variant directory (built by
quantize/, loaded back on the device) runs through the engine's forward with its bitsandbytes layers unchanged,
on the torch and the Triton attention path, against HF's own forward of the same variant; and the release's
default methods per device.

On CPU (make test) bitsandbytes' CPU kernels run and the Triton kernels run in Triton's interpreter;
scripts/gpu_check.sh runs this file on CUDA (QUANTGATE_TEST_DEVICE=cuda): bitsandbytes' CUDA kernels, and decode
steps through CUDA graphs (NF4 captured; LLM.int8() waits on the host, so its buckets run eagerly)."""

from __future__ import annotations

import os

DEVICE = os.environ.get("QUANTGATE_TEST_DEVICE", "cpu")  # on CPU, tests/conftest.py sets TRITON_INTERPRET

import pytest  # noqa: E402
import torch  # noqa: E402

from quantize.methods import DEFAULT_METHODS, default_methods, get_method  # noqa: E402

BNB_METHODS = ("int8", "nf4")


def test_release_default_methods_per_device():
    assert default_methods("cpu") == ("int8wo", "int4-awq")
    assert default_methods("cuda") == default_methods("cuda:1") == ("int8wo", "int4-awq", "int8", "nf4")
    assert all(get_method(m).name == m for methods in DEFAULT_METHODS.values() for m in methods)
    assert {get_method(m).backend for m in default_methods("cuda")} == {"quantgate", "bitsandbytes"}
    with pytest.raises(ValueError, match="no default methods for device 'mps'"):
        default_methods("mps")


def test_release_flow_and_cli_take_the_defaults_of_the_flows_device():
    import argparse

    from flows import cli
    from flows.machine import resolve_device

    parser = argparse.ArgumentParser()
    cli._event_args(parser)
    assert cli.chosen_methods(parser.parse_args([])) == list(default_methods(resolve_device()))


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """The tiny Llama and its int8 and nf4 variants, built as a release builds them (fp32), on the device (on
    CUDA bitsandbytes quantizes there, as GPU users do)."""
    pytest.importorskip("bitsandbytes")
    from words_llama import build_words_llama

    import quantize

    source = build_words_llama(tmp_path_factory.mktemp("words-llama"))
    return source, {m: quantize.quantize(str(source), m, device=DEVICE) for m in BNB_METHODS}


def _engine(directory, **kwargs):
    from serving import LLMEngine

    kwargs.setdefault("isa", "torch")  # on CPU: no compiled kernels (nor their build time)
    return LLMEngine.from_pretrained(str(directory), device=DEVICE, dtype="float32", block_size=4, **kwargs)


@pytest.mark.parametrize("attention", ["torch", "triton"])
@pytest.mark.parametrize("method", BNB_METHODS)
def test_bitsandbytes_variant_through_the_engine_matches_hf(variants, method, attention):
    """One prefill: the engine's first token and top-5 logprobs against HF's forward of the same variant."""
    import bitsandbytes as bnb
    from words_llama import word_prompts

    import quantize
    from serving import SamplingParams

    if attention == "triton":
        pytest.importorskip("triton")
    engine = _engine(variants[1][method], attention=attention, cuda_graphs=False)
    layers = [m for m in engine.model.modules() if isinstance(m, bnb.nn.Linear8bitLt | bnb.nn.Linear4bit)]
    assert len(layers) == 14  # 7 Linears a layer, 2 layers: served as they are
    prompt = word_prompts()[1]
    out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=5))[0]
    reference = quantize.load_model(variants[1][method], DEVICE, torch.float32)
    with torch.inference_mode():
        logits = reference(input_ids=torch.tensor([prompt], device=DEVICE)).logits[0, -1].float()
    top = torch.log_softmax(logits, -1).topk(5)
    assert out.token_ids[0] == int(top.indices[0])
    got = dict(out.logprobs[0].top)
    gaps = [abs(got[t] - v) for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True) if t in got]
    assert len(gaps) >= 4 and max(gaps) < 0.02


@pytest.mark.parametrize("method", BNB_METHODS)
def test_bitsandbytes_greedy_through_triton_follows_the_torch_path(variants, method):
    """Several prompts, chunked prefill and prefix hits: the Triton path's greedy tokens follow the torch
    path's (8-bit activations may turn a 1e-6 attention difference into a near-tie flip, so from the third
    token on a part is allowed); on CUDA with the default graphs (NF4 captured, LLM.int8() eager)."""
    pytest.importorskip("triton")
    from words_llama import word_prompts

    from serving import SamplingParams
    from serving.kernels.cuda.graphs import CudaGraph, capture_blocker

    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True) for _ in range(4)]
    kwargs = dict(max_num_batched_tokens=8)
    ref = [o.token_ids for o in _engine(variants[1][method], attention="torch", **kwargs).generate(word_prompts(),
                                                                                                   params)]
    engine = _engine(variants[1][method], attention="triton", **kwargs)  # graphs: on CUDA by default
    out = [o.token_ids for o in engine.generate(word_prompts(), params)]
    assert all(a[:3] == b[:3] for a, b in zip(out, ref, strict=True)), (out, ref)
    assert sum(a == b for a, b in zip(out, ref, strict=True)) >= 3
    graphs = engine.runner.graphs
    assert (capture_blocker(engine.model) is not None) == (method == "int8")
    if DEVICE == "cuda":
        assert graphs is not None and graphs.graphs
        captured = all(isinstance(g, CudaGraph) for g in graphs.graphs.values())
        assert captured == (method == "nf4"), graphs.eager_reason
