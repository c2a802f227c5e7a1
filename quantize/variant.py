"""Making variants (content-addressed, atomic) and loading any model directory for serving."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantgate.env import apply_defaults, home
from quantgate.models import content_hash, resolve_model
from quantize.methods import Method, get_method
from quantize.probe import check_built
from serving.model.quant.integrity import (
    FORMAT_VERSION,
    KIND,
    MANIFEST,
    CorruptVariantError,
    file_table,
    is_variant,
    read_manifest,
    verify_variant,
    weight_bytes,
)

if TYPE_CHECKING:
    pass

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
_NOT_COPIED = {"config.json", MANIFEST, "quantgate-converted.json"}


def variants_root() -> Path:
    return home() / "variants"


def variant_key(source_hash: str, method: Method, opts: dict[str, Any]) -> str:
    """`<source_hash[:16]>-<method>`, plus a hash of the options when they are not the defaults."""
    key = f"{source_hash[:16]}-{method.name}"
    if opts != method.defaults:
        key += "-" + hashlib.sha256(json.dumps(opts, sort_keys=True).encode()).hexdigest()[:8]
    return key


def quantize(
    model_ref: str | Path,
    method: str = "nf4",
    out_dir: str | Path | None = None,
    *,
    force: bool = False,
    **opts: Any,
) -> Path:
    """Quantize `model_ref` with `method` and return the variant directory.

    Without `out_dir` the variant lives in the cache under QUANTGATE_HOME/variants and a second call
    with the same source content, method and options returns it at once. A directory that fails
    verification is rebuilt; one that holds anything else is never touched.
    """
    apply_defaults()
    spec = get_method(method)
    opts = spec.options(opts)
    source = resolve_model(model_ref)
    check_quantizable(source)
    source_hash = cached_content_hash(source)
    target = Path(out_dir).expanduser().resolve() if out_dir else variants_root() / variant_key(source_hash, spec, opts)
    identity = {"source_hash": source_hash, "method": spec.name, "options": opts}

    if _reusable(target, identity, in_cache=out_dir is None) and not force:  # raises on foreign content
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the variant is not
    try:
        _build(spec, source, str(model_ref), source_hash, opts, tmp)
        _move_into_place(tmp, target, identity)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def check_quantizable(source: Path) -> None:
    """Refuse sources that are already quantized or are not causal language models, before any work."""
    if is_variant(source):
        raise ValueError(f"{source} is already a quantgate variant; quantize its source model instead")
    config = json.loads((source / "config.json").read_text())
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ValueError(f"{source} is already quantized ({method}); quantize an unquantized model")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{source}: model type {model_type!r} has no causal-LM architecture to quantize")
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    causal = {causal} if isinstance(causal, str) else set(causal)
    architectures = config.get("architectures") or []
    if architectures and not causal & set(architectures):
        raise ValueError(
            f"{source} holds {', '.join(architectures)}, not a causal language model "
            f"({' or '.join(sorted(causal))}); quantgate quantizes causal LMs only"
        )
    _check_buildable(source)


def _check_buildable(source: Path) -> None:
    """The model builds from its config.json (on the meta device: no memory) and every weight shard its
    index names is there: otherwise a clear error now, not after minutes of work."""
    from quantize.streaming import NotStreamable, open_source

    try:
        open_source(source)
    except NotStreamable:
        pass  # not safetensors: the in-memory build reads it
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantgate.loading import model_construction

    try:
        config = AutoConfig.from_pretrained(source)
        with model_construction(), torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises, the config is what is wrong
        raise ValueError(f"{source}: the engine cannot build this model from its config.json: "
                         f"{type(exc).__name__}: {exc}") from exc


def _reusable(target: Path, identity: dict[str, Any], in_cache: bool) -> bool:
    """True when `target` already holds this exact variant intact; raises if it holds something else."""
    if not target.exists():
        return False
    if not target.is_dir():
        raise ValueError(f"output {target} exists and is not a directory; nothing overwritten")
    if not any(target.iterdir()):
        return False
    if (target / MANIFEST).is_file():
        try:
            manifest = read_manifest(target)
        except CorruptVariantError:
            return False  # our own file name, unreadable: a broken variant, rebuilt
        if _identity(manifest) != identity and not in_cache:
            raise ValueError(
                f"output {target} holds a variant of {manifest['source']['ref']} ({manifest['method']}), "
                "not the one asked for; nothing overwritten (choose another --out or remove it)"
            )
        try:
            verify_variant(target, full=True)
        except CorruptVariantError:
            return False
        return _identity(manifest) == identity
    if in_cache:
        return False  # a partial build under our own cache key
    raise ValueError(f"output {target} exists and holds other content (no {MANIFEST}); nothing overwritten")


def _identity(manifest: dict[str, Any]) -> dict[str, Any]:
    return {"source_hash": manifest["source"]["content_hash"], "method": manifest["method"],
            "options": manifest.get("options")}


def build_into(spec: Method, source: Path, opts: dict[str, Any], out: Path) -> None:
    """Build `spec`'s variant of `source` into the empty directory `out`, outside the cache and without hashing
    the source (quantize/pilot.py times builds of truncated sources with it)."""
    _build(spec, source, str(source), f"unhashed:{source}:{time.time_ns()}", opts, out)


def _build(spec: Method, source: Path, ref: str, source_hash: str, opts: dict[str, Any], out: Path) -> None:
    from quantize.tensor_table import tensor_table

    start = time.perf_counter()
    streamed = spec.stream(source, opts, out) if spec.stream is not None else None
    if streamed is not None:  # written and checked tensor by tensor: no model was ever whole in memory
        tensors, record, probe = streamed["tensors"], streamed.get("record", {}), streamed["probe"]
    else:
        model = spec.build(source, opts)
        result = check_built(model, source, source_hash, spec.name)  # before anything is written
        probe = {"logit_cosine": result.cosine, "top1_agreement": result.top1_agreement}
        spec.save(model, out)
        tensors, record = tensor_table(model), dict(getattr(model, "quantgate_record", {}))
        del model
    for file in sorted(source.iterdir()):
        if file.is_file() and file.name not in _NOT_COPIED and not file.name.endswith(_WEIGHT_SUFFIXES):
            if not (out / file.name).exists():
                shutil.copy2(file, out / file.name)
    seconds = time.perf_counter() - start
    missing = [name for name in spec.weight_files if not (out / name).is_file()]
    if missing:
        raise RuntimeError(f"{spec.name} did not write {missing}")
    total, by_dtype = weight_bytes(out)
    source_total = weight_bytes(source)[0] if any(source.glob("*.safetensors")) else None
    manifest = {
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "source": {"ref": ref, "path": str(source), "content_hash": source_hash, "weight_bytes": source_total},
        "method": spec.name,
        "bits": spec.bits,
        "backend": spec.backend,
        "description": spec.description,
        "group_size": spec.group_size,
        "options": opts,
        "weight_bytes": total,
        "weight_bytes_by_dtype": by_dtype,
        "quantize_seconds": round(seconds, 3),
        "probe": probe,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "versions": library_versions(spec.backend),
        **record,
        "tensors": tensors,
        "files": file_table(out),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _move_into_place(tmp: Path, target: Path, identity: dict[str, Any]) -> None:
    """Rename the finished build onto `target`; an old broken or empty `target` is moved aside first."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rename(target, old / "v")
    try:
        os.rename(tmp, target)
    except OSError:
        # Someone else finished the same variant first: keep theirs if it is intact.
        try:
            if _identity(verify_variant(target, full=True)) == identity:
                return
        except CorruptVariantError:
            pass
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def library_versions(backend: str) -> dict[str, str]:
    names = ["quantgate", "torch", "transformers", "safetensors", "accelerate"]
    if backend == "bitsandbytes":
        names.append("bitsandbytes")
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def cached_content_hash(model_dir: Path) -> str:
    """`content_hash`, remembered per directory until a file's size or mtime changes (hashing 0.5 GB takes s)."""
    model_dir = Path(model_dir).resolve()
    known, stamp, memo = _memo_entry(model_dir)
    if known is not None:
        return known
    digest = content_hash(model_dir)
    memo[str(model_dir)] = {"stamp": stamp, "hash": digest}
    memo_path = _memo_path()
    memo_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo_path.with_name(f".source-hashes.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(memo, indent=1))
    os.replace(tmp, memo_path)
    return digest


def memoized_content_hash(model_dir: Path) -> str | None:
    """The content hash `cached_content_hash` remembers for this directory as it is now; None: it would hash."""
    return _memo_entry(Path(model_dir).resolve())[0]


def _memo_path() -> Path:
    return variants_root() / ".source-hashes.json"


def _memo_entry(model_dir: Path) -> tuple[str | None, str, dict]:
    """(the remembered hash if still valid, the directory's stamp of names, sizes and mtimes, the whole memo)."""
    stamp = hashlib.sha256()
    for file in sorted(p for p in model_dir.rglob("*") if p.is_file() and not p.name.startswith(".")):
        st = file.stat()
        stamp.update(f"{file.relative_to(model_dir)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    try:
        memo = json.loads(_memo_path().read_text())
    except (OSError, ValueError):
        memo = {}
    entry = memo.get(str(model_dir))
    known = entry["hash"] if entry and entry.get("stamp") == stamp.hexdigest() else None
    return known, stamp.hexdigest(), memo


_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def measured_weight_bytes(model_ref: str | Path, dtype: str) -> dict[str, int]:
    """Measured weight bytes of a model ("baseline", when stored in `dtype`) and of its intact cached
    variants built with default options whose unquantized parts are `dtype`."""
    from quantize.methods import METHODS

    source = resolve_model(model_ref)
    measured: dict[str, int] = {}
    if any(source.glob("*.safetensors")):
        total, by_dtype = weight_bytes(source)
        if set(by_dtype) == {_SAFETENSORS_DTYPES.get(dtype)}:
            measured["baseline"] = total
    source_hash = cached_content_hash(source)
    for spec in METHODS.values():
        directory = variants_root() / variant_key(source_hash, spec, spec.defaults)
        try:
            manifest = verify_variant(directory, full=False)
        except (CorruptVariantError, OSError):
            continue
        if manifest["options"].get("dtype") == dtype:
            measured[spec.name] = manifest["weight_bytes"]
    return measured
