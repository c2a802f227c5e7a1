"""serving/cuda's Triton kernels on CPU tensors in Triton's interpreter, against the torch path
(serving/attention.py): the K/V store, paged decode, prefill over cached context; then the engine through
them, greedy token-identical to the torch path; and the CUDA-graph buckets replayed eagerly on CPU."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # test-only: read by triton when the kernels are defined, so before

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from serving import attention  # noqa: E402
from serving.attention import AttentionContext, DecodeGroup, PrefillChunk  # noqa: E402
from serving.cuda.attention import attend as triton_attend  # noqa: E402
from serving.cuda.step import PagedStep  # noqa: E402

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
    return dict(tables=tables, lens=lens, slots_of=slots_of, slot_mapping=slot_mapping, k_cache=k_cache,
                v_cache=v_cache, q=q, key=key, value=value, prompt_len=prompt_len, chunk=chunk)


def _torch_context(s, k_cache, v_cache) -> AttentionContext:
    width = max(len(t) for t in s["tables"][:3])
    tables = torch.tensor([t + [0] * (width - len(t)) for t in s["tables"][:3]])
    lens = torch.tensor(s["lens"][:3])
    pad = torch.arange(width * BLOCK_SIZE)[None, :] >= lens[:, None]
    group = DecodeGroup(0, tables.view(-1), pad[None, :, None, :], lens)
    prompt = PrefillChunk(3, s["prompt_len"], s["prompt_len"], None)
    chunk = PrefillChunk(3 + s["prompt_len"], s["chunk"], s["lens"][4], torch.tensor(s["slots_of"][4]))
    return AttentionContext([k_cache], [v_cache], BLOCK_SIZE, s["slot_mapping"], [prompt, chunk], [group])


def _triton_step(s) -> PagedStep:
    prefills = [(3, s["prompt_len"], s["prompt_len"]), (3 + s["prompt_len"], s["chunk"], s["lens"][4])]
    return PagedStep.build(s["tables"][:3], s["lens"][:3], s["tables"][3:], prefills, "cpu")


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
