"""The variant's safetensors file written in place: header first (every shape is known before any value), then
each tensor, or a block of its rows, at its offset. Both streamed builders write through it
(quantize/streaming.py for int8wo / int4wo, quantize/calibrated_stream.py for int4-awq / int4-gptq).

A writer never holds more than the tensor or block it is given; the file is synced when its `with` ends, and
the caller removes a half-written file on error (quantize/variant.py builds into a temporary directory). Every
`WRITE_BACK_BYTES` it syncs what it wrote and drops those pages from the page cache: the build then reuses the
same few pages instead of taking a fresh one for every byte of its output (fresh memory is what a VM's host may
have to back anew, at seconds a GB: docs/results/design-figures.md), and the source it reads stays cached for the
release's next stages.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantgate.files import sync_and_drop

if TYPE_CHECKING:
    import torch

# safetensors' own order for the data: wider dtypes first, then by name (save_file does the same).
ORDER = ("F64", "F32", "BF16", "F16", "I32", "I16", "I8", "U8", "BOOL")
ITEM_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
WRITE_BACK_BYTES = 64 << 20  # written, then synced and dropped from the page cache


def st_dtype(dtype: torch.dtype) -> str:
    """safetensors' name for a torch dtype (the loader's table, read the other way)."""
    from serving.model.quant.checkpoint import SAFETENSORS_DTYPES

    return next(name for name, torch_type in SAFETENSORS_DTYPES.items() if torch_type == dtype)


def torch_dtype(name: str) -> torch.dtype:
    from serving.model.quant.checkpoint import SAFETENSORS_DTYPES

    return SAFETENSORS_DTYPES[name]


class VariantWriter:
    """Writes tensors named by `specs` (name -> (safetensors dtype, shape)) at their places in an open file."""

    def __init__(self, fd: int, base: int, specs: dict[str, tuple[str, tuple[int, ...]]],
                 offsets: dict[str, tuple[int, int]]):
        self.fd, self.base, self.specs, self.offsets = fd, base, specs, offsets
        self.unsynced = 0
        self.written: set[str] = set()  # the tensors given (some or all of their rows)

    def write(self, key: str, tensor: torch.Tensor) -> int:
        """The whole tensor `key`, cast to the layout's dtype; its shape must be the layout's."""
        dtype, shape = self.specs[key]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{key}: shape {tuple(tensor.shape)}, the layout's {shape}")
        return self.write_part(key, tensor.to(torch_dtype(dtype)), 0)

    def write_part(self, key: str, tensor: torch.Tensor, at: int) -> int:
        """A block of `key`'s rows (already in the layout's dtype) `at` bytes into it; returns the bytes
        written, so a caller streaming rows adds them to `at`."""
        start, end = self.offsets[key]
        size = tensor.numel() * tensor.element_size()
        if at + size > end - start:
            raise ValueError(f"{key}: {size} bytes at {at} run past its {end - start}")
        written = _pwrite(self.fd, tensor, self.base + start + at)
        self.written.add(key)
        self.unsynced += written
        if self.unsynced >= WRITE_BACK_BYTES:
            self.write_back()
        return written

    def write_back(self) -> None:
        sync_and_drop(self.fd)
        self.unsynced = 0


def layout(specs: dict[str, tuple[str, tuple[int, ...]]], metadata: dict[str, str]) -> tuple[bytes, int, dict]:
    """The file's header, the data's size, and each tensor's (start, end) in the data."""
    order = sorted(specs, key=lambda k: (ORDER.index(specs[k][0]), k))
    header: dict[str, Any] = {"__metadata__": metadata}
    offsets, offset = {}, 0
    for key in order:
        dtype, shape = specs[key]
        size = math.prod(shape) * ITEM_BYTES[dtype]
        offsets[key] = (offset, offset + size)
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as save_file pads it
    return len(raw).to_bytes(8, "little") + raw, offset, offsets


@contextmanager
def open_variant_file(path: Path, specs: dict[str, tuple[str, tuple[int, ...]]], metadata: dict[str, str],
                 offsets: dict[str, tuple[int, int]] | None = None) -> Iterator[VariantWriter]:
    """The weights file with its header written and its size set; yields its writer and syncs it on the way
    out. `offsets`, where given, is filled with each tensor's place (callers that plan jobs by it)."""
    header, total, places = layout(specs, metadata)
    if offsets is not None:
        offsets.update(places)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(header)
        handle.truncate(len(header) + total)
        writer = VariantWriter(handle.fileno(), len(header), specs, places)
        yield writer
        missing = sorted(k for k, (_, shape) in specs.items() if math.prod(shape) and k not in writer.written)
        if missing:  # the file holds zeros there: never a variant
            raise ValueError(f"{path.name}: {len(missing)} tensor(s) of the layout were never written: "
                             f"{', '.join(missing[:5])}")
        writer.write_back()


def _pwrite(fd: int, tensor: torch.Tensor, offset: int) -> int:
    import torch

    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    view, written = memoryview(data), 0
    while written < len(view):
        written += os.pwrite(fd, view[written:], offset + written)
    return written
