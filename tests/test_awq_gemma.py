"""AWQ on Gemma 3 (whose RMSNorm computes x * (1 + w)), and calibration sequences that start with <bos>."""

from __future__ import annotations

import pytest
import torch

from quantize import awq
from quantize.calibrated import Recipe, _previous_op, calibrate
from quantize.calibration import calibration_set, leading_token


def _gemma3(vocab_size: int):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                              sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # norms initialise to w = 0 (a factor of 1): give them something to keep
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def tiny_gemma3():
    return _gemma3(256)


def test_fold_into_a_gemma_norm_keeps_the_model_exact(tiny_gemma3):
    import copy

    model = copy.deepcopy(tiny_gemma3)
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        layer = model.model.layers[0]
        norm = _previous_op(layer, ["mlp.gate_proj", "mlp.up_proj"])
        assert norm is layer.pre_feedforward_layernorm  # not post_attention_layernorm (o_proj's output)
        assert awq.norm_offset(norm) == 1.0
        scales = torch.rand(64) * 2 + 0.25
        awq.fold_into_norm(norm, [layer.mlp.gate_proj, layer.mlp.up_proj], scales)
        awq.fold_into_norm(layer.input_layernorm, [layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                   layer.self_attn.v_proj], scales.flip(0))
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_awq_runs_on_gemma3_and_keeps_closer_than_its_error_bound(tiny_gemma3):
    import copy

    ids = torch.randint(0, 256, (4, 32))
    held = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        reference = tiny_gemma3(input_ids=held).logits
        errors = {}
        for algorithm in ("rtn", "awq"):
            model = copy.deepcopy(tiny_gemma3)
            codes = calibrate(model, ids, Recipe(algorithm, 32), show_progress=False)
            assert "model.layers.0.mlp.down_proj" in codes
            errors[algorithm] = (model(input_ids=held).logits - reference).pow(2).mean().item()
    assert all(torch.isfinite(torch.tensor(list(errors.values()))))
    assert errors["awq"] < 2 * errors["rtn"]  # the search keeps s = 1 when nothing beats it on calibration


class _BosTokenizer:
    """Adds <bos> = 2 by default, like Gemma's."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [10 + ord(c) % 50 for c in text]
        return {"input_ids": ([2] if add_special_tokens else []) + ids}


class _PlainTokenizer(_BosTokenizer):
    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return super().__call__(text, add_special_tokens=False)


def test_calibration_sequences_start_with_bos_when_the_tokenizer_adds_one():
    assert leading_token(_BosTokenizer()) == 2 and leading_token(_PlainTokenizer()) is None
    with_bos = calibration_set(_BosTokenizer(), 256, 64)
    plain = calibration_set(_PlainTokenizer(), 256, 64)
    assert with_bos.ids.shape == plain.ids.shape == (4, 64)
    assert (with_bos.ids[:, 0] == 2).all() and with_bos.record["bos"] == 2 and plain.record["bos"] is None
    assert torch.equal(with_bos.ids[0, 1:], plain.ids[0, :63])  # the same text after the <bos>


@pytest.mark.parametrize("method", ["int4wo", "int8wo", "int4-awq"])
def test_a_gemma_variant_keeps_the_embedding_scale(tmp_path, method, default_model_dir):
    """Gemma's embedding multiplies its rows by sqrt(hidden): the quantized table must too, built and loaded."""
    from transformers import AutoTokenizer

    import quantize

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)  # the calibration text needs one
    model, source = _gemma3(len(tokenizer)), tmp_path / "gemma"
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    opts = {"calibration_tokens": 256, "seq_len": 64} if method == "int4-awq" else {}
    variant = quantize.quantize(source, method, tmp_path / "v", **opts)
    loaded = quantize.load_model(variant, "cpu", None)
    ids = torch.tensor([[3, 50, 100, 200]])
    with torch.no_grad():
        ratio = loaded.model.embed_tokens(ids).norm() / model.model.embed_tokens(ids).norm()
    assert abs(ratio.item() - 1) < 0.1  # 1 / sqrt(64) = 0.125 when the scale is dropped
