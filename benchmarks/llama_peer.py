"""llama.cpp as a peer for `quantgate bench peers`: where its binaries are (scripts/peers_setup_llama.sh)
and the model's GGUF in the type asked for, made once with `llama-quantize` from the model's own GGUF
(SmolLM2's package ships Q4_1: F16 of it holds exactly the weights quantgate's baseline serves)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def llama_binary(llama_dir: Path, name: str) -> Path:
    path = llama_dir / "bin" / name
    if not path.is_file():
        raise ValueError(f"no {name} under {llama_dir}/bin: build it with scripts/peers_setup_llama.sh "
                         "(or pass --llama-dir)")
    return path


def source_gguf(model: str) -> Path:
    """The GGUF file behind a model reference: the default model's package file or a .gguf path."""
    from quantgate.models import default_gguf_path, is_default_model

    if is_default_model(model):
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path.resolve()
    raise ValueError(f"llama.cpp serves GGUF files: {model!r} is neither the default model nor a .gguf file")


def gguf_as(model: str, file_type: str, llama_dir: Path) -> Path:
    """The model's GGUF as `file_type` (the source itself when it already is that type)."""
    source = source_gguf(model)
    if source.stem.upper().endswith(file_type.upper()):
        return source
    out = llama_dir / "models" / f"{source.stem}-as-{file_type}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    cmd = [str(llama_binary(llama_dir, "llama-quantize")), "--allow-requantize", str(source), str(partial), file_type]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize to {file_type} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    partial.rename(out)  # never a half-written file under the final name
    return out


def llama_version(llama_dir: Path) -> str | None:
    try:
        done = subprocess.run([str(llama_binary(llama_dir, "llama-server")), "--version"], capture_output=True,
                              text=True, timeout=30)
    except (ValueError, OSError, subprocess.TimeoutExpired):
        return None
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")]
    return lines[0].removeprefix("version:").strip() if lines else None
