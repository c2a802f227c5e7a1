"""serving/kernels/cuda's Triton kernels against the torch path (serving/model/attention.py): the K/V store, paged decode,
prefill over cached context; then the engine through them, greedy token-identical to the torch path in fp32
(chunked prefill, prefix hits, preemption, graph buckets), bf16 within tolerance.

On CPU (make test) the kernels run on CPU tensors in Triton's interpreter and graphs in their eager stand-in;
scripts/gpu_check.sh runs the same file on CUDA (QUANTGATE_TEST_DEVICE=cuda). The model is a tiny random
Llama with a word-level tokenizer built here, so nothing needs the default model's package."""

from __future__ import annotations

import os

DEVICE = os.environ.get("QUANTGATE_TEST_DEVICE", "cpu")  # on CPU, tests/conftest.py sets TRITON_INTERPRET

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from words_llama import VOCAB, build_words_llama, word_prompts  # noqa: E402

from serving.kernels.cuda.attention import attend as triton_attend  # noqa: E402
from serving.kernels.cuda.step import PagedStep  # noqa: E402
from serving.model import attention  # noqa: E402
from serving.model.attention import AttentionContext, DecodeGroup, PrefillChunk  # noqa: E402

KV_HEADS, HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 6, 16, 4, 24


def _scenario(seed: int, dtype: torch.dtype):
    """Decode rows of three sequences, then a fresh prompt and a chunk over 9 cached tokens."""
    gen = torch.Generator().manual_seed(seed)
    decode_lens, prompt_len, chunk, cached = [1, 6, 13], 7, 6, 9
    blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, lens = [], [*decode_lens, prompt_len, cached + chunk]
    for n in lens:
        need = -(-n // BLOCK_SIZE)
        tables.append(blocks[:need])
        blocks = blocks[need:]
    slots_of = [[t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)] for t, n in zip(tables, lens, strict=True)]
    new_rows = [1, 1, 1, prompt_len, chunk]  # tokens computed this step per sequence
    slot_mapping = torch.tensor([s for slots, k in zip(slots_of, new_rows, strict=True) for s in slots[len(slots) - k:]])
    tokens = sum(new_rows)
    k_cache = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    key = torch.randn(KV_HEADS, tokens, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(KV_HEADS, tokens, HEAD_DIM, generator=gen).to(dtype)
    return dict(tables=tables, lens=lens, slots_of=slots_of, slot_mapping=slot_mapping.to(DEVICE),
                k_cache=k_cache.to(DEVICE), v_cache=v_cache.to(DEVICE), q=q.to(DEVICE), key=key.to(DEVICE),
                value=value.to(DEVICE), prompt_len=prompt_len, chunk=chunk)


def _torch_context(s, k_cache, v_cache) -> AttentionContext:
    width = max(len(t) for t in s["tables"][:3])
    tables = torch.tensor([t + [0] * (width - len(t)) for t in s["tables"][:3]])
    lens = torch.tensor(s["lens"][:3])
    pad = torch.arange(width * BLOCK_SIZE)[None, :] >= lens[:, None]
    group = DecodeGroup(0, tables.view(-1).to(DEVICE), pad[None, :, None, :].to(DEVICE), lens)
    prompt = PrefillChunk(3, s["prompt_len"], s["prompt_len"], None)
    chunk = PrefillChunk(3 + s["prompt_len"], s["chunk"], s["lens"][4], torch.tensor(s["slots_of"][4], device=DEVICE))
    return AttentionContext([k_cache], [v_cache], BLOCK_SIZE, s["slot_mapping"], [prompt, chunk], [group])


def _triton_step(s) -> PagedStep:
    prefills = [(3, s["prompt_len"], s["prompt_len"]), (3 + s["prompt_len"], s["chunk"], s["lens"][4])]
    return PagedStep.build(s["tables"][:3], s["lens"][:3], s["tables"][3:], prefills, DEVICE)


@pytest.mark.parametrize("dtype,window", [(torch.float32, None), (torch.float32, 5), (torch.bfloat16, None)])
def test_store_decode_and_prefill_match_the_torch_path(dtype, window):
    s = _scenario(0, dtype)
    ref_k, ref_v = s["k_cache"].clone(), s["v_cache"].clone()
    ref = attention.attend(_torch_context(s, ref_k, ref_v), 0, s["q"], s["key"], s["value"], None, window=window)
    k_cache, v_cache = s["k_cache"].clone(), s["v_cache"].clone()
    out = triton_attend(_triton_step(s), k_cache, v_cache, BLOCK_SIZE, s["slot_mapping"], s["q"], s["key"],
                        s["value"], HEAD_DIM**-0.5, window=window)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # the store writes exactly its slots
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert (out[:3].float() - ref[:3].float()).abs().max() < tol  # the decode rows


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A 2-layer random Llama (GQA, head_dim 16) and a word-level tokenizer, built offline."""
    return build_words_llama(tmp_path_factory.mktemp("tiny-llama"))


def _greedy(model_dir, prompts, max_tokens, **kwargs):
    from serving import LLMEngine, SamplingParams

    kwargs.setdefault("isa", "torch")  # on CPU: no compiled kernels for the reference (nor build time)
    engine = LLMEngine.from_pretrained(str(model_dir), device=DEVICE, **kwargs)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=0) for m in max_tokens]
    outs = engine.generate(prompts, params)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return engine, [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


@pytest.mark.parametrize(
    "config",
    [
        dict(max_num_batched_tokens=8, block_size=4, cuda_graphs=False),  # chunked prefill, prefix hits
        dict(num_kv_blocks=12, block_size=4, cuda_graphs=False),  # preemption: recompute over cached blocks
        dict(block_size=4, cuda_graphs=True),  # decode through the graph buckets' eager stand-in
    ],
    ids=["chunked-prefix", "preempt", "graphs"],
)
def test_engine_through_triton_is_token_identical_to_the_torch_path_fp32(llama_dir, config):
    prompts, max_tokens = word_prompts(VOCAB), [9, 6, 8, 7]
    torch_config = {k: v for k, v in config.items() if k != "cuda_graphs"}
    _, ref, _ = _greedy(llama_dir, prompts, max_tokens, dtype="float32", attention="torch", **torch_config)
    engine, out, _ = _greedy(llama_dir, prompts, max_tokens, dtype="float32", attention="triton", **config)
    assert out == ref
    stats = engine.stats()
    if config.get("max_num_batched_tokens"):
        assert stats.prefix_cache_hit_tokens > 0
    if config.get("num_kv_blocks"):
        assert stats.num_preemptions > 0
    if config.get("cuda_graphs"):
        assert set(engine.runner.graphs.graphs) <= {1, 2, 4} and engine.runner.graphs.graphs
    attn = engine.model.model.layers[0].self_attn  # q/k/v fused into one weight, the modules hold views of it
    q_bytes = attn.q_proj.weight.numel() * attn.q_proj.weight.element_size()
    assert attn.k_proj.weight.data_ptr() == attn.q_proj.weight.data_ptr() + q_bytes


def test_bf16_engine_through_triton_agrees_with_the_torch_path(llama_dir):
    """bf16 rounds in other places (scores accumulate in fp32 tiles, no bf16 score matrix): texts may part
    at a near tie, so logprobs are compared where the tokens agree."""
    prompts, max_tokens = word_prompts(VOCAB), [6, 6, 6, 6]
    kwargs = dict(dtype="bfloat16", max_num_batched_tokens=8, block_size=4)
    _, ref, ref_lps = _greedy(llama_dir, prompts, max_tokens, attention="torch", **kwargs)
    _, out, lps = _greedy(llama_dir, prompts, max_tokens, attention="triton", **kwargs)
    gaps = []
    for a, b, la, lb in zip(out, ref, lps, ref_lps, strict=True):
        same = next((t for t, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        assert same >= 3
        gaps += [abs(x - y) for x, y in zip(la[:same], lb[:same], strict=True)]
    assert sum(gaps) / len(gaps) < 0.05 and max(gaps) < 0.5


def test_graph_buckets_and_padding_rows_leave_the_cache_alone():
    from serving.kernels.cuda.graphs import StaticDecodeBuffers, batch_buckets, bucket_for
    from serving.kernels.cuda.store import store_kv

    assert batch_buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20] and batch_buckets(1) == [1]
    assert [bucket_for(n, batch_buckets(64)) for n in (1, 3, 5, 9, 17, 64, 65)] == [1, 4, 8, 16, 32, 64, None]
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)
    buffers = StaticDecodeBuffers.allocate(8, 3, torch.device(DEVICE))
    buffers.fill([5, 6, 7], [3, 9, 1], [12, 40, 2], [[3], [1, 9, 10], [0]], [4, 10, 2], bucket=4)
    assert buffers.slot_mapping[:4].tolist() == [12, 40, 2, -1] and buffers.context_lens[:4].tolist() == [4, 10, 2, 0]
    assert buffers.block_tables[:4].tolist() == [[3, 0, 0], [1, 9, 10], [0, 0, 0], [0, 0, 0]]
    k_cache, v_cache = torch.zeros(2, 16, 16, device=DEVICE), torch.zeros(2, 16, 16, device=DEVICE)
    key = torch.randn(2, 4, 16, device=DEVICE)
    store_kv(key, key, k_cache, v_cache, torch.tensor([3, -1, 7, -1], device=DEVICE))
    assert torch.equal(k_cache[:, 3], key[:, 0]) and torch.equal(v_cache[:, 7], key[:, 2])
    assert k_cache.abs().sum() == key[:, 0].abs().sum() + key[:, 2].abs().sum()  # padding rows wrote nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_round_as_the_torch_ops(dtype):
    """RMSNorm sums its variance in another order (a float32 ulp of the scale); rotary rounds op by op as
    HF does, so it agrees to the bit in bf16; K/V land in their slots, a padding row's (-1) nowhere."""
    from serving.kernels.cuda.fused_ops import TritonOps
    from serving.kernels.cuda.torch_ops import TorchOps

    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, dim, hidden = 5, 6, 2, 16, 40

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    x, residual, weight = rand(tokens, hidden), rand(tokens, hidden), rand(hidden)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(TritonOps.rms_norm(x, weight, 1e-5), TorchOps.rms_norm(x, weight, 1e-5), **tol)
    res_a, res_b = residual.clone(), residual.clone()
    out_a, out_b = TritonOps.add_rms_norm(res_a, x, weight, 1e-5), TorchOps.add_rms_norm(res_b, x, weight, 1e-5)
    assert torch.equal(res_a, res_b)
    torch.testing.assert_close(out_a, out_b, **tol)

    qkv = rand(tokens, (heads + 2 * kv_heads) * dim)  # one fused projection's output, split as the model does
    angles = torch.rand(tokens, dim // 2, generator=gen).to(DEVICE) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    slots = torch.tensor([7, 0, -1, 3, 12], device=DEVICE)
    outs = []
    for ops in (TritonOps, TorchOps):
        q, k, v = qkv.clone().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        caches = torch.zeros(2, kv_heads, 16, dim, dtype=dtype, device=DEVICE)
        ops.rotary_store(q, k, v, cos, sin, dim, caches[0], caches[1], slots)
        outs.append((q, k, caches))
    (q_a, k_a, c_a), (q_b, k_b, c_b) = outs
    if dtype == torch.bfloat16:
        assert torch.equal(q_a, q_b) and torch.equal(k_a, k_b) and torch.equal(c_a, c_b)
    else:
        torch.testing.assert_close(q_a, q_b, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(c_a, c_b, atol=1e-6, rtol=1e-6)
    written = {7, 0, 3, 12}
    assert all(c_a[:, :, s].abs().sum() == 0 for s in range(16) if s not in written)


def test_attention_choice_is_checked_before_anything_is_built():
    from serving.kernels.cuda import resolve_backend

    assert resolve_backend("auto", "cpu") == "torch" and resolve_backend("triton", "cpu") == "triton"
    assert resolve_backend("auto", "cuda", "int8") == "torch"  # the Triton kernels read the model's dtype only
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        resolve_backend("flash", "cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8'"):
        resolve_backend("triton", DEVICE, "fp8")


def test_graphs_need_the_triton_path(llama_dir):
    from serving import LLMEngine

    with pytest.raises(ValueError, match="cuda_graphs needs attention='triton' and a model"):
        LLMEngine.from_pretrained(str(llama_dir), device=DEVICE, attention="torch", cuda_graphs=True)


def test_models_own_forward_through_triton_attention(llama_dir, monkeypatch):
    """Without llama_forward (QUANTGATE_FAST_FORWARD=0, as for other architectures) the model's own forward
    calls the registered attention, which hands the step to the Triton kernels."""
    monkeypatch.setenv("QUANTGATE_FAST_FORWARD", "0")
    prompts, max_tokens = word_prompts(VOCAB)[:2], [5, 5]
    _, ref, _ = _greedy(llama_dir, prompts, max_tokens, dtype="float32", attention="torch", block_size=4)
    engine, out, _ = _greedy(llama_dir, prompts, max_tokens, dtype="float32", attention="triton", block_size=4)
    assert engine.runner.fast_forward is None and engine.runner.graphs is None
    assert out == ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weight_only_gemm_matches_the_dequantized_matmul(dtype):
    from serving.kernels.cuda.wo_gemm import int8_linear
    from serving.model.quant.int8 import quantize_per_channel

    gen = torch.Generator().manual_seed(2)
    codes, scales = quantize_per_channel(torch.randn(40, 150, generator=gen))  # N, K not multiples of the tiles
    x, bias = torch.randn(3, 150, generator=gen).to(dtype), torch.randn(40, generator=gen).to(dtype)
    ref = x.double() @ (codes.double() * scales.double()[:, None]).T + bias.double()
    out = int8_linear(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), bias.to(DEVICE))
    assert out.dtype == dtype and out.shape == (3, 40)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("group_size", [None, 32], ids=["int8", "int4"])
def test_weight_only_model_through_fused_triton_projections(llama_dir, group_size):
    """Every Linear of the decoder int8 (or int4, groups of 32) weight-only: q/k/v and gate/up fused into one
    GEMM each, o_proj and down_proj alone, against the model with those weights dequantized (fp32, one
    prefill). (Not the layers' own CPU forward: its kernel paths round activations their own way.)"""
    from transformers import AutoModelForCausalLM

    from serving import LLMEngine, SamplingParams
    from serving.kernels.cuda.projections import fuse_projections
    from serving.model.quant.int8 import replace_linears

    engine = LLMEngine.from_pretrained(str(llama_dir), device=DEVICE, dtype="float32", attention="triton",
                                       cuda_graphs=False, block_size=4, isa="torch")
    replace_linears(engine.model.model, from_weights=True, group_size=group_size)
    assert fuse_projections(engine.runner.fast_forward) == 4 * len(engine.model.model.layers)
    prompt = word_prompts(VOCAB)[1]
    out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=5))[0]
    plain = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).to(DEVICE).eval()
    with torch.inference_mode():
        for name, module in plain.model.named_modules():  # the quantized layers' weights, dequantized in fp32
            quantized = engine.model.model.get_submodule(name) if name else None
            if isinstance(module, torch.nn.Linear) and hasattr(quantized, "dequantized_weight"):
                module.weight.copy_(quantized.dequantized_weight(torch.float32))
        logits = plain(input_ids=torch.tensor([prompt], device=DEVICE)).logits[0, -1].float()
    top = torch.log_softmax(logits, -1).topk(5)
    assert out.token_ids[0] == int(top.indices[0])
    got = dict(out.logprobs[0].top)
    for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
        assert abs(got[token] - value) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_weight_only_gemm_matches_the_dequantized_matmul(dtype):
    from serving.kernels.cuda.wo_gemm import int4_linear
    from serving.model.quant.int4 import dequantize_rows, quantize_groups

    gen = torch.Generator().manual_seed(3)
    codes, sz = quantize_groups(torch.randn(40, 192, generator=gen), 32)  # K spans tiles unevenly, N odd tiles
    x, bias = torch.randn(3, 192, generator=gen).to(dtype), torch.randn(40, generator=gen).to(dtype)
    ref = x.double() @ dequantize_rows(codes, sz, 32, dtype).double().T + bias.double()
    out = int4_linear(x.to(DEVICE), codes.to(DEVICE), sz.to(DEVICE), 32, bias.to(DEVICE))
    assert out.dtype == dtype and out.shape == (3, 40)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)
