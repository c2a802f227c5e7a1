"""What a built variant holds, layer by layer: which weights were quantized how, and which were left as
they were (a layer the int4 kernels cannot serve, an lm_head kept by option), for the manifest."""

from __future__ import annotations

from typing import Any

from torch import nn


def tensor_table(model: nn.Module) -> dict[str, dict[str, Any]]:
    """{module name: {"format", "shape", "tensors", ...}} for every linear and embedding of `model`."""
    from serving.model.quant.int4 import Int4Embedding, Int4WeightOnlyLinear
    from serving.model.quant.int8 import Int8Embedding, Int8WeightOnlyLinear
    from serving.model.quant.w8a8 import Int8DynamicLinear

    owners: dict[int, str] = {}
    table: dict[str, dict[str, Any]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Int4WeightOnlyLinear | Int4Embedding):
            entry = {"format": "int4", "group_size": module.group_size}
            held = module.codes
        elif isinstance(module, Int8DynamicLinear):
            smoothed = None if module.inv_smooth.is_meta else bool((module.inv_smooth != 1).any())  # meta: a plan
            entry, held = {"format": "int8-per-row, int8 activations per row", "smoothed": smoothed}, module.weight_int8
        elif isinstance(module, Int8WeightOnlyLinear | Int8Embedding):
            entry, held = {"format": "int8-per-row"}, module.weight_int8
        elif isinstance(module, nn.Linear | nn.Embedding) or _is_bitsandbytes(module):
            entry = {"format": _plain_format(module)}
            held = module.weight
        else:
            continue
        entry["shape"] = _shape(module)
        if id(held) in owners:
            entry["shares"] = owners[id(held)]  # a tied table: stored once, under the first name
        else:
            owners[id(held)] = name
        entry["tensors"] = sorted(f"{name}.{key}" for key in module.state_dict(keep_vars=True))
        table[name] = entry
    return table


def _is_bitsandbytes(module: nn.Module) -> bool:
    return type(module).__module__.startswith("bitsandbytes")


def _plain_format(module: nn.Module) -> str:
    if type(module).__name__ == "Linear8bitLt":
        return "bitsandbytes-int8"
    if type(module).__name__ == "Linear4bit":
        return f"bitsandbytes-{getattr(module.weight, 'quant_type', '4bit')}"
    return f"unquantized-{str(module.weight.dtype).removeprefix('torch.')}"


def _shape(module: nn.Module) -> list[int]:
    if hasattr(module, "out_features"):
        return [module.out_features, module.in_features]
    return [module.num_embeddings, module.embedding_dim]
