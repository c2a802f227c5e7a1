"""Sliding-window attention (Gemma 3's local layers, Mistral, Qwen2 with `use_sliding_window`): the engine
against HF `generate` on tiny random models with contexts many windows long, through every path that
attends (whole and chunked prefill, prefix hits, recompute after preemption, the compiled decode kernel
and the torch decode groups), and the kernel and masks against their references."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import hf_greedy
from test_engine import assert_no_leak, engine_for, random_prompts

from serving import SamplingParams
from serving.kernels.cpu import decoder_ops as kernels
from serving.model import attention

WINDOW = 8
SLIDING, FULL = "sliding_attention", "full_attention"


def _config(kind: str, vocab: int, tokenizer):
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                  sliding_window=WINDOW, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if kind == "gemma3":  # the model's own forward; local and global layers mixed. Untied: Gemma's embeddings
        # (scaled by sqrt(hidden)) would make a tied random model repeat its last token
        return Gemma3TextConfig(**common, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16,
                                layer_types=[SLIDING, FULL, SLIDING, SLIDING], tie_word_embeddings=False)
    if kind == "mistral":  # llama_forward; every layer slides
        return MistralConfig(**common, num_hidden_layers=2, tie_word_embeddings=True)
    return Qwen2Config(**common, num_hidden_layers=2, use_sliding_window=True, max_window_layers=1,  # full, sliding
                       tie_word_embeddings=True)


@pytest.fixture(scope="session")
def sliding_model(tmp_path_factory, default_model_dir):
    """kind -> the directory of a tiny random model of that kind (built once per session)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    built = {}

    def build(kind: str):
        if kind not in built:
            path = tmp_path_factory.mktemp(f"sliding-{kind}")
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(_config(kind, len(tokenizer), tokenizer)).float().eval()
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            built[kind] = path
        return built[kind]

    return build


def _assert_matches_hf(model_dir, engine, prompts, max_tokens) -> None:
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    outs = engine.generate(prompts, params)
    for prompt, m, out in zip(prompts, max_tokens, outs, strict=True):
        assert out.token_ids == hf_greedy(model_dir, prompt, m), f"prompt of {len(prompt)} tokens"
    assert_no_leak(engine)


CONFIGS = {
    "continuous": dict(),  # blocks of 16: the window starts inside a block
    "chunked": dict(max_num_batched_tokens=12, block_size=4),  # chunks shorter and longer than the window
    "preempt": dict(num_kv_blocks=40, block_size=4),  # recompute after preemption
    "torch-decode": dict(block_size=4),  # the gathered decode groups (no compiled kernel, as on CUDA)
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind", ["gemma3", "mistral", "qwen2"])
def test_greedy_matches_hf_far_beyond_the_window(sliding_model, kind, config, monkeypatch):
    """Prompts of 2-5 windows and outputs of up to 5 more: every token as HF's, whatever the path."""
    if config == "torch-decode":
        monkeypatch.setenv("QUANTGATE_PAGED_KERNEL", "0")
    model_dir = sliding_model(kind)
    engine = engine_for(model_dir, **CONFIGS[config])
    assert (engine.runner.decode_kernel is None) == (config == "torch-decode")
    assert (engine.runner.fast_forward is not None) == (kind != "gemma3")
    prompts = random_prompts(6, engine.vocab_size, seed=7, lo=2 * WINDOW, hi=5 * WINDOW)
    _assert_matches_hf(model_dir, engine, prompts, [40, 24, 3, 33, 17, 30])
    if config == "preempt":
        assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize("kind", ["gemma3", "mistral"])
def test_prefix_cache_hits_beyond_the_window(sliding_model, kind):
    """A cached prefix of 5 windows: the new tokens' prefill reads only the cached slots in their window."""
    model_dir = sliding_model(kind)
    engine = engine_for(model_dir, block_size=4)
    shared = random_prompts(1, engine.vocab_size, seed=3, lo=5 * WINDOW, hi=5 * WINDOW)[0]
    prompts = [shared + [11, 12], shared + [13], shared + list(range(200, 200 + 2 * WINDOW))]
    _assert_matches_hf(model_dir, engine, prompts[:1], [20])
    _assert_matches_hf(model_dir, engine, prompts[1:], [20, 20])
    assert engine.stats().prefix_cache_hit_tokens == 2 * 5 * WINDOW


def test_mistral_through_the_models_own_forward(sliding_model, monkeypatch):
    """Mistral's attention modules have no `sliding_window`: the window comes in the forward's kwargs."""
    monkeypatch.setenv("QUANTGATE_FAST_FORWARD", "0")
    model_dir = sliding_model("mistral")
    engine = engine_for(model_dir, max_num_batched_tokens=12, block_size=4)
    assert engine.runner.fast_forward is None
    _assert_matches_hf(model_dir, engine, random_prompts(4, engine.vocab_size, seed=9, lo=20, hi=40),
                       [30, 12, 25, 5])


def test_context_is_not_capped_at_the_window(sliding_model):
    from quantgate.model_shape import attention_window

    model_dir = sliding_model("gemma3")
    engine = engine_for(model_dir, block_size=4)
    assert attention_window(engine.model.config) == WINDOW
    assert engine.max_model_len == 512  # max_position_embeddings
    _assert_matches_hf(model_dir, engine, [list(range(300, 300 + 20 * WINDOW))], [2 * WINDOW])


def _windowed_reference(q, k, v, tables, lengths, block_size, scale, window):
    """Each sequence's last `window` slots gathered and attended to in fp32."""
    kv_heads, heads, dim = k.shape[0], q.shape[1], q.shape[2]
    out = []
    for s, length in enumerate(lengths.tolist()):
        positions = range(max(0, length - window), length)
        slots = torch.tensor([int(tables[s, t // block_size]) * block_size + t % block_size for t in positions])
        qs = q[s].float().view(kv_heads, heads // kv_heads, dim)
        probs = (qs @ k[:, slots].float().transpose(-1, -2) * scale).softmax(-1)
        out.append((probs @ v[:, slots].float()).reshape(heads, dim))
    return torch.stack(out)


LENGTHS = [1, 2, 15, 16, 17, 33, 100, 255]


def _problem(dtype, block_size: int, seed: int):
    """Like test_paged_kernel's, but no two sequences share a block (so a block can be poisoned)."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-n // block_size) for n in LENGTHS]
    blocks = torch.randperm(sum(widths) + 4, generator=gen)
    tables = torch.zeros(len(LENGTHS), max(widths), dtype=torch.long)
    for s, (width, taken) in enumerate(zip(widths, torch.tensor([0, *widths]).cumsum(0).tolist(), strict=False)):
        tables[s, :width] = blocks[taken : taken + width]
    k, v = (torch.randn(2, len(blocks) * block_size, 64, generator=gen).to(dtype) for _ in range(2))
    return torch.randn(len(LENGTHS), 8, 64, generator=gen).to(dtype), k, v, tables, torch.tensor(LENGTHS)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_kernel_attends_to_the_last_window_slots_only(dtype, tol, block_size):
    """Against the gathered reference; blocks wholly before a window hold NaN, so reading one would show."""
    op = kernels.paged_decode("cpu")
    assert op is not None
    q, k, v, tables, lengths = _problem(dtype, block_size, seed=4)
    for window in (1, 5, 16, 17, 40, 1000):
        k_poisoned, v_poisoned = k.clone(), v.clone()
        for s, length in enumerate(LENGTHS):
            for b in tables[s, : max(0, length - window) // block_size].tolist():
                k_poisoned[:, b * block_size : (b + 1) * block_size] = float("nan")
                v_poisoned[:, b * block_size : (b + 1) * block_size] = float("nan")
        out = op(q, k_poisoned, v_poisoned, tables, lengths, block_size, 0.125, None, None, 0, window)
        want = _windowed_reference(q, k, v, tables, lengths, block_size, 0.125, window)
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_window_reads_int8_and_fp8_codes(dtype):
    op = kernels.paged_decode("cpu")
    q, k, v, tables, lengths = _problem(dtype, 16, seed=6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    (kc, ks), (vc, vs) = attention.quantize_int8(k), attention.quantize_int8(v)
    out = op(q, kc, vc, tables, lengths, 16, 0.125, ks, vs, 1, 20)
    deq_k, deq_v = kc.float() * ks.float()[..., None], vc.float() * vs.float()[..., None]
    want = _windowed_reference(q, deq_k, deq_v, tables, lengths, 16, 0.125, 20)
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    kb, vb = attention.encode_fp8(k), attention.encode_fp8(v)
    out = op(q, kb, vb, tables, lengths, 16, 0.125, None, None, 2, 20)
    want = _windowed_reference(q, attention.decode_fp8(kb, torch.float32), attention.decode_fp8(vb, torch.float32),
                               tables, lengths, 16, 0.125, 20)
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


def test_torch_decode_groups_attend_within_the_window():
    """`_decode` with a window (blocks no member's window reaches are not gathered) equals the reference."""
    q, k, v, tables, lengths = _problem(torch.float32, 4, seed=5)
    ctx = attention.AttentionContext([k], [v], 4, torch.zeros(0, dtype=torch.long))
    pad = torch.arange(tables.shape[1] * 4)[None, :] >= lengths[:, None]
    for context_lens in (lengths, None):  # None: the lengths are read from the padding
        group = attention.DecodeGroup(0, tables.reshape(-1), pad[None, :, None, :], context_lens)
        for window in (None, 3, 16, 40):
            out = attention._decode(q, ctx, 0, group, 0.125, window)
            want = _windowed_reference(q, k, v, tables, lengths, 4, 0.125, window or 10**6)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("context_len,length", [(30, 30), (30, 5), (30, 1), (6, 6), (40, 12)])
def test_prefill_masks_are_transformers_masks(context_len, length):
    """The mask of a prefill chunk (positions context_len - length ..) equals the slice of transformers'
    `sliding_window_causal_mask_function` it covers: key j visible to query i iff i - window < j <= i."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    kv = torch.zeros(1, context_len, 4)
    start = context_len - length
    slots = None if start == 0 else torch.arange(context_len)
    ctx = attention.AttentionContext([kv], [kv], 4, torch.zeros(0, dtype=torch.long))
    chunk = attention.PrefillChunk(0, length, context_len, slots)
    _, keys, mask = attention._prefill_context(ctx, 0, chunk, kv[:, start:], kv[:, start:], WINDOW)
    hf = sliding_window_causal_mask_function(WINDOW)
    want = hf(0, 0, torch.arange(start, context_len)[:, None], torch.arange(context_len)[None, :])
    if mask is None:  # plain causal over the chunk
        mask = torch.ones(length, length, dtype=torch.bool).tril()
    first = context_len - keys.shape[1]  # the keys no query of the chunk sees are not read
    assert not want[:, :first].any()
    assert torch.equal(mask, want[:, first:])
