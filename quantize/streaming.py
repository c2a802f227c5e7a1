"""int8wo / int4wo built by streaming: one source tensor at a time, row-chunked, straight into the variant file.

The in-memory build (quantize/methods.py `_weight_only`) loads the whole model in fp32 and quantizes it
in place: ~11-12 bytes per parameter at peak. Here the structure comes from the same code run on the
meta device (`quantize_model` on a model built from config.json, so the choice of layers, the lm_head and
embedding options, int4's fit rules and the tied table are exactly today's), and the values from the
source's safetensors, read by mmap a block of rows at a time in their own dtype. Each block is cast to
the option `dtype` (as `from_pretrained(dtype=...)` would), quantized by int8.py / int4.py's own
functions and written at its place in `int8wo.safetensors` / `int4wo.safetensors`, whose header is
written first (every shape is known from the meta model). The tensors and metadata equal the in-memory
build's bit for bit (tests/test_quantize_stream.py); memory is one block of rows plus one tensor's scales.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantize.variant_writer import VariantWriter, open_variant_file, st_dtype, torch_dtype

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)

# Rows are read, cast and quantized this many elements at a time (32 MiB as fp32): quantize_groups makes a
# few temporaries of the block's size, so the block bounds the working memory whatever the tensor's size.
CHUNK_ELEMENTS = 8 << 20
WEIGHTS_FILES = {"int8wo": "int8wo.safetensors", "int4wo": "int4wo.safetensors", "w8a8": "w8a8.safetensors"}


class NotStreamable(ValueError):
    """The source cannot be streamed (no safetensors, or names that are not the model's): build in memory."""


@dataclass(frozen=True)
class SourceWeights:
    directory: Path
    files: dict[str, Path]  # tensor name -> the safetensors file holding it


def open_source(directory: Path) -> SourceWeights:
    """The source's tensors by file: one `model.safetensors`, or shards named by `model.safetensors.index.json`
    (every shard it names must be there: a missing one is an error now, not half-way through the build)."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
        if missing:
            raise ValueError(f"{directory}: {len(missing)} shard(s) named by {index.name} are missing: "
                             f"{', '.join(missing[:5])}; nothing was built")
        return SourceWeights(directory, {k: directory / f for k, f in weight_map.items()})
    single = directory / "model.safetensors"
    if not single.is_file():
        raise NotStreamable(f"{directory} has no model.safetensors (or index): built in memory")
    with safe_open(str(single), framework="pt") as handle:
        return SourceWeights(directory, dict.fromkeys(handle.keys(), single))


def streamable(directory: Path) -> bool:
    directory = Path(directory)
    return (directory / "model.safetensors").is_file() or (directory / "model.safetensors.index.json").is_file()


@dataclass
class Job:
    """One source tensor and what it becomes: `kind` "int8" / "int4" (two outputs: codes and scales) or
    "copy" (one output, cast to the option dtype)."""

    kind: str
    source_key: str
    outputs: list[str]
    group_size: int | None = None


@dataclass
class Plan:
    method: str
    source: SourceWeights
    dtype: torch.dtype
    specs: dict[str, tuple[str, tuple[int, ...]]]  # output name -> (safetensors dtype, shape)
    jobs: list[Job]
    metadata: dict[str, str]
    config: Any
    table: dict[str, dict[str, Any]]  # quantize/tensor_table.py's view of the quantized model
    offsets: dict[str, tuple[int, int]] = field(default_factory=dict)


def plan_stream(source_dir: Path, method: str, opts: dict[str, Any]) -> Plan:
    """Everything about the variant but its values, from config.json and the safetensors headers alone.
    Raises NotStreamable where the in-memory path must build it, ValueError for a source nobody can."""
    import torch

    from quantize.tensor_table import tensor_table
    from serving.model.quant.checkpoint import file_metadata

    source = open_source(source_dir)  # raises on a shard missing from its index, before any work
    group_size = opts.get("group_size") if method == "int4wo" else None
    model, aliases = _quantized_meta_model(source_dir, opts, group_size)
    state = model.state_dict(keep_vars=True)
    stored, tied = dedupe(state)
    jobs = _jobs(model, stored, group_size)
    specs = {key: (st_dtype(state[key].dtype), tuple(state[key].shape)) for key in stored}
    for job in jobs:
        job.source_key = _source_key(job.source_key, aliases, source)
    metadata = file_metadata(model, method, tied)
    dtype = getattr(torch, opts["dtype"])
    return Plan(method, source, dtype, specs, jobs, metadata, model.config, tensor_table(model))


def _quantized_meta_model(source_dir: Path, opts: dict[str, Any], group_size: int | None):
    """The model quantize_model makes, on the meta device (no values), and each parameter's other names."""
    import torch

    from serving.model.quant.int8 import quantize_model

    model, aliases = meta_model(source_dir, opts["dtype"])
    if group_size:
        from serving.model.quant.int4 import check_group_size

        check_group_size(model, group_size, opts["quantize_lm_head"], opts["quantize_embeddings"])
    with torch.device("meta"), torch.no_grad():  # the layers' buffers are created on meta too
        swapped = quantize_model(model, opts["quantize_lm_head"], opts["quantize_embeddings"], group_size)
    if not swapped:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layers to quantize")
    return model, aliases


def meta_model(source_dir: Path, dtype: str) -> tuple[nn.Module, dict[str, list[str]]]:
    """The source's model on the meta device (no values), and each parameter's other names (a tied lm_head's
    weight is the embedding's: the source stores it under one of them)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantgate.loading import model_construction

    try:
        config = AutoConfig.from_pretrained(source_dir)
        with model_construction(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{source_dir}: the engine cannot build this model from its config.json: {exc}") from exc
    aliases: dict[str, list[str]] = {}
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    for names in by_id.values():
        for name in names:
            aliases[name] = names
    return model, aliases


def dedupe(state: dict[str, torch.Tensor]) -> tuple[list[str], dict[str, str]]:
    """Stored names in state-dict order and {tied name: stored name}: save_weight_only's rule (a tensor
    seen before is stored once, under its first name), by identity since meta tensors have no address."""
    seen: dict[int, str] = {}
    stored, tied = [], {}
    for key, tensor in state.items():
        if tensor.numel() and id(tensor) in seen:
            tied[key] = seen[id(tensor)]
            continue
        seen[id(tensor)] = key
        stored.append(key)
    return stored, tied


def _jobs(model: nn.Module, stored: list[str], group_size: int | None) -> list[Job]:
    from serving.model.quant.int4 import Int4Embedding, Int4WeightOnlyLinear
    from serving.model.quant.int8 import Int8Embedding, Int8WeightOnlyLinear

    modules = dict(model.named_modules())
    quantized = {Int8WeightOnlyLinear: ("weight_int8", "scales"), Int8Embedding: ("weight_int8", "scales"),
                 Int4WeightOnlyLinear: ("codes", "scales_and_zeros"), Int4Embedding: ("codes", "scales_and_zeros")}
    jobs, done = [], set()
    for key in stored:
        owner, _, attr = key.rpartition(".")
        outputs = quantized.get(type(modules[owner]))
        if outputs is None or attr not in outputs:
            jobs.append(Job("copy", key, [key]))
        elif owner not in done:
            done.add(owner)
            kind = "int8" if outputs[0] == "weight_int8" else "int4"
            jobs.append(Job(kind, f"{owner}.weight", [f"{owner}.{o}" for o in outputs], group_size))
    return jobs


def _source_key(key: str, aliases: dict[str, list[str]], source: SourceWeights) -> str:
    for name in [key, *aliases.get(key, [])]:
        if name in source.files:
            return name
    raise NotStreamable(f"{source.directory}: no tensor {key!r} in its safetensors (names differ from the model's)")


def write_stream(plan: Plan, out: Path) -> Path:
    """Write the variant's weights (header first, then each job's blocks at their offsets), config.json and
    generation_config.json into `out`; returns the weights file."""
    path = out / WEIGHTS_FILES[plan.method]
    with variant_file(plan, path) as writer:
        started, read = time.perf_counter(), 0
        for i, job in enumerate(plan.jobs, 1):
            read += run_job(plan, job, writer)
            if i % 50 == 0 or i == len(plan.jobs):
                log.info("%s: %d/%d tensors, %.2f GB read, %.0f s", plan.method, i, len(plan.jobs), read / 1e9,
                         time.perf_counter() - started)
    write_configs(plan, out)
    return path


def variant_file(plan: Plan, path: Path) -> AbstractContextManager[VariantWriter]:
    """The plan's weights file open for writing (quantize/variant_writer.py); fills `plan.offsets`."""
    return open_variant_file(path, plan.specs, plan.metadata, plan.offsets)


def run_job(plan: Plan, job: Job, writer: VariantWriter) -> int:
    """Quantize or copy one source tensor block by block; returns the source bytes read."""
    import torch

    codes, at = job.outputs[0], 0
    scales, read = [], 0
    for block in source_blocks(plan.source, job.source_key):
        read += block.numel() * block.element_size()
        block = block.to(plan.dtype)
        if job.kind == "copy":
            out, extra = block.to(torch_dtype(plan.specs[codes][0])), None
        elif job.kind == "int8":
            from serving.model.quant.int8 import quantize_per_channel

            out, extra = quantize_per_channel(block.float())
        else:
            from serving.model.quant.int4 import quantize_groups

            out, extra = quantize_groups(block, job.group_size)
        at += writer.write_part(codes, out, at)
        if extra is not None:
            scales.append(extra)
    if scales:  # int8: [N]; int4: [K/g, N, 2], rows along dim 1
        writer.write(job.outputs[1], torch.cat(scales, dim=0 if job.kind == "int8" else 1))
    return read


def source_blocks(source: SourceWeights, key: str) -> Iterator[torch.Tensor]:
    """The source tensor `key` in its own dtype, CHUNK_ELEMENTS at a time along its rows (a 0-d or 1-d
    tensor whole)."""
    from safetensors import safe_open

    with safe_open(str(source.files[key]), framework="pt") as handle:
        part = handle.get_slice(key)
        shape = part.get_shape()
        if len(shape) < 2:
            yield handle.get_tensor(key)
            return
        width = max(1, math.prod(shape[1:]))
        rows = max(1, CHUNK_ELEMENTS // width)
        for start in range(0, shape[0], rows):
            yield part[start:start + rows]


def write_configs(plan: Plan, out: Path) -> None:
    """config.json as the in-memory build saves it (the loaded model's config: `dtype` the option's) and the
    generation config where the source has one."""
    from transformers import GenerationConfig

    plan.config.save_pretrained(out)
    try:
        generation = GenerationConfig.from_pretrained(plan.source.directory)
    except OSError:  # no generation_config.json: from_pretrained would derive one from the config
        generation = GenerationConfig.from_model_config(plan.config)
    generation.save_pretrained(out)
