"""Saving and loading a weight-only int8 model.

The weights go to `int8wo.safetensors` (not `model.safetensors`), so a plain `from_pretrained` on the
directory fails loudly instead of loading int8 codes as if they were weights; `quantize.load_model`
knows the format. config.json stays the source model's config, so the architecture is unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from quantgate.loading import check_materialised, model_construction
from quantize.weight_only import Int8Embedding, Int8WeightOnlyLinear, replace_linears

WEIGHTS_FILE = "int8wo.safetensors"


def save_weight_only(model: PreTrainedModel, out: Path) -> None:
    from safetensors.torch import save_file

    state, tied, seen = {}, {}, {}
    for key, tensor in model.state_dict().items():
        ptr = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if tensor.numel() and ptr in seen:  # tied (lm_head = embed_tokens): stored once
            tied[key] = seen[ptr]
            continue
        seen[ptr] = key
        state[key] = tensor.detach().contiguous().cpu()
    linears = sorted(n for n, m in model.named_modules() if isinstance(m, Int8WeightOnlyLinear))
    embeddings = sorted(n for n, m in model.named_modules() if isinstance(m, Int8Embedding))
    metadata = {"format": "pt", "quantgate_method": "int8wo", "linears": json.dumps(linears),
                "embeddings": json.dumps(embeddings), "tied": json.dumps(tied)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / WEIGHTS_FILE), metadata=metadata)
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(out)


def load_weight_only(directory: Path, device: str = "cpu", dtype: torch.dtype | None = None) -> PreTrainedModel:
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers.initialization import no_init_weights

    path = Path(directory) / WEIGHTS_FILE
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if metadata.get("quantgate_method") != "int8wo":
        raise ValueError(f"{path} is not a quantgate weight-only int8 file")
    linears, embeddings = json.loads(metadata["linears"]), json.loads(metadata["embeddings"])
    tied = json.loads(metadata["tied"])

    config = AutoConfig.from_pretrained(directory)
    dtype = dtype or _config_dtype(config)
    with model_construction(), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    swapped = replace_linears(model, from_weights=False, only=linears)
    if sorted(swapped) != linears:
        raise ValueError(f"{directory}: quantized layers {sorted(set(linears) - set(swapped))} not in the model")
    for name in embeddings:
        old = model.get_submodule(name)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, Int8Embedding(old.num_embeddings, old.embedding_dim, dtype))
    state = load_file(str(path), device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"{path} does not match {type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for key, source in tied.items():  # one tensor again, as when it was saved
        module_name, _, attr = key.rpartition(".")
        source_module, _, source_attr = source.rpartition(".")
        setattr(model.get_submodule(module_name), attr, getattr(model.get_submodule(source_module), source_attr))
    check_materialised(model, str(path))
    return model.to(device).eval()


def _config_dtype(config) -> torch.dtype:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, value) if isinstance(value, str) else value
