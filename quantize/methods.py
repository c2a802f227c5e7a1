"""The method table: one entry per quantization method; another backend is one more entry.

A method builds a quantized model from a plain HF directory and saves it into a directory; the engine loads
it back by its weight files (serving/model/quant/loader.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Method:
    name: str
    bits: int
    backend: str
    description: str
    # Quantization granularity recorded in the manifest: block size (4-bit), or None = one scale per row.
    group_size: int | None
    build: Callable[[Path, dict[str, Any]], PreTrainedModel]
    save: Callable[[PreTrainedModel, Path], None]
    defaults: dict[str, Any] = field(default_factory=dict)
    # Names of the saved weight files, so verification knows what must be there.
    weight_files: tuple[str, ...] = ("model.safetensors",)
    # Builds and saves straight from a safetensors source into the directory, tensor by tensor, returning the
    # manifest's "tensors" and "probe"; None where the source cannot be streamed (then build + save run).
    stream: Callable[[Path, dict[str, Any], Path], dict[str, Any] | None] | None = None

    def options(self, opts: dict[str, Any]) -> dict[str, Any]:
        """Defaults overlaid with `opts`; an option this method does not have is an error."""
        unknown = sorted(set(opts) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"method {self.name!r} has no option {', '.join(map(repr, unknown))}; "
                f"its options are {sorted(self.defaults) or 'none'}"
            )
        merged = {**self.defaults, **opts}
        for key in ("compute_dtype", "dtype"):
            if key in merged and merged[key] not in DTYPES:
                raise ValueError(f"{key} must be one of {DTYPES}, got {merged[key]!r}")
        if "group_size" in merged and merged["group_size"] not in (32, 64, 128, 256):
            raise ValueError(f"group_size must be 32, 64, 128 or 256, got {merged['group_size']!r}")
        return merged


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def _bnb_config(method: str, opts: dict[str, Any]):
    from transformers import BitsAndBytesConfig

    if method == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=float(opts["threshold"]))
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=method,
        bnb_4bit_use_double_quant=bool(opts["double_quant"]),
        bnb_4bit_compute_dtype=_torch_dtype(opts["compute_dtype"]),
    )


def _bnb_builder(method: str) -> Callable[[Path, dict[str, Any]], PreTrainedModel]:
    def build(source: Path, opts: dict[str, Any]) -> PreTrainedModel:
        from quantgate.loading import load_causal_lm
        from serving.model.quant.loader import quiet_bitsandbytes

        quiet_bitsandbytes()

        # Linear4bit packs its weights when placed on a device; device_map places them during load.
        model = load_causal_lm(
            source,
            quantization_config=_bnb_config(method, opts),
            dtype=_torch_dtype(opts["dtype"]),
            device_map={"": opts["device"]},
        ).eval()
        import bitsandbytes as bnb

        if not any(isinstance(m, bnb.nn.Linear8bitLt | bnb.nn.Linear4bit) for m in model.modules()):
            raise ValueError(f"bitsandbytes found no layer to quantize in {type(model).__name__}")
        return model

    return build


def _save_pretrained(model: PreTrainedModel, out: Path) -> None:
    model.save_pretrained(out, safe_serialization=True)


def _weight_only(method: str):
    """build, save and load of our own weight-only formats (int8wo, int4wo)."""

    def build(source: Path, opts: dict[str, Any]) -> PreTrainedModel:
        import torch

        from quantgate.loading import load_causal_lm
        from serving.model.quant.int8 import quantize_model

        model = load_causal_lm(source, dtype=_torch_dtype(opts["dtype"])).eval()
        if opts.get("group_size"):
            from serving.model.quant.int4 import check_group_size

            check_group_size(model, opts["group_size"], opts["quantize_lm_head"], opts["quantize_embeddings"])
        with torch.no_grad():
            swapped = quantize_model(model, opts["quantize_lm_head"], opts["quantize_embeddings"],
                                     opts.get("group_size"))
        if not swapped:
            raise ValueError(f"{type(model).__name__} has no nn.Linear layers for {method} to quantize")
        return model

    def save(model: PreTrainedModel, out: Path) -> None:
        from serving.model.quant.checkpoint import save_weight_only

        save_weight_only(model, out, method)

    return build, save


def _streamed(method: str) -> Callable[[Path, dict[str, Any], Path], dict[str, Any] | None]:
    """int8wo / int4wo streamed (quantize/streaming.py): memory bounded by a block of rows, not the model."""

    def stream(source: Path, opts: dict[str, Any], out: Path) -> dict[str, Any] | None:
        import logging
        import time

        from quantize import streaming
        from quantize.probe import check_streamed

        if not streaming.streamable(source):
            return None
        try:
            plan = streaming.plan_stream(source, method, opts)
        except streaming.NotStreamable as exc:
            logging.getLogger(__name__).warning("%s; building %s in memory", exc, method)
            return None
        started = time.perf_counter()
        weights = streaming.write_stream(plan, out)
        written = time.perf_counter()
        check = check_streamed(plan, weights)
        logging.getLogger(__name__).info("%s: written in %.0f s, checked tensor by tensor in %.0f s", method,
                                         written - started, time.perf_counter() - written)
        probe = {"kind": "per-tensor", "tensors": check.tensors, "worst_error_over_bound": check.worst_ratio,
                 "worst_tensor": check.worst_tensor, "relative_error": check.relative_error}
        return {"tensors": plan.table, "probe": probe}

    return stream


def _bitsandbytes(name: str, bits: int, description: str, group_size: int | None,
                  defaults: dict[str, Any]) -> Method:
    """A bitsandbytes method: built on load by transformers, saved and loaded back as a plain HF directory."""
    return Method(name, bits, "bitsandbytes", description, group_size, _bnb_builder(name), _save_pretrained,
                  defaults={**defaults, "dtype": "float32", "device": "cpu"})


def _ours(name: str, bits: int, description: str, group_size: int | None, defaults: dict[str, Any]) -> Method:
    """One of quantgate's weight-only formats: its own build, save and load, one `<name>.safetensors`."""
    return Method(name, bits, "quantgate", description, group_size, *_weight_only(name),
                  defaults={"quantize_lm_head": True, "quantize_embeddings": True, "dtype": "float32", **defaults},
                  weight_files=(f"{name}.safetensors",), stream=_streamed(name))


def _calibrated(algorithm: str, description: str, defaults: dict[str, Any]) -> Method:
    """int4 codes chosen on calibration text (quantize/calibrated_build.py), saved and served as int4wo."""

    def build(source: Path, opts: dict[str, Any]) -> PreTrainedModel:
        from quantize.calibrated_build import build_calibrated

        return build_calibrated(source, opts, algorithm)

    def stream(source: Path, opts: dict[str, Any], out: Path) -> dict[str, Any] | None:
        from quantize.calibrated_build import recipe_of
        from quantize.calibrated_stream import stream_calibrated

        return stream_calibrated(source, opts, recipe_of(algorithm, opts), out)

    _, save = _weight_only("int4wo")
    return Method(f"int4-{algorithm}", 4, "quantgate", description, 32, build, save, stream=stream,
                  defaults={"group_size": 32, "bits": 4, "calibration_tokens": 2048, "seq_len": 256,
                            "quantize_lm_head": True, "quantize_embeddings": True, "dtype": "float32", **defaults},
                  weight_files=("int4wo.safetensors",))


def _w8a8() -> Method:
    """int8 weights and activations (quantize/w8a8.py), saved and loaded as `w8a8.safetensors`."""

    def build(source: Path, opts: dict[str, Any]) -> PreTrainedModel:
        from quantize.w8a8 import build_w8a8

        return build_w8a8(source, opts)

    def save(model: PreTrainedModel, out: Path) -> None:
        from serving.model.quant.checkpoint import save_weight_only

        save_weight_only(model, out, "w8a8")

    def stream(source: Path, opts: dict[str, Any], out: Path) -> dict[str, Any] | None:
        from quantize.w8a8_stream import stream_w8a8

        return stream_w8a8(source, opts, out)

    return Method("w8a8", 8, "quantgate", "int8 weights per output channel and int8 activations per row at each "
                  "call (SmoothQuant scales from calibration text); products on the CPU's int8 dot products, "
                  "fast prefill and decode under load", None, build, save,
                  defaults={"calibration_tokens": 1024, "seq_len": 256, "quantize_lm_head": True,
                            "quantize_embeddings": True, "dtype": "float32"},
                  weight_files=("w8a8.safetensors",), stream=stream)


_BNB_4BIT_DEFAULTS = {"double_quant": True, "compute_dtype": "float32"}

METHODS: dict[str, Method] = {
    m.name: m for m in (
        _bitsandbytes("int8", 8, "bitsandbytes LLM.int8(): int8 rows with fp16 outlier columns (threshold 6.0)",
                      None, {"threshold": 6.0}),
        _bitsandbytes("nf4", 4, "bitsandbytes 4-bit NormalFloat, blocks of 64, double quantization",
                      64, _BNB_4BIT_DEFAULTS),
        _bitsandbytes("fp4", 4, "bitsandbytes 4-bit float, blocks of 64, double quantization",
                      64, _BNB_4BIT_DEFAULTS),
        _ours("int8wo", 8, "weight-only int8, one scale per output channel (gpt-fast style); fast CPU decode",
              None, {}),
        _ours("int4wo", 4, "weight-only int4, groups of 32 with a bf16 scale and zero each (gpt-fast style); "
                           "fast CPU decode", 32, {"group_size": 32}),
        _calibrated("gptq", "int4wo's layout with GPTQ's codes: column-wise error feedback through the inverse "
                            "Hessian of calibration activations", {"damp": 0.01}),
        _calibrated("awq", "int4wo's layout with AWQ's activation-aware channel scales folded into the norms "
                           "and linears before each layer", {"grid": 20}),
        _w8a8(),
    )
}

# What a release means by INT8 / INT4: our weight-only kernels, the fast ones on CPU. INT4 is AWQ's codes in
# int4wo's layout: the same kernels and decode speed, never worse than round-to-nearest on its calibration
# data (s = 1 is one of its candidates), better wherever the source is not on int4's grid already
# (docs/quantize.md, "Release default").
INT8_DEFAULT = "int8wo"
INT4_DEFAULT = "int4-awq"

# A release's methods when none are named, by the device it serves on: those with real kernels there. CPU:
# our weight-only kernels (bitsandbytes' CPU kernels are slower than bf16). CUDA: the same formats through
# serving/kernels/cuda/wo_gemm.py's Triton GEMMs, and bitsandbytes LLM.int8() and NF4 through its CUDA kernels.
DEFAULT_METHODS: dict[str, tuple[str, ...]] = {
    "cpu": (INT8_DEFAULT, INT4_DEFAULT),
    "cuda": (INT8_DEFAULT, INT4_DEFAULT, "int8", "nf4"),
}


def default_methods(device: str) -> tuple[str, ...]:
    """The release's default methods on `device` ("cpu", "cuda", "cuda:1")."""
    kind = str(device).split(":")[0].strip().lower()
    if kind not in DEFAULT_METHODS:
        raise ValueError(f"no default methods for device {device!r}; devices: {', '.join(DEFAULT_METHODS)}")
    return DEFAULT_METHODS[kind]


def get_method(name: str) -> Method:
    key = str(name).strip().lower()
    if key == "int4":
        key = INT4_DEFAULT
    if key not in METHODS:
        raise ValueError(f"unknown quantization method {name!r}; choose one of {', '.join(METHODS)} "
                         f"(int4 = {INT4_DEFAULT})")
    return METHODS[key]
