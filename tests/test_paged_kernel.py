"""The compiled paged-attention decode kernel (serving/kernels/cpu) against a plain torch reference, and the
engine with it against the engine's torch path and HF."""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import hf_greedy
from test_engine import assert_no_leak, engine_for, random_prompts

from serving import SamplingParams
from serving.kernels.cpu import decoder_ops as kernels
from serving.kernels.cpu import isa as isas
from serving.model import attention

PATHS = [i for i in isas.ISAS if i in isas.supported() and i != "torch"]  # every build this CPU runs


@pytest.fixture(scope="module", params=PATHS)
def op(request):
    kernel = kernels.paged_decode("cpu", request.param)
    assert kernel is not None, "the kernel must build here (g++ and Python headers are on this machine)"
    return kernel


def reference(q, k, v, tables, lengths, block_size, scale):
    """Gather each context's slots and attend in fp32."""
    kv_heads, heads, dim = k.shape[0], q.shape[1], q.shape[2]
    out = []
    for s, length in enumerate(lengths.tolist()):
        slots = torch.tensor([int(tables[s, t // block_size]) * block_size + t % block_size for t in range(length)])
        qs = q[s].float().view(kv_heads, heads // kv_heads, dim)
        probs = (qs @ k[:, slots].float().transpose(-1, -2) * scale).softmax(-1)
        out.append((probs @ v[:, slots].float()).reshape(heads, dim))
    return torch.stack(out)


def problem(dtype, heads, kv_heads, dim, block_size, lengths, seed=0, num_blocks=64):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(kv_heads, num_blocks * block_size, dim, generator=gen).to(dtype)
    v = torch.randn(kv_heads, num_blocks * block_size, dim, generator=gen).to(dtype)
    width = max(-(-n // block_size) for n in lengths)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lengths])
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    return q, k, v, tables, torch.tensor(lengths)


LENGTHS = [1, 2, 15, 16, 17, 33, 100, 255]
SHAPES = [(9, 3, 64, 16), (4, 2, 16, 4), (8, 8, 32, 16), (12, 2, 128, 16)]  # heads, kv_heads, dim, block


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-b{}".format(*s))
def test_kernel_matches_the_gathered_reference(op, dtype, tol, shape):
    heads, kv_heads, dim, bs = shape
    q, k, v, tables, lengths = problem(dtype, heads, kv_heads, dim, bs, LENGTHS)
    out = op(q, k, v, tables, lengths, bs, dim**-0.5, None, None, 0)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), reference(q, k, v, tables, lengths, bs, dim**-0.5), atol=tol, rtol=tol)


# the AVX-512-BF16 loop's instances (group 1-8; head_dim 32, 64, 96, 128, 256), the AMX loop's (group up to 16,
# head_dim a multiple of 32 up to 256), and shapes they leave to the portable loop (group 9 without AMX,
# group 17, head_dim 48)
FUSED = ([(g, 1, (32, 64, 96, 128, 256)[g % 5], 16) for g in range(1, 9)]
         + [(9, 1, 64, 16), (12, 1, 160, 16), (16, 2, 224, 16), (17, 1, 64, 16), (4, 2, 48, 16)])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", FUSED, ids=lambda s: "h{}-kv{}-d{}-b{}".format(*s))
def test_every_group_and_head_dim_matches_the_reference(op, dtype, tol, shape):
    heads, kv_heads, dim, bs = shape
    q, k, v, tables, lengths = problem(dtype, heads, kv_heads, dim, bs, [1, 16, 31, 47, 130], seed=2)
    out = op(q, k, v, tables, lengths, bs, dim**-0.5, None, None, 0)
    torch.testing.assert_close(out.float(), reference(q, k, v, tables, lengths, bs, dim**-0.5), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rising", [True, False], ids=["rising", "falling"])
def test_long_contexts_whose_largest_score_moves(op, dtype, tol, rising):
    """The one-pass softmax rescales its sums each time the running max rises: keys whose scores grow (or
    shrink) along contexts of up to 1000 tokens, so the max moves block after block (or never)."""
    lengths = [999, 1000, 520, 64]
    q, k, v, tables, lengths_t = problem(torch.float32, 9, 3, 64, 16, lengths, seed=5, num_blocks=256)
    for s, length in enumerate(lengths):
        for t in range(length):
            slot = int(tables[s, t // 16]) * 16 + t % 16
            k[:, slot] *= 0.2 + 2.5 * (t if rising else length - t) / length
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = op(q, k, v, tables, lengths_t, 16, 0.125, None, None, 0)
    torch.testing.assert_close(out.float(), reference(q, k, v, tables, lengths_t, 16, 0.125), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("length", [1, 17, 33, 46, 64])
def test_slots_past_the_context_are_never_used(op, dtype, length):
    """The last block's slots past a context's end hold whatever an earlier sequence left: NaN there must
    not reach the output (the kernel may read a whole block's K, never use those lanes)."""
    q, k, v, tables, lengths = problem(dtype, 9, 3, 64, 16, [length], seed=7)
    want = reference(q, k, v, tables, lengths, 16, 0.125)
    last = int(tables[0, (length - 1) // 16])
    k[:, last * 16 + (length - 1) % 16 + 1 : (last + 1) * 16] = float("nan")
    v[:, last * 16 + (length - 1) % 16 + 1 : (last + 1) * 16] = float("nan")
    out = op(q, k, v, tables, lengths, 16, 0.125, None, None, 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_reads_int8_and_fp8_codes(op, dtype):
    q, k, v, tables, lengths = problem(dtype, 9, 3, 64, 16, LENGTHS, seed=1)
    (kc, ks), (vc, vs) = attention.quantize_int8(k), attention.quantize_int8(v)
    out = op(q, kc, vc, tables, lengths, 16, 0.125, ks, vs, 1)
    deq_k, deq_v = kc.float() * ks.float()[..., None], vc.float() * vs.float()[..., None]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), reference(q, deq_k, deq_v, tables, lengths, 16, 0.125), atol=tol, rtol=tol)
    kb, vb = attention.encode_fp8(k), attention.encode_fp8(v)
    out = op(q, kb, vb, tables, lengths, 16, 0.125, None, None, 2)
    want = reference(q, attention.decode_fp8(kb, torch.float32), attention.decode_fp8(vb, torch.float32),
                     tables, lengths, 16, 0.125)
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


def test_kernel_refuses_what_it_cannot_read(op):
    q, k, v, tables, lengths = problem(torch.float32, 9, 3, 64, 16, [5])
    with pytest.raises(RuntimeError, match="cache dtype"):
        op(q, k.to(torch.bfloat16), v.to(torch.bfloat16), tables, lengths, 16, 0.125, None, None, 0)
    with pytest.raises(RuntimeError, match="int8 cache needs k_scale"):
        op(q, k, v, tables, lengths, 16, 0.125, None, None, 1)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        op(q[:, :8], k, v, tables, lengths, 16, 0.125, None, None, 0)


def test_the_kernel_is_off_on_request_and_on_other_devices(monkeypatch):
    assert kernels.paged_decode("cuda") is None
    monkeypatch.setenv("QUANTGATE_PAGED_KERNEL", "0")
    assert kernels.paged_decode("cpu") is None


@pytest.mark.parametrize("isa", [*PATHS, "torch"])
def test_many_sequences_with_chunked_prefill_and_preemption_match_hf(tiny_model_dir, isa):
    """40 sequences, late arrivals' chunked prefills sharing steps, a cache small enough to preempt: every
    fp32 output equals HF's, through the kernels of every path this CPU runs (attention, fused ops; each
    build with its own ISA's flags) and through the torch path (gathered groups, the model's forward)."""
    engine = engine_for(tiny_model_dir, max_num_seqs=40, max_num_batched_tokens=128, num_kv_blocks=100, isa=isa)
    assert engine.kernel_isa == isa
    assert (engine.runner.decode_kernel is not None) == (isa != "torch")
    assert (engine.runner.fast_forward is not None) == (isa != "torch")
    prompts = random_prompts(40, engine.vocab_size, seed=3)
    max_tokens = [12 + (7 * i) % 29 for i in range(40)]
    outs = engine.generate(prompts, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens])
    assert engine.stats().num_preemptions > 0
    for prompt, m, out in zip(prompts, max_tokens, outs, strict=True):
        assert out.token_ids == hf_greedy(tiny_model_dir, prompt, m), f"prompt of {len(prompt)} tokens"
    assert_no_leak(engine)


def _greedy_bf16(model_dir, prompts, monkeypatch, kernel: str, kv: str = "auto"):
    monkeypatch.setenv("QUANTGATE_PAGED_KERNEL", kernel)
    engine = engine_for(model_dir, device="cpu", dtype="bfloat16", num_kv_blocks=64, kv_cache_dtype=kv)
    assert (engine.runner.decode_kernel is not None) == (kernel == "1")
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2))
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_real_model_bf16_kernel_decodes_as_the_torch_path(default_model_dir, monkeypatch, kv):
    """bf16 on the real model (head_dim 64, blocks of 16: the AVX-512-BF16 path where the CPU has it).
    The kernel keeps scores in fp32 where the matmul path rounds them to bf16, so outputs may part: while
    the texts agree, logprobs agree to bf16 noise (mean |diff| < 0.05 nats); where they part, both picks
    are the torch path's top two, within 1 nat (the bf16 engine's logprobs sit up to 0.87 nats from the
    fp32 engine's on teacher-forced text, whichever kernels: tests/test_packed_linear.py); at least half
    of the prompts decode identically."""
    from test_engine import PROMPTS
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    fast = _greedy_bf16(default_model_dir, prompts, monkeypatch, "1", kv)
    plain = _greedy_bf16(default_model_dir, prompts, monkeypatch, "0", kv)
    gaps = []
    for a, b in zip(fast, plain, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), None)
        same = len(a.token_ids) if first is None else first
        gaps += [abs(x.logprob - y.logprob) for x, y in zip(a.logprobs[:same], b.logprobs[:same], strict=True)]
        if first is not None:
            (top, top_lp), (second, second_lp) = b.logprobs[first].top[:2]
            assert {a.token_ids[first], b.token_ids[first]} == {top, second} and top_lp - second_lp < 1.0
    print(f"mean |dlogprob| {sum(gaps) / len(gaps):.4f}, max {max(gaps):.3f}")
    assert sum(gaps) / len(gaps) < 0.05
    assert sum(a.token_ids == b.token_ids for a, b in zip(fast, plain, strict=True)) >= len(prompts) // 2


def test_the_attention_benchmark_measures_both_paths(monkeypatch, tmp_path):
    import benchmarks.attention as bench

    monkeypatch.setattr(bench, "CACHE_BLOCKS", 64)
    monkeypatch.setattr(bench, "SHAPES", ((2, 40),))
    assert bench.main(["--dtype", "float32", "--out-dir", str(tmp_path), "--no-plots"]) == 0
    (row,) = json.loads((tmp_path / "attention.json").read_text())["rows"]
    assert row["sequences"] == 2 and row["context"] == 40
    assert row["kernel_ms"] > 0 and row["torch_ms"] > 0 and row["speedup"] == pytest.approx(row["torch_ms"] / row["kernel_ms"])
