"""A GGUF file -> a plain HF directory, one tensor at a time: memory does not grow with the model.

transformers' own GGUF load (`from_pretrained(gguf_file=...)`) dequantizes every tensor into one fp32 state
dict and then builds the whole model from it: ~11-12 bytes per parameter at peak. Here the GGUF is read by
mmap (gguf-py's `GGUFReader`), one tensor at a time is dequantized and passed through transformers' own
per-tensor processing (`modeling_gguf_pytorch_utils`: the GGUF -> HF name map and the architecture's
`TensorProcessor`, e.g. Llama's q/k reverse permutation), and its bytes are appended to a safetensors
shard whose header was written up front (every shape is known beforehand from the model built on the
meta device). A tensor its processor leaves alone (all but Llama's q/k and Gemma's norms) goes through
in blocks of rows, so even the embedding is never whole in memory; the others are dequantized whole, then
processed. config.json, generation_config.json and the tokenizer files are what `save_pretrained` of
transformers' loaded model writes.

The weights are stored as fp32, bit-identical to transformers' fp32 load: a K-quant value is an fp16
scale times a 4-6 bit code minus an fp16-scaled min, up to ~17 significant bits, and bf16 keeps 8, so a
bf16 copy would round them (fp32 holds every dequantized value exactly).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantgate.loading import model_construction

if TYPE_CHECKING:
    import numpy as np
    from gguf import GGUFReader, ReaderTensor
    from transformers import PreTrainedModel

# Shards of at most ~2 GB (a tensor larger than that gets a shard of its own): few enough files, and
# small enough that a reader of one shard never maps much more than it needs.
SHARD_BYTES = 2_000_000_000
# Rows are dequantized this many output bytes at a time: gguf-py's numpy dequantizers make several
# temporaries the size of their output, so small chunks keep those small.
CHUNK_BYTES = 16 << 20
# Processors whose `process` maps one GGUF tensor to one HF tensor under the same name. The others
# (MoE expert fusing, GPT-2's lm_head) write into a shared dict across tensors and cannot stream.
_ONE_TO_ONE_PROCESSORS = {"TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor",
                          "NemotronTensorProcessor", "MambaTensorProcessor", "BloomTensorProcessor"}
_INDEX = "model.safetensors.index.json"
_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "U8": 1, "I32": 4, "I64": 8}


class GGUFConversionError(ValueError):
    """A GGUF file this converter cannot turn into a HF directory; raised before anything is written."""


@dataclass(frozen=True)
class PlannedTensor:
    name: str  # the HF state-dict key
    source: ReaderTensor
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 4  # fp32


@dataclass
class ConversionPlan:
    gguf: Path
    processor: Any  # transformers' TensorProcessor for the architecture
    model: PreTrainedModel  # on the meta device: its config, generation config and shapes
    shards: list[list[PlannedTensor]]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for shard in self.shards for t in shard)


def convert_gguf(gguf: Path, out_dir: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """Convert `gguf` into the (new or empty) directory `out_dir`."""
    write_conversion(plan_conversion(gguf, shard_bytes), out_dir)


def plan_conversion(gguf: Path, shard_bytes: int = SHARD_BYTES) -> ConversionPlan:
    """Read the GGUF's header and check everything that can be checked before writing: the file is complete,
    its architecture converts tensor by tensor, and every weight the model needs is there in its shape."""
    gguf = Path(gguf)
    reader = _open_reader(gguf)
    architecture = _check_architecture(reader, gguf)
    sources = reader.tensors  # views on the file's mmap; the reader's parsed fields are let go with it
    del reader
    model, raw_config = _meta_model(gguf)
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=raw_config)
    tensors = _match_tensors(sources, model, processor, gguf)
    return ConversionPlan(gguf, processor, model, _split(tensors, shard_bytes))


def write_conversion(plan: ConversionPlan, out_dir: Path) -> None:
    """Write the weights shard by shard, then the index, configs and tokenizer, into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    count = len(plan.shards)
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(plan.shards, start=1):
        filename = f"model-{number:05d}-of-{count:05d}.safetensors"
        write_safetensors(out_dir / filename, [(t.name, "F32", t.shape) for t in shard],
                          lambda i, shard=shard: _converted(plan, shard[i]))
        weight_map.update({t.name: filename for t in shard})
    total_parameters = sum(math.prod(t.shape) for shard in plan.shards for t in shard)
    write_index(out_dir, weight_map, total_parameters, plan.total_bytes)
    _write_configs(plan, out_dir)


def write_safetensors(path: Path, specs: list[tuple[str, str, tuple[int, ...]]],
                      produce: Callable[[int], Iterable[Any]]) -> None:
    """A safetensors file written tensor by tensor: the header from `specs` (name, safetensors dtype, shape)
    first, then for each spec in order the buffers `produce(i)` yields (C-contiguous, e.g. numpy arrays),
    which together must be exactly that tensor's bytes. Only what `produce` holds is in memory."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in specs:
        end = offset + math.prod(shape) * _DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for i, (name, _dtype, _shape) in enumerate(specs):
            begin, end = header[name]["data_offsets"]
            written = 0
            for buffer in produce(i):
                view = memoryview(buffer).cast("B")
                written += view.nbytes
                handle.write(view)
                del view, buffer
            if written != end - begin:
                raise ValueError(f"{path.name}: {name} came to {written} bytes, "
                                 f"its header says {end - begin}")


def write_index(out_dir: Path, weight_map: dict[str, str], total_parameters: int, total_size: int) -> None:
    """model.safetensors.index.json as `save_pretrained` writes it."""
    index = {"metadata": {"total_parameters": total_parameters, "total_size": total_size},
             "weight_map": weight_map}
    (Path(out_dir) / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _open_reader(gguf: Path) -> GGUFReader:
    from gguf import GGUFReader

    if not gguf.is_file():
        raise GGUFConversionError(f"GGUF file not found: {gguf}")
    size = gguf.stat().st_size
    try:
        reader = GGUFReader(gguf)
    except Exception as err:  # gguf-py reports a short file as a numpy reshape/view error
        raise GGUFConversionError(
            f"{gguf} ({size:,} bytes) is not a readable GGUF file: truncated or corrupt ({err})") from err
    short = [t.name for t in reader.tensors if t.data_offset + t.n_bytes > size]
    if short:
        raise GGUFConversionError(f"{gguf} ({size:,} bytes) is truncated: the data of {len(short)} tensors "
                                  f"({', '.join(short[:4])}) runs past the end of the file")
    return reader


def _check_architecture(reader: GGUFReader, gguf: Path) -> str:
    """The GGUF's architecture, when transformers converts it tensor by tensor (its legacy GGUF path)."""
    from transformers.integrations.gguf.utils import is_gguf_arch_supported
    from transformers.modeling_gguf_pytorch_utils import (
        GGUF_SUPPORTED_ARCHITECTURES,
        TENSOR_PROCESSORS,
        TensorProcessor,
        read_field,
    )

    found = read_field(reader, "general.architecture")
    if not found:
        raise GGUFConversionError(f"{gguf} has no general.architecture: not a model GGUF")
    architecture = str(found[0])
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor).__name__
    streamable = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if not is_gguf_arch_supported(a)
                        and TENSOR_PROCESSORS.get(a, TensorProcessor).__name__ in _ONE_TO_ONE_PROCESSORS)
    if processor not in _ONE_TO_ONE_PROCESSORS or is_gguf_arch_supported(architecture):
        raise GGUFConversionError(f"{gguf}: transformers converts GGUF architecture {architecture!r} "
                                  f"across tensors (fused experts or packed loading), which quantgate "
                                  f"does not stream; it converts {', '.join(streamable)}")
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise GGUFConversionError(f"{gguf}: transformers cannot convert GGUF architecture {architecture!r}; "
                                  f"quantgate converts {', '.join(streamable)}")
    return architecture


def _meta_model(gguf: Path) -> tuple[PreTrainedModel, dict[str, Any]]:
    """The causal LM transformers would build for this GGUF, on the meta device (no memory), and the raw
    config dict its tensor processor reads."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
    # What `AutoConfig.from_pretrained(gguf_file=...)` builds from this same dict, without parsing the
    # file's metadata (its tokenizer arrays: seconds) a second time; from_dict may change what it is given.
    config = CONFIG_MAPPING[raw["model_type"]].from_dict(copy.deepcopy(raw))
    try:
        with model_construction(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as err:
        raise GGUFConversionError(
            f"{gguf}: no causal-LM class for model type {config.model_type!r}: {err}") from err
    # what save_pretrained records of the loaded model
    model.config.dtype = "float32"
    model.config.architectures = [type(model).__name__]
    return model, raw


def _match_tensors(sources: list[ReaderTensor], model: PreTrainedModel, processor: Any,
                   gguf: Path) -> list[PlannedTensor]:
    """Each weight the model saves, in state-dict order, with the GGUF tensor it comes from."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    to_hf = get_gguf_hf_weights_map(model, processor)
    by_name = {to_hf[t.name]: t for t in sources if t.name in to_hf}
    planned, missing, misshapen = [], [], []
    for name, shape in _saved_shapes(model).items():
        source = by_name.get(name)
        if source is None:
            missing.append(name)
        elif tuple(int(d) for d in reversed(source.shape.tolist())) != shape:
            misshapen.append(f"{name} {tuple(reversed(source.shape.tolist()))} != {shape}")
        else:
            planned.append(PlannedTensor(name, source, shape))
    if missing or misshapen:
        raise GGUFConversionError(
            f"{gguf} does not hold the weights its config describes: "
            + "; ".join(filter(None, [missing and f"missing {', '.join(missing[:6])}",
                                      misshapen and f"shapes differ: {', '.join(misshapen[:4])}"])))
    return planned


def _saved_shapes(model: PreTrainedModel) -> dict[str, tuple[int, ...]]:
    """The keys `save_pretrained` writes: the state dict less tied aliases (one storage is saved once, under
    the name transformers keeps: the first registered, e.g. embed_tokens, never lm_head)."""
    seen: set[int] = set()
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        shapes[name] = tuple(tensor.shape)
    return shapes


def _split(tensors: list[PlannedTensor], shard_bytes: int) -> list[list[PlannedTensor]]:
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def _converted(plan: ConversionPlan, tensor: PlannedTensor) -> Iterator[np.ndarray]:
    """One tensor's fp32 values as transformers' loader computes them (dequantize, then the architecture's
    processor), as consecutive row blocks."""
    import numpy as np

    source = tensor.source
    if _left_alone(plan.processor, source.name, tensor.shape):
        for start in range(0, tensor.shape[0], _chunk_rows(tensor.shape)):
            yield _dequantized(source, start, start + _chunk_rows(tensor.shape))
        return
    values = np.empty(tensor.shape, dtype=np.float32)
    for start in range(0, tensor.shape[0], _chunk_rows(tensor.shape)):
        stop = start + _chunk_rows(tensor.shape)
        values[start:stop] = _dequantized(source, start, stop)
    result = plan.processor.process(weights=values, name=source.name)
    del values
    if result.name != source.name:
        raise GGUFConversionError(f"{source.name}: the tensor processor renamed it to {result.name!r}")
    out = np.ascontiguousarray(result.weights, dtype=np.float32)
    if out.shape != tensor.shape:
        raise GGUFConversionError(f"{tensor.name}: converted to {out.shape}, planned {tensor.shape}")
    yield out


def _left_alone(processor: Any, name: str, shape: tuple[int, ...]) -> bool:
    """Whether the processor hands this tensor back untouched, so its rows can stream. Asked with an empty
    block of the tensor's rows: transformers' processors decide by name, and one that changes a tensor
    returns a new array (a reshape/permute of zero rows, `w - 1`, ...) or fails on the empty block."""
    import numpy as np

    if len(shape) < 2:
        return False  # 1-D: small, processed whole
    probe = np.zeros((0, *shape[1:]), dtype=np.float32)
    try:
        return processor.process(weights=probe, name=name).weights is probe
    except (ValueError, IndexError, ZeroDivisionError):
        return False


def _chunk_rows(shape: tuple[int, ...]) -> int:
    return max(1, CHUNK_BYTES // (4 * math.prod(shape[1:]))) if len(shape) > 1 else max(1, shape[0])


def _dequantized(source: ReaderTensor, start: int, stop: int) -> np.ndarray:
    """gguf-py's `dequantize` of rows [start, stop) as fp32 (blocks never span rows and dequantization is
    elementwise per block, so the values are those of dequantizing the whole tensor)."""
    import numpy as np
    from gguf import dequantize

    return np.ascontiguousarray(dequantize(source.data[start:stop], source.tensor_type), dtype=np.float32)


def _write_configs(plan: ConversionPlan, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    plan.model.config.save_pretrained(out_dir)
    if plan.model.can_generate():
        plan.model.generation_config.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(plan.gguf.parent, gguf_file=plan.gguf.name)
    tokenizer.save_pretrained(out_dir)
