"""What a variant directory must hold, and checking that it still does.

The manifest lists every file with its size and sha256. Sizes and safetensors headers are checked
on every load (cheap, catches truncation); hashes when asked or when the files are small.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quantgate.models import file_sha256

MANIFEST = "quantgate.json"
KIND = "quantgate-variant"
FORMAT_VERSION = 1
# Below this many bytes a full hash check costs less than loading the model does.
CHEAP_HASH_BYTES = 64 << 20


class CorruptVariantError(ValueError):
    """A variant directory whose files do not match its manifest: partial, truncated or edited."""


def safetensors_header(path: Path) -> dict[str, Any]:
    """The tensor table of a safetensors file, after checking that the data it describes is all there."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CorruptVariantError(f"{path.name}: {size} bytes, too short for a safetensors header")
        length = int.from_bytes(prefix, "little")
        if length > size - 8:
            raise CorruptVariantError(f"{path.name}: header says {length} bytes but the file has {size}")
        try:
            header = json.loads(handle.read(length))
        except ValueError as exc:
            raise CorruptVariantError(f"{path.name}: unreadable safetensors header ({exc})") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if 8 + length + end != size:
        raise CorruptVariantError(
            f"{path.name}: tensors need {8 + length + end} bytes, the file has {size} (truncated or padded)"
        )
    return tensors


def weight_bytes(directory: Path) -> tuple[int, dict[str, int]]:
    """Bytes of all tensors in the directory's safetensors files, in total and per dtype."""
    total, by_dtype = 0, {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        for info in safetensors_header(file).values():
            start, end = info["data_offsets"]
            total += end - start
            by_dtype[info["dtype"]] = by_dtype.get(info["dtype"], 0) + end - start
    return total, by_dtype


def file_table(directory: Path) -> dict[str, dict[str, Any]]:
    return {
        p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(Path(directory).iterdir())
        if p.is_file() and p.name != MANIFEST
    }


def read_manifest(directory: Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CorruptVariantError(f"{directory} has no {MANIFEST}: not a quantgate variant (or a partial one)")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:
        raise CorruptVariantError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND or not isinstance(manifest.get("files"), dict):
        raise CorruptVariantError(f"{path} is not a quantgate variant manifest")
    return manifest


def is_variant(directory: Path) -> bool:
    """True for a directory that claims to be a variant (it may still fail `verify_variant`)."""
    try:
        read_manifest(directory)
    except (CorruptVariantError, OSError):
        return False
    return True


def verify_variant(directory: Path, full: bool | None = None) -> dict[str, Any]:
    """Check the directory against its manifest and return the manifest; raise CorruptVariantError.

    `full=None` hashes the files only when they are small; True always; False never.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    files: dict[str, dict[str, Any]] = manifest["files"]
    if not any(name.endswith(".safetensors") for name in files):
        raise CorruptVariantError(f"{directory}: the manifest lists no safetensors file")
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            raise CorruptVariantError(f"{directory}: {name} is missing")
        size = path.stat().st_size
        if size != expected["size"]:
            raise CorruptVariantError(f"{directory}: {name} has {size} bytes, the manifest says {expected['size']}")
        if name.endswith(".safetensors"):
            safetensors_header(path)
    if full is None:
        full = sum(f["size"] for f in files.values()) <= CHEAP_HASH_BYTES
    if full:
        for name, expected in files.items():
            if file_sha256(directory / name) != expected["sha256"]:
                raise CorruptVariantError(f"{directory}: {name} does not match its sha256 in the manifest")
    return manifest
