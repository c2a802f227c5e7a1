"""Reference outputs from plain transformers, for comparing the engine against."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(model_dir: Path, token_ids: list[int], max_new_tokens: int, dtype=torch.float32) -> list[int]:
    """HF `generate`, batch of one, greedy, EOS ignored so lengths are comparable."""
    model = hf_model(model_dir, dtype)
    ids = torch.tensor([token_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(token_ids) :].tolist()


@torch.inference_mode()
def hf_logprobs(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] log-softmax of the model's next-token distribution at each position."""
    logits = hf_model(model_dir)(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
