"""A tiny random Llama (2 layers, GQA, head_dim 16) with a word-level tokenizer, built offline in seconds:
the CUDA test subset (tests/test_triton_kernels.py, tests/test_bitsandbytes_engine.py) needs nothing from the
default model's package, which the lent GPU machine does not have."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512


def build_words_llama(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", bos_token="w1", eos_token="w2").save_pretrained(path)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def word_prompts(vocab: int = VOCAB) -> list[list[int]]:
    """Four prompts: two share three full blocks of 4 (prefix hits), one spans several chunks."""
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(100, vocab, (12,), generator=gen).tolist()
    return [shared + [11, 12], torch.randint(100, vocab, (21,), generator=gen).tolist(), shared + [13],
            torch.randint(100, vocab, (3,), generator=gen).tolist()]
