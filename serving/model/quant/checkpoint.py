"""Saving and loading a weight-only int8 or int4 model.

The weights go to `int8wo.safetensors` / `int4wo.safetensors` / `w8a8.safetensors` (not `model.safetensors`), so a plain
`from_pretrained` on the directory fails loudly instead of loading codes as if they were weights;
`quantize.load_model` knows the format. config.json stays the source model's config, so the
architecture is unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from quantgate.allocator import release_freed_memory
from quantgate.loading import check_materialised, model_construction
from serving.model.quant.int4 import Int4Embedding, Int4WeightOnlyLinear
from serving.model.quant.int8 import (
    Int8Embedding,
    Int8WeightOnlyLinear,
    keep_embedding_scale,
    replace_linears,
)
from serving.model.quant.w8a8 import Int8DynamicLinear

QUANTIZED_LINEARS = (Int8WeightOnlyLinear, Int4WeightOnlyLinear, Int8DynamicLinear)

WEIGHTS_FILES = {"int8wo": "int8wo.safetensors", "int4wo": "int4wo.safetensors", "w8a8": "w8a8.safetensors"}


def save_weight_only(model: PreTrainedModel, out: Path, method: str = "int8wo") -> None:
    from safetensors.torch import save_file

    state, tied, seen = {}, {}, {}
    for key, tensor in model.state_dict().items():
        ptr = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if tensor.numel() and ptr in seen:  # tied (lm_head = embed_tokens): stored once
            tied[key] = seen[ptr]
            continue
        seen[ptr] = key
        state[key] = tensor.detach().contiguous().cpu()
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / WEIGHTS_FILES[method]), metadata=file_metadata(model, method, tied))
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(out)


def file_metadata(model: torch.nn.Module, method: str, tied: dict[str, str]) -> dict[str, str]:
    """The weight file's metadata: which modules are quantized how, and the tied names ({name: stored name})."""
    modules = dict(model.named_modules())
    linears = sorted(n for n, m in modules.items() if isinstance(m, QUANTIZED_LINEARS))
    dynamic = sorted(n for n, m in modules.items() if isinstance(m, Int8DynamicLinear))
    embeddings = sorted(n for n, m in modules.items() if isinstance(m, Int8Embedding | Int4Embedding))
    group_size = next((m.group_size for m in modules.values() if isinstance(m, Int4WeightOnlyLinear)), None)
    metadata = {"format": "pt", "quantgate_method": method, "linears": json.dumps(linears),
                "embeddings": json.dumps(embeddings), "tied": json.dumps(tied), "group_size": json.dumps(group_size)}
    if dynamic:  # w8a8's layers; int8wo / int4wo files stay as the streamed builds write them
        metadata["dynamic"] = json.dumps(dynamic)
    return metadata


def load_weight_only(directory: Path, device: str = "cpu", dtype: torch.dtype | None = None,
                     method: str = "int8wo") -> PreTrainedModel:
    from safetensors import safe_open
    from transformers.initialization import no_init_weights

    path = Path(directory) / WEIGHTS_FILES[method]
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if metadata.get("quantgate_method") != method:
        raise ValueError(f"{path} is not a quantgate weight-only {method} file")
    linears, embeddings = json.loads(metadata["linears"]), json.loads(metadata["embeddings"])
    tied, group_size = json.loads(metadata["tied"]), json.loads(metadata.get("group_size", "null"))
    dynamic = json.loads(metadata.get("dynamic", "[]"))

    config = AutoConfig.from_pretrained(directory)
    dtype = dtype or _config_dtype(config)
    with model_construction(), no_init_weights():
        # Plain weights here are uninitialised (never touched, so never resident) until replaced below.
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _meta_quantized_layers(model, directory, linears, embeddings, group_size, dtype, dynamic)
    _assign_tensors(model, path, tied)
    check_materialised(model, str(path))
    model = model.to(device).eval()
    _embedding_reads_head_layout(model)
    shared = {id(m.codes) for m in model.modules() if isinstance(m, Int4Embedding)}
    shared |= {id(m.weight_int8) for m in model.modules() if isinstance(m, Int8Embedding)}
    for i, module in enumerate(model.modules()):  # serve from the kernel's layout alone, unless an embedding reads it
        if isinstance(module, Int4WeightOnlyLinear) and id(module.codes) not in shared:
            module.drop_codes()
        elif isinstance(module, Int8WeightOnlyLinear | Int8DynamicLinear) and id(module.weight_int8) not in shared:
            module.drop_plain()
        if i % 16 == 15:
            release_freed_memory()
    release_freed_memory()
    return model


def _meta_quantized_layers(model: PreTrainedModel, directory: Path, linears: list[str], embeddings: list[str],
                           group_size: int | None, dtype: torch.dtype, dynamic: list[str]) -> None:
    """Swap in the quantized layers with their buffers on the meta device: the file's tensors are assigned to
    them, so the weights exist once (creating them with zeros and copying into them held two copies)."""
    for name in linears:  # the plain weight goes to meta first: replace_linears builds the layer on its device
        module = model.get_submodule(name)
        module.weight = torch.nn.Parameter(torch.empty_like(module.weight, device="meta"), requires_grad=False)
    with torch.device("meta"):
        weight_only = [n for n in linears if n not in set(dynamic)]
        swapped = replace_linears(model, from_weights=False, only=weight_only, group_size=group_size)
        for name in dynamic:
            old = model.get_submodule(name)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child,
                    Int8DynamicLinear(old.in_features, old.out_features, old.bias is not None, dtype))
            swapped.append(name)
        for name in embeddings:
            old = model.get_submodule(name)
            parent, _, child = name.rpartition(".")
            table = (Int8Embedding(old.num_embeddings, old.embedding_dim, dtype) if group_size is None
                     else Int4Embedding(old.num_embeddings, old.embedding_dim, dtype, group_size))
            setattr(model.get_submodule(parent), child, keep_embedding_scale(old, table))
    if sorted(swapped) != linears:
        raise ValueError(f"{directory}: quantized layers {sorted(set(linears) - set(swapped))} not in the model")
    for module in model.modules():  # the one non-persistent buffer the quantized layers fill at construction
        if isinstance(module, Int8WeightOnlyLinear) and module._unit_scales.device.type == "meta":
            module._unit_scales = torch.ones(module.out_features, dtype=torch.bfloat16)


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _read_tensors(path: Path):
    """(name, tensor) for each tensor of a safetensors file, read one at a time straight into memory of its
    own: no buffer of the whole file is kept (safetensors' views into one would double the peak, and their
    alignment is the file's, which our kernels must not read through)."""
    with open(path, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_len))
        start = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=SAFETENSORS_DTYPES[info["dtype"]])
            if end > begin:
                handle.seek(start + begin)
                if handle.readinto(tensor.view(-1).view(torch.uint8).numpy()) != end - begin:
                    raise ValueError(f"{path}: tensor {name} is cut short")
            yield name, tensor


def _assign_tensors(model: PreTrainedModel, path: Path, tied: dict[str, str]) -> None:
    """Read the file one tensor at a time and make each the module's own (assign, no copy); tied names share."""
    from safetensors import safe_open

    expected = set(model.state_dict(keep_vars=True)) - set(tied)
    with safe_open(str(path), framework="pt") as handle:
        keys = set(handle.keys())
    missing, unexpected = sorted(expected - keys), sorted(keys - expected)
    if missing or unexpected:
        raise ValueError(f"{path} does not match {type(model).__name__}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for key, tensor in _read_tensors(path):
        module_name, _, attr = key.rpartition(".")
        module = model.get_submodule(module_name)
        current = getattr(module, attr)
        tensor = tensor.to(current.dtype)  # as load_state_dict's copy would cast it
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=current.requires_grad)
        else:
            module._buffers[attr] = tensor
    for key, source in tied.items():  # one tensor again, as when it was saved
        module_name, _, attr = key.rpartition(".")
        source_module, _, source_attr = source.rpartition(".")
        setattr(model.get_submodule(module_name), attr, getattr(model.get_submodule(source_module), source_attr))


def _embedding_reads_head_layout(model: PreTrainedModel) -> None:
    """A tied embedding looks its rows up in the lm_head's kernel layout, so one copy serves both."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if isinstance(embed, Int8Embedding) and isinstance(head, Int8WeightOnlyLinear):
        if embed.weight_int8 is head.weight_int8 and head._own_kernel():
            embed.read_packed(head.kernel_layout(), head.kernel_path().kind)
    elif isinstance(embed, Int8Embedding) and isinstance(head, Int8DynamicLinear):
        if embed.weight_int8 is head.weight_int8 and head.kernel_layout() is not None:
            embed.read_packed(head.kernel_layout(), "wo_bf16")  # the quads: wo_bf16.packed_rows reads any width
    elif isinstance(embed, Int4Embedding) and isinstance(head, Int4WeightOnlyLinear):
        if embed.codes is head.codes and head._own_kernel():
            embed.read_packed(head.kernel_layout(), head.kernel_path().kind)


def _config_dtype(config) -> torch.dtype:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, value) if isinstance(value, str) else value
