"""Reference outputs from plain transformers, for comparing the engine against."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

# scripts/gpu_check.sh runs the equivalence tests on CUDA by setting these.
DEVICE = os.environ.get("QUANTGATE_TEST_DEVICE", "cpu")
DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}[os.environ.get("QUANTGATE_TEST_DTYPE", "float32")]


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: Path, dtype: torch.dtype = DTYPE):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(DEVICE).eval()


def hf_greedy(model_dir: Path, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF `generate`, batch of one, greedy, EOS ignored so lengths are comparable."""
    return list(_hf_greedy(model_dir, tuple(token_ids), max_new_tokens))


@functools.lru_cache(maxsize=256)  # the same reference serves every scheduler configuration
@torch.inference_mode()
def _hf_greedy(model_dir: Path, token_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = hf_model(model_dir)
    ids = torch.tensor([token_ids], device=DEVICE)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return tuple(out[0, len(token_ids) :].tolist())


@torch.inference_mode()
def hf_logprobs(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] log-softmax of the model's next-token distribution at each position."""
    logits = hf_model(model_dir)(torch.tensor([token_ids], device=DEVICE)).logits[0].float()
    return torch.log_softmax(logits, dim=-1).cpu()
