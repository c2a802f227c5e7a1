"""A random-weight Llama of Llama-3-8B's shapes (or smaller ones), as bf16 safetensors written shard by shard.

For measuring memory and time at 8B scale without an 8B checkpoint (none is on the registries): one shard
per decoder layer (~0.44 GB at 8B), one for the embeddings (1.05 GB) and one for the final norm and the
untied head (1.05 GB), with model.safetensors.index.json and a LlamaForCausalLM config.json. Each tensor
is generated and written a block of rows at a time, so at most ~64 MB of weights is ever in memory.
Weights are N(0, 0.02), norms 1: the model runs, its outputs mean nothing.

No tokenizer is written by default (Llama-3's is on no registry). The engine and `quantgate generate` need
one in the model directory (`AutoTokenizer.from_pretrained(model_dir)`): pass `tokenizer_from=` a
directory whose tokenizer files to copy, e.g. the default model's converted directory. Its 49,152 ids all
lie inside the 128,256-row embedding, so prompts encode and run; sampled ids above 49,151 decode to no
text (the tokenizer drops ids it does not know) but are still returned as token ids.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantgate.gguf_convert import write_index, write_safetensors

BLOCK_BYTES = 64 << 20  # rows generated and written at a time
DISK_MARGIN_BYTES = 2 << 30  # left free beyond the model's own bytes (other writers, metadata)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja")


@dataclass(frozen=True)
class LlamaShapes:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float = 500000.0
    max_positions: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA3_8B = LlamaShapes(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
# The same structure (GQA, untied head, one shard per layer) in ~0.2 MB, for tests.
TINY_LLAMA = LlamaShapes(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512,
                         max_positions=256)


class NotEnoughDiskError(OSError):
    """The model would not fit on the target's filesystem with the margin left free."""


def write_random_llama(out_dir: Path, shapes: LlamaShapes = LLAMA3_8B, seed: int = 0,
                       tokenizer_from: Path | None = None) -> Path:
    """Write the model into `out_dir` (new or empty); on failure, remove what was written."""
    out_dir = Path(out_dir)
    shards = shard_layout(shapes)
    need = sum(math.prod(shape) * 2 for shard in shards.values() for shape in shard.values())
    check_free_disk(out_dir, need)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty")
    try:
        _write_weights(out_dir, shards, seed)
        write_index(out_dir, {name: file for file, shard in shards.items() for name in shard},
                    need // 2, need)
        llama_config(shapes).save_pretrained(out_dir)
        for name in _TOKENIZER_FILES if tokenizer_from is not None else ():
            if (Path(tokenizer_from) / name).is_file():
                shutil.copy2(Path(tokenizer_from) / name, out_dir / name)
    except BaseException:
        for path in list(out_dir.iterdir()):
            path.unlink()
        if created:
            out_dir.rmdir()
        raise
    return out_dir


def shard_layout(shapes: LlamaShapes) -> dict[str, dict[str, tuple[int, ...]]]:
    """Shard file -> {tensor name: shape}: embeddings, then one shard per decoder layer, then norm + head."""
    h, f, kv = shapes.hidden, shapes.intermediate, shapes.kv_heads * shapes.head_dim
    layer = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (h, h),
             "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
             "self_attn.o_proj.weight": (h, h),
             "post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (f, h),
             "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    groups = [{"model.embed_tokens.weight": (shapes.vocab, h)}]
    groups += [{f"model.layers.{i}.{k}": s for k, s in layer.items()} for i in range(shapes.layers)]
    groups.append({"model.norm.weight": (h,), "lm_head.weight": (shapes.vocab, h)})
    return {f"model-{i:05d}-of-{len(groups):05d}.safetensors": g for i, g in enumerate(groups, start=1)}


def check_free_disk(out_dir: Path, need: int, margin: int = DISK_MARGIN_BYTES) -> None:
    probe = Path(out_dir).resolve()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need + margin:
        raise NotEnoughDiskError(
            f"writing the model into {out_dir} needs {need / 1e9:.1f} GB plus {margin / 1e9:.1f} GB left "
            f"free; {probe} has {free / 1e9:.1f} GB free. Free space or choose another directory.")


def llama_config(shapes: LlamaShapes) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shapes.vocab, hidden_size=shapes.hidden, intermediate_size=shapes.intermediate,
        num_hidden_layers=shapes.layers, num_attention_heads=shapes.heads,
        num_key_value_heads=shapes.kv_heads,
        head_dim=shapes.head_dim, max_position_embeddings=shapes.max_positions, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": shapes.rope_theta}, tie_word_embeddings=False,
        # Llama-3's <|begin_of_text|> / <|end_of_text|> where the vocabulary has them
        bos_token_id=128000 if shapes.vocab > 128001 else None,
        eos_token_id=128001 if shapes.vocab > 128001 else None,
        architectures=["LlamaForCausalLM"], dtype="bfloat16")


def _write_weights(out_dir: Path, shards: dict[str, dict[str, tuple[int, ...]]], seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    for file, shard in shards.items():
        specs = [(name, "BF16", shape) for name, shape in shard.items()]
        write_safetensors(out_dir / file, specs, lambda i, specs=specs: _blocks(specs[i][2], generator))


def _blocks(shape: tuple[int, ...], generator: Any) -> Any:
    """The tensor's bf16 bytes, a block of rows at a time (as int16 numpy views: numpy has no bf16)."""
    import torch

    if len(shape) == 1:
        yield torch.ones(shape, dtype=torch.bfloat16).view(torch.int16).numpy()
        return
    rows = max(1, BLOCK_BYTES // (2 * math.prod(shape[1:])))
    for start in range(0, shape[0], rows):
        block = torch.empty((min(rows, shape[0] - start), *shape[1:]), dtype=torch.bfloat16)
        block.normal_(0.0, 0.02, generator=generator)
        yield block.view(torch.int16).numpy()
