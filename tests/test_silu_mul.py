"""fused_ops.cpp silu_mul: F.silu(gate) * up for bf16 rows to the bit (every bf16 gate value, strided rows, NaN
and inf), on every kernel path this CPU runs; the engine takes it for bf16 models and gives the same tokens and
logprobs as with torch's two ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serving import LLMEngine, SamplingParams
from serving.kernels.cpu import isa as isas
from serving.kernels.cpu.decoder_ops import fused_ops
from serving.model import llama_forward

PATHS = [p for p in isas.supported() if p != "torch"]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit where not NaN, NaN where NaN."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])


@pytest.mark.parametrize("path", PATHS)
def test_silu_mul_is_torchs_silu_times_up_for_every_bf16_value(path):
    ops = fused_ops("cpu", path)
    if ops is None:
        pytest.skip(f"no compiler for the {path} build")
    every = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(128, 512)
    gate_up = torch.cat([every, torch.randn(128, 512, generator=torch.Generator().manual_seed(0)).bfloat16()], 1)
    gate, up = gate_up[:, :512], gate_up[:, 512:]  # strided rows, as a fused gate/up projection hands them over
    out = ops.silu_mul(gate, up)
    assert out.shape == (128, 512) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert _same(out, F.silu(gate) * up)
    edges = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -100.0, 100.0, 3e38]]).bfloat16()
    assert _same(ops.silu_mul(edges, torch.full_like(edges, 1.5)), F.silu(edges) * 1.5)
    assert ops.silu_mul(gate[:0], up[:0]).shape == (0, 512)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.silu_mul(gate.float(), up.float())
    with pytest.raises(RuntimeError, match="alike"):
        ops.silu_mul(gate, up[:, :8])
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.silu_mul(gate.t(), up.t())


def _greedy(model_dir: str, dtype: str):
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", dtype=dtype, enable_prefix_caching=False)
    forward = engine.runner.fast_forward
    prompts = [[100 + (7 * i + 13 * j) % 3000 for j in range(5 + 40 * i)] for i in range(4)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1))
    return forward, [o.token_ids for o in outs], [lp.logprob for o in outs for lp in o.logprobs]


def test_the_bf16_engine_decodes_alike_with_the_fused_silu(default_model_dir, monkeypatch):
    """Prefill and decode (the C++ decode step too) with silu_mul and with torch's ops: the same bits."""
    forward, tokens, logprobs = _greedy(str(default_model_dir), "bfloat16")
    if forward is None or forward.silu_mul is None:
        pytest.skip("the fused forward does not run here")
    assert forward.step is None or forward.step.plan is not None
    monkeypatch.setattr(llama_forward, "silu_mul_op", lambda ops, dtype: None)
    plain, plain_tokens, plain_logprobs = _greedy(str(default_model_dir), "bfloat16")
    assert plain.silu_mul is None
    assert tokens == plain_tokens and logprobs == plain_logprobs


def test_fp32_keeps_torchs_ops():
    """fp32's token identity with HF rests on torch's own exp: the fused op is taken for bf16 only."""
    ops = fused_ops("cpu")
    if ops is None:
        pytest.skip("no compiler for the fused ops")
    assert llama_forward.silu_mul_op(ops, torch.bfloat16) is not None
    assert llama_forward.silu_mul_op(ops, torch.float32) is None
