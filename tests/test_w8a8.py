"""W8A8 (serving/kernels/cpu/w8a8.cpp, serving/model/quant/w8a8.py, quantize/w8a8.py): the op's codes and sums
exactly as torch computes them, the smoothing's choice on crafted outliers, and the variant built, saved,
loaded and served: the engine's greedy tokens equal transformers' own generate over the loaded layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantize
from quantize.w8a8 import InputStats, _error, smooth_inputs
from serving import LLMEngine, SamplingParams
from serving.kernels.cpu import isa as isas
from serving.kernels.cpu import w8a8 as kernel
from serving.kernels.cpu import wo_bf16
from serving.model.quant.int8 import Int8Embedding
from serving.model.quant.w8a8 import Int8DynamicLinear, reference_linear

needs_op = pytest.mark.skipif(kernel.linear_op() is None, reason="no C++ compiler for the kernels")
needs_vnni = pytest.mark.skipif(kernel.linear_op() is None or not kernel.vnni_ready(), reason="no AVX-512 VNNI here")


def _problem(m: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (torch.rand(k, generator=g) * 4)  # channels of unequal range
    weight = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) + 0.01
    inv_smooth = 1.0 / (torch.rand(k, generator=g) + 0.5)
    return x, weight, scales, inv_smooth


@needs_op
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (5, 13, 16), (33, 1000, 40), (70, 576, 192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_equals_its_torch_reference_exactly(m, k, n, dtype):
    x, weight, scales, inv_smooth = _problem(m, k, n)
    x = x.to(dtype)
    got = kernel.linear_op()(x, weight, scales, inv_smooth)
    assert got.dtype == dtype and got.shape == (m, n)
    assert torch.equal(got, reference_linear(x, weight, scales, inv_smooth))


@needs_vnni
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (5, 16, 16), (9, 1000, 160), (70, 576, 192), (17, 576, 960)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vnni_kernel_equals_the_reference_exactly(m, k, n, dtype):
    """Every row count of the 8-row block and its tails, 1-3 tiles a block; the +128 taken back exactly."""
    x, weight, scales, inv_smooth = _problem(m, k, n, seed=m)
    x = x.to(dtype)
    compensation = 128 * weight.to(torch.int32).sum(1, dtype=torch.int32)
    packed = wo_bf16.pack_int8(weight, 4)
    got = kernel.vnni_op()(x, packed, compensation, scales, inv_smooth)
    assert torch.equal(got, reference_linear(x, weight, scales, inv_smooth))
    if dtype == torch.bfloat16:  # the bf16 paths' convention: bf16 rows in, the engine's dtype out
        wide = kernel.vnni_op(bf16_rows=True)(x, packed, compensation, scales, inv_smooth, torch.float32)
        assert torch.equal(wide, reference_linear(x.float(), weight, scales, inv_smooth))


@needs_op
def test_zero_rows_and_rows_of_zeros():
    x, weight, scales, inv_smooth = _problem(3, 64, 32)
    op = kernel.linear_op()
    assert op(x[:0], weight, scales, inv_smooth).shape == (0, 32)
    x[1] = 0
    assert torch.equal(op(x, weight, scales, inv_smooth)[1], torch.zeros(32))


@needs_op
def test_bad_input_is_a_clear_error():
    x, weight, scales, inv_smooth = _problem(3, 64, 32)
    with pytest.raises(RuntimeError, match="weight must be contiguous int8"):
        kernel.linear_op()(x, weight.float(), scales, inv_smooth)
    with pytest.raises(RuntimeError, match="inv_smooth must be fp32"):
        kernel.linear_op()(x, weight, scales, inv_smooth[:10])


def test_the_layer_is_close_to_the_linear_it_quantizes_and_smoothing_undoes_itself():
    torch.manual_seed(0)
    linear = nn.Linear(256, 64, bias=True)
    x = torch.randn(8, 256)
    smooth = torch.rand(256) + 0.5
    layer = Int8DynamicLinear.from_linear(linear, smooth)
    assert torch.allclose(layer.dequantized_weight(), linear.weight, atol=float(2 * linear.weight.detach().abs().max() / 127))
    y, want = layer(x), linear(x)
    assert (y - want).norm() / want.norm() < 0.02
    rows = x.bfloat16().float() if layer.bf16_rows() else x  # a bf16 path's kernel reads bf16 rows
    assert torch.equal(y, reference_linear(rows, layer.plain_weight(), layer.scales, layer.inv_smooth) + linear.bias)


def test_smoothing_is_chosen_where_a_channel_holds_outliers_and_never_loses_to_none():
    torch.manual_seed(0)
    x = torch.randn(256, 128)
    x[:, 7] *= 60  # one outlier channel, as LLM activations have
    linears = [nn.Linear(128, 32, bias=False), nn.Linear(128, 16, bias=False)]
    stats = InputStats(names=["a", "b"], peak=x.abs().amax(0), rows=[x])
    choice = smooth_inputs(stats, linears, fixed=False)
    smooth, alpha = choice["a"]
    assert alpha is not None and choice["b"][0] is smooth
    weight = torch.cat([m.weight for m in linears]).detach()
    assert _error(x, weight, smooth) < 0.5 * _error(x, weight, None)
    assert smooth_inputs(stats, linears, fixed=True)["a"] == (None, None)


def test_the_variant_builds_loads_and_serves_as_transformers_runs_its_layers(tiny_model_dir):
    variant = quantize.quantize(str(tiny_model_dir), "w8a8")
    loaded = quantize.load_model(variant, "cpu", torch.float32)
    layers = [m for m in loaded.modules() if isinstance(m, Int8DynamicLinear)]
    assert len(layers) == 2 * 7 + 1  # every projection of both layers and the lm_head
    assert any(bool((m.inv_smooth != 1).any()) for m in layers)
    embed, head = loaded.get_input_embeddings(), loaded.get_output_embeddings()
    assert isinstance(embed, Int8Embedding)  # tied: one table, the lm_head's quads where the VNNI kernel serves it
    if head.kernel_kind() == "vnni":
        assert embed._packed is head.kernel_layout() and head.weight_int8.numel() == 0
    else:
        assert embed.weight_int8 is head.weight_int8
    assert torch.equal(head.inv_smooth, torch.ones(head.in_features))

    prompt = [100 + (7 * j) % 3000 for j in range(11)]
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        want = loaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                               do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    engine = LLMEngine.from_pretrained(str(variant), device="cpu", dtype="float32", max_num_seqs=2, block_size=4,
                                       num_kv_blocks=64, enable_prefix_caching=False)
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == want


@needs_op
@pytest.mark.parametrize("path", [p for p in ("avx512bf16", "avx2") if p in isas.supported()])
def test_the_benchmark_pairs_every_format_against_the_path_baseline(path, tmp_path):
    import json

    from benchmarks.w8a8_linear import main

    assert main(["--path", path, "--rows", "3", "--shapes", "64x64", "--layers", "2", "--rounds", "2",
                 "--out-dir", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "w8a8_linear.json").read_text())["rows"][0]
    assert set(row["ms"]) >= {"baseline", "w8a8_int_mm"} and len(row["w8a8_int_mm_speedup"]) == 3
    assert ("w8a8_vnni" in row["ms"]) == kernel.vnni_ready()
