"""The fp32 attention of a fresh prompt (serving/kernels/cpu/prefill_attention_fp32.cpp), built for every
instruction set this CPU runs (avx512, avx2, scalar), against torch's fp32 flash kernel as the engine hands it
its tensors; and an fp32 engine with it against one without."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_prefill_attention import engine_views as bf16_engine_views

from serving import LLMEngine, SamplingParams
from serving.kernels.cpu import decoder_ops
from serving.kernels.cpu import isa as isas

BUILDS = [p for p in ("avx512", "avx2", "scalar") if p in isas.supported()]
SWITCH = "QUANTGATE_PREFILL_ATTENTION"


@pytest.fixture(scope="module", params=BUILDS)
def op(request):
    kernel = decoder_ops.prefill_attention("cpu", request.param, torch.float32)
    assert kernel is not None, f"the kernel must build and run here (path {request.param}, g++ on this machine)"
    return kernel


def engine_views(length, heads, kv_heads, dim, seed=0):
    return bf16_engine_views(length, heads, kv_heads, dim, seed, dtype=torch.float32)


def torch_attention(q, k, v, scale):
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], is_causal=True, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[0])
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("shape", [(9, 3, 64), (14, 2, 64), (8, 8, 128), (4, 2, 48), (2, 1, 16)],
                         ids=lambda s: "h{}-kv{}-d{}".format(*s))
@pytest.mark.parametrize("length", [1, 2, 5, 6, 7, 12, 13, 16, 17, 33, 100, 255, 600])
def test_matches_torchs_fp32_kernel(op, shape, length):
    heads, kv_heads, dim = shape
    q, k, v = engine_views(length, heads, kv_heads, dim, seed=length)
    out = op(q, k, v, dim**-0.5)
    assert out.dtype == torch.float32 and out.shape == (length, heads, dim) and out.is_contiguous()
    assert (out - torch_attention(q, k, v, dim**-0.5)).abs().max().item() <= 2e-6


def test_a_chunk_whose_values_pass_l2_goes_to_torchs_kernel(op):
    """Past 2,048 x 64 values of V a KV head (kMaxValueFloats) the op hands the chunk to torch: its result exactly."""
    q, k, v = engine_views(1025, 4, 2, 128, seed=9)
    assert torch.equal(op(q, k, v, 128**-0.5), torch_attention(q, k, v, 128**-0.5).contiguous())


def test_a_rows_output_does_not_depend_on_the_rows_after_it(op):
    """Causal, and computed so: the first n rows of a longer prompt come out to the bit as the n-row prompt's."""
    q, k, v = engine_views(300, 9, 3, 64, seed=3)
    whole = op(q, k, v, 0.125)
    for n in (1, 6, 12, 13, 129, 299):
        assert torch.equal(op(q[:n], k[:, :n], v[:, :n], 0.125), whole[:n]), n


def test_refuses_what_it_cannot_compute(op):
    q, k, v = engine_views(8, 4, 2, 64)
    with pytest.raises(RuntimeError, match="float32"):
        op(q.bfloat16(), k, v, 0.125)
    with pytest.raises(RuntimeError, match="head_dim"):
        op(*engine_views(8, 4, 2, 40), 0.125)
    with pytest.raises(RuntimeError, match="kv_heads"):
        op(*engine_views(8, 3, 2, 64), 0.125)
    assert decoder_ops.prefill_fits(48, torch.float32) and not decoder_ops.prefill_fits(40, torch.float32)


def test_every_fp32_path_has_one_but_torchs(monkeypatch):
    for path in isas.supported():
        kernel = decoder_ops.prefill_attention("cpu", path, torch.float32)
        assert (kernel is None) == (path == "torch"), path
    monkeypatch.setenv(SWITCH, "0")
    assert all(decoder_ops.prefill_attention("cpu", path, torch.float32) is None for path in isas.supported())


@pytest.mark.parametrize("path", [isas.best(), "avx2"] if isas.best() != "avx2" and "avx2" in BUILDS else [isas.best()])
def test_an_fp32_engine_scores_prompts_as_with_torchs_kernel(default_model_dir, monkeypatch, path):
    """The default model's prompt logprobs and greedy tokens, fp32 with the kernel and with torch's flash kernel:
    the same tokens, logprobs within float32 rounding. Several prompts in one step, one longer than the step
    budget (its second chunk attends to cached K/V through torch's kernel, as every chunk with a cached prefix does)."""
    prompts = [[100 + (7 * i + 13 * j) % 3000 for j in range(n)] for i, n in enumerate((3, 40, 130, 300))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    runs = {}
    for name, switch in (("kernel", "1"), ("torch", "0")):
        monkeypatch.setenv(SWITCH, switch)
        engine = LLMEngine.from_pretrained(str(default_model_dir), device="cpu", dtype="float32", isa=path,
                                           enable_prefix_caching=False, max_num_batched_tokens=256)
        assert (engine.runner.prefill_kernel is not None) == (name == "kernel")
        runs[name] = engine.generate(prompts, params)
    for mine, theirs in zip(runs["kernel"], runs["torch"], strict=True):
        assert mine.token_ids == theirs.token_ids
        gaps = [abs(a.logprob - b.logprob) for a, b in zip(mine.prompt_logprobs, theirs.prompt_logprobs, strict=True)
                if a is not None]
        assert max(gaps) <= 1e-3, max(gaps)
