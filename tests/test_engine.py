"""The engine against plain transformers: token-identical greedy output, exact block accounting."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import DEVICE, DTYPE, hf_greedy, hf_logprobs

from serving import LLMEngine, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Water boils at a temperature of",
]


def random_prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def engine_for(model_dir, **kwargs) -> LLMEngine:
    kwargs.setdefault("device", DEVICE)
    kwargs.setdefault("dtype", DTYPE)
    return LLMEngine.from_pretrained(str(model_dir), **kwargs)


def assert_no_leak(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


@pytest.mark.parametrize(
    "config",
    [
        dict(scheduler="continuous"),
        dict(scheduler="static", max_num_seqs=3),
        dict(scheduler="continuous", max_num_batched_tokens=16),  # chunked prefill
        dict(scheduler="continuous", enable_prefix_caching=False, block_size=8),
        dict(scheduler="continuous", num_kv_blocks=34, block_size=4),  # forces preemption
    ],
    ids=["continuous", "static", "chunked", "no-prefix-cache", "preempt"],
)
def test_greedy_matches_hf_generate_tiny(tiny_model_dir, config):
    engine = engine_for(tiny_model_dir, **config)
    prompts = random_prompts(8, engine.vocab_size)
    max_tokens = [5, 40, 17, 1, 30, 25, 9, 33]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    outs = engine.generate(prompts, params)
    for prompt, m, out in zip(prompts, max_tokens, outs, strict=True):
        assert out.token_ids == hf_greedy(tiny_model_dir, prompt, m), f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length"
    if config.get("num_kv_blocks"):
        assert engine.stats().num_preemptions > 0
    assert_no_leak(engine)


def test_many_sequences_decode_in_length_groups_and_match_hf(tiny_model_dir, monkeypatch):
    """40 sequences on the torch path (no compiled kernel, as on CUDA): decode rows are sorted by context
    length into several padded groups, while chunked prefills of late arrivals share the steps. Every
    output must still equal HF's. (tests/test_paged_kernel.py runs the same through the kernel.)"""
    from serving.model.model_runner import DECODE_GROUP_SIZE

    monkeypatch.setenv("QUANTGATE_PAGED_KERNEL", "0")
    engine = engine_for(tiny_model_dir, max_num_seqs=40, max_num_batched_tokens=256)
    prompts = random_prompts(40, engine.vocab_size, seed=3)
    max_tokens = [12 + (7 * i) % 29 for i in range(40)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    groups_seen = []
    original = engine.runner._decode_groups

    def spy(seqs):
        groups = original(seqs)
        groups_seen.append(len(groups))
        return groups

    engine.runner._decode_groups = spy
    outs = engine.generate(prompts, params)
    assert max(groups_seen) == -(-40 // DECODE_GROUP_SIZE)  # at some step all 40 decoded, in 3 groups
    for prompt, m, out in zip(prompts, max_tokens, outs, strict=True):
        assert out.token_ids == hf_greedy(tiny_model_dir, prompt, m), f"prompt of {len(prompt)} tokens"
    assert_no_leak(engine)


def test_prefix_cache_hits_and_same_output(tiny_model_dir):
    engine = engine_for(tiny_model_dir, block_size=4)
    shared = random_prompts(1, engine.vocab_size, seed=3, lo=40, hi=40)[0]
    prompts = [shared + tail for tail in ([11, 12], [13], [14, 15, 16])]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = engine.generate(prompts[0], params)[0]
    rest = engine.generate(prompts[1:], params)
    assert first.num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [40, 40]  # ten full blocks of the shared prefix
    assert engine.stats().prefix_cache_hit_tokens == 80
    for prompt, out in zip(prompts, [first, *rest], strict=True):
        assert out.token_ids == hf_greedy(tiny_model_dir, prompt, 12)
    assert_no_leak(engine)


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_preempted_sequence_resumes_with_identical_output(tiny_model_dir, scheduler):
    engine = engine_for(tiny_model_dir, num_kv_blocks=10, block_size=4, max_num_seqs=8, scheduler=scheduler)
    prompts = random_prompts(4, engine.vocab_size, seed=5, lo=6, hi=8)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    stats = engine.stats()
    assert stats.num_preemptions >= 1
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(tiny_model_dir, prompt, 30)
    assert_no_leak(engine)


def test_abort_frees_blocks_and_others_continue(tiny_model_dir):
    engine = engine_for(tiny_model_dir, block_size=4)
    prompts = random_prompts(3, engine.vocab_size, seed=9, lo=20, hi=30)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    engine.abort(ids[1])
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[ids[1]].finish_reason == "abort"
    assert len(finished[ids[1]].token_ids) < 20
    for i in (0, 2):
        assert finished[ids[i]].token_ids == hf_greedy(tiny_model_dir, prompts[i], 20)
    assert_no_leak(engine)


def test_logprobs_match_hf(tiny_model_dir):
    engine = engine_for(tiny_model_dir)
    prompt = random_prompts(1, engine.vocab_size, seed=2, lo=12, hi=12)[0]
    out = engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3,
                                                 prompt_logprobs=2))[0]
    ref = hf_logprobs(tiny_model_dir, prompt + out.token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        lp = out.prompt_logprobs[pos]
        assert lp.token_id == prompt[pos]
        assert lp.logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
        assert len(lp.top) == 2
    for i, lp in enumerate(out.logprobs):
        pos = len(prompt) - 1 + i
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[pos].max().item(), abs=1e-4)  # greedy = the top token
        assert [t for t, _ in lp.top] == ref[pos].topk(3).indices.tolist()


def test_prompt_logprobs_survive_chunked_prefill(tiny_model_dir):
    engine = engine_for(tiny_model_dir, max_num_batched_tokens=8)
    prompt = random_prompts(1, engine.vocab_size, seed=4, lo=30, hi=30)[0]
    out = engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    ref = hf_logprobs(tiny_model_dir, prompt)
    got = [lp.logprob for lp in out.prompt_logprobs[1:]]
    want = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("start", [1, 5, 8, 9, 17, 29])
def test_prompt_logprobs_from_a_position_score_only_the_rest(tiny_model_dir, start):
    # Chunks of 8 tokens: the first scored token falls before, on and after chunk boundaries.
    engine = engine_for(tiny_model_dir, max_num_batched_tokens=8)
    prompt = random_prompts(1, engine.vocab_size, seed=4, lo=30, hi=30)[0]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, prompt_logprobs_from=start)
    out = engine.generate(prompt, params)[0]
    ref = hf_logprobs(tiny_model_dir, prompt)
    assert len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[:start] == [None] * start
    got = [lp.logprob for lp in out.prompt_logprobs[start:]]
    assert [lp.token_id for lp in out.prompt_logprobs[start:]] == prompt[start:]
    assert got == pytest.approx([ref[i - 1, prompt[i]].item() for i in range(start, len(prompt))], abs=1e-4)


def test_prompt_logprobs_from_must_be_a_position():
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="prompt_logprobs_from"):
            SamplingParams(prompt_logprobs=0, prompt_logprobs_from=bad)


def test_sampling_is_seeded_and_top_k_one_is_greedy(tiny_model_dir):
    engine = engine_for(tiny_model_dir)
    prompt = random_prompts(1, engine.vocab_size, seed=7)[0]
    sampled = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    a = engine.generate([prompt, prompt], [sampled, sampled])
    b = engine.generate(prompt, sampled)[0]
    assert a[0].token_ids == a[1].token_ids == b.token_ids
    other = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=124, ignore_eos=True))[0]
    assert other.token_ids != b.token_ids
    top1 = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.7, top_k=1, seed=1, ignore_eos=True))
    assert top1[0].token_ids == hf_greedy(tiny_model_dir, prompt, 16)


def test_stop_strings_and_stop_tokens(tiny_model_dir):
    engine = engine_for(tiny_model_dir)
    prompt = random_prompts(1, engine.vocab_size, seed=1)[0]
    full = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    stop_token = full.token_ids[5]
    cut = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_token]))[0]
    assert cut.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[: full.token_ids.index(stop_token) + 1]
    stop_text = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    if stop_text.strip():
        s = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop=[stop_text]))[0]
        assert s.finish_reason == "stop"
        assert s.text == full.text[: full.text.index(stop_text)]


def test_streaming_yields_each_token_and_metrics(tiny_model_dir):
    engine = engine_for(tiny_model_dir)
    prompt = random_prompts(1, engine.vocab_size, seed=8)[0]
    chunks = list(engine.stream(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))
    assert [len(c.token_ids) for c in chunks] == [1, 2, 3, 4, 5, 6]
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    m = chunks[-1].metrics
    assert m.queue_time >= 0 and m.ttft >= m.queue_time and len(m.itls) == 5 and m.e2e >= m.ttft
    assert m.tpot == pytest.approx(sum(m.itls) / 5)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(max_tokens=4), "empty"),
        ([], SamplingParams(max_tokens=4), "non-empty"),
        ([10**9], SamplingParams(max_tokens=4), "vocabulary"),
        ("hello " * 1100, SamplingParams(max_tokens=4), "maximum context length"),
        ("hello", SamplingParams(max_tokens=1024), "maximum context length"),
    ],
)
def test_bad_requests_raise_clear_errors_and_engine_keeps_serving(tiny_model_dir, prompt, params, message):
    engine = engine_for(tiny_model_dir)
    good = engine.add_request("a good request", SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    outs = engine.generate("another", SamplingParams(max_tokens=3, temperature=0))
    assert len(outs[0].token_ids) == 3
    assert good not in engine.sequences
    assert_no_leak(engine)


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_tokens=-1), dict(temperature=-1.0),
                                 dict(top_p=0.0), dict(top_p=float("nan")), dict(logprobs=99)])
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_request_that_can_never_fit_the_kv_cache_is_rejected(tiny_model_dir):
    engine = engine_for(tiny_model_dir, num_kv_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(list(range(100, 120)), SamplingParams(max_tokens=4))


def test_unknown_model_reference_is_a_clear_error():
    with pytest.raises(ValueError, match="never downloads"):
        LLMEngine.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="unknown scheduler"):
        LLMEngine.from_pretrained("smollm2-135m", scheduler="fastest")


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_default_model_greedy_matches_hf_generate(default_model_dir, scheduler):
    engine = engine_for(default_model_dir, scheduler=scheduler, max_num_seqs=4, num_kv_blocks=64)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, out in zip(ids, outs, strict=True):
        assert out.token_ids == hf_greedy(default_model_dir, prompt, 24)
    assert_no_leak(engine)


@pytest.mark.slow
def test_default_model_generate_api(default_model_dir):
    engine = LLMEngine.from_pretrained("smollm2-135m", device="cpu", block_size=16, num_kv_blocks=None)
    out = engine.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert "Paris" in out.text
    assert torch.get_default_dtype() == torch.float32


def test_non_finite_logits_fail_only_their_own_sequence(tiny_model_dir, monkeypatch):
    """A broken variant can give NaN logits for one input: that request ends with finish_reason 'error',
    every other sequence of the same steps finishes exactly as HF would, and no block leaks."""
    import serving.model.model_runner as runner_module
    from serving.model.sampler import NO_TOKEN, sample

    engine = engine_for(tiny_model_dir)
    prompts = random_prompts(3, engine.vocab_size, seed=11)
    poisoned = prompts[1]

    def poisoning_sample(logits, seqs, generators, greedy_pick=None):  # greedy_pick: the kernel's, when built
        for row, seq in enumerate(seqs):
            if seq.token_ids[: len(poisoned)] == poisoned and seq.num_output_tokens == 2:
                logits[row, 7] = float("nan")
        return sample(logits, seqs, generators, greedy_pick)

    monkeypatch.setattr(runner_module, "sample", poisoning_sample)
    params = [SamplingParams(max_tokens=6, temperature=t, seed=1, ignore_eos=True) for t in (0, 0.8, 0)]
    outs = engine.generate(prompts, params)
    assert outs[1].finish_reason == "error" and len(outs[1].token_ids) == 2 and NO_TOKEN not in outs[1].token_ids
    for i in (0, 2):
        assert outs[i].finish_reason == "length"
        assert outs[i].token_ids == hf_greedy(tiny_model_dir, prompts[i], 6)
    assert_no_leak(engine)


def test_attention_window_is_read_from_the_config():
    """Which models have sliding-window layers (tests/test_sliding_window.py serves them beyond the window)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    from quantgate.model_shape import attention_window

    assert attention_window(Gemma3TextConfig(sliding_window=512)) == 512  # 5 of every 6 layers slide
    assert attention_window(Gemma3TextConfig(sliding_window=512, layer_types=["full_attention"] * 26)) is None
    assert attention_window(MistralConfig(sliding_window=4096)) == 4096  # every layer
    assert attention_window(MistralConfig(sliding_window=None)) is None
    assert attention_window(Qwen2Config(sliding_window=4096, use_sliding_window=False)) is None
    assert attention_window(LlamaConfig()) is None


def test_generate_reserves_kv_for_its_prompts_only(tiny_model_dir, capsys):
    """`quantgate generate` runs no more sequences than it has prompts, so the default KV budget is capped at
    that many full contexts (the tiny model's 1,024 positions: 64 blocks of 16 for one prompt)."""
    from quantgate.cli import main

    assert main(["generate", "--model", str(tiny_model_dir), "--device", "cpu", "--max-tokens", "2", "a b c"]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert "1 requests, 2 output tokens" in out and "64 KV blocks of 16 tokens" in out
