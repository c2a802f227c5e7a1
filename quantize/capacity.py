"""How many KV blocks and concurrent sequences fit in a memory budget beside each variant's weights.

Everything here works from a config dict alone (no weights), so a 70B-shaped model can be sized on
a laptop. Weight bytes are measured from a variant's manifest when one exists, otherwise estimated
from the config with the storage layout each method actually writes (see `linear_bytes`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quantgate.model_shape import kv_shape, text_config

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
METHOD_ROWS = ("baseline", "int8", "int8wo", "int4wo", "nf4", "fp4",
               "baseline+kv8", "int8wo+kv8", "int4wo+kv8", "int4wo+kvfp8")
INT4WO_GROUP = 32
# A variant name's KV suffix -> the engine's kv_cache_dtype; "int4wo+kv8" is int4wo weights, int8 KV cache.
KV_SUFFIXES = {"kv8": "int8", "kvfp8": "fp8"}
# kv_cache_dtype -> (bytes per code, bytes of scale per token and KV head); must match serving's cache.
KV_STORAGE = {"int8": (1, 2), "fp8": (1, 0)}


def split_variant(name: str) -> tuple[str, str]:
    """"int4wo+kv8" (or "int4wo-kv8", as recorded) -> ("int4wo", "int8"); "int8wo" -> ("int8wo", "auto");
    "int4-awq" -> ("int4-awq", "auto"); "kv8" -> ("baseline", "int8"). A '-' separates a KV suffix only
    when a KV suffix follows it: method names have dashes of their own (int4-awq)."""
    weights, sep, kv = name.rpartition("+")
    if not sep:
        weights, sep, kv = name.rpartition("-")
        if not sep or kv not in KV_SUFFIXES:
            weights, kv = (("baseline", name) if name in KV_SUFFIXES else (name, ""))
    if kv and kv not in KV_SUFFIXES:
        raise ValueError(f"unknown KV suffix {kv!r} in {name!r}; choose one of {', '.join(KV_SUFFIXES)}")
    if not weights:
        raise ValueError(f"variant {name!r} names no weights (e.g. int4wo+kv8 or baseline+kv8)")
    return weights, KV_SUFFIXES.get(kv, "auto")


def variant_label(name: str) -> str:
    """The name a variant is recorded under: MLflow names allow no '+', so "int4wo+kv8" -> "int4wo-kv8"."""
    return name.replace("+", "-")


# A Llama-3-70B-shaped config (80 layers, GQA 64/8, 128k vocab, untied): 70.6B parameters.
LLAMA_70B: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
PRESETS = {"llama-70b": LLAMA_70B}


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        config = text_config(config)
        try:
            kv = kv_shape(config)
            return cls(
                num_layers=kv.num_layers,
                hidden_size=config["hidden_size"],
                intermediate_size=config["intermediate_size"],
                num_heads=config["num_attention_heads"],
                num_kv_heads=kv.num_kv_heads,
                head_dim=kv.head_dim,
                vocab_size=config["vocab_size"],
                tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            )
        except KeyError as exc:
            raise ValueError(f"config lacks {exc.args[0]!r}: capacity needs a Llama-style decoder config") from None

    def kv_bytes_per_token(self, kv_dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
        """K and V of one token over all layers: codes plus scales for an 8-bit cache."""
        code, scale = KV_STORAGE.get(kv_cache_dtype, (kv_dtype_bytes, 0))
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * code + scale)

    def layer_linears(self) -> list[tuple[int, int]]:
        """(out, in) of the projections in one decoder layer: q, k, v, o, gate, up, down."""
        q, kv, h, i = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.hidden_size, self.intermediate_size
        return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]

    def num_params(self) -> int:
        linear = self.num_layers * sum(o * i for o, i in self.layer_linears())
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return linear + embed + norms


def linear_bytes(method: str, out_features: int, in_features: int, dtype_bytes: int) -> int:
    """Bytes one Linear's weight takes in a saved variant (biases are not counted; Llama has none)."""
    n = out_features * in_features
    if method == "baseline":
        return n * dtype_bytes
    if method in ("int8", "int8wo"):
        return n + 4 * out_features + (1 if method == "int8" else 0)  # int8 codes + fp32 row scale (+ format byte)
    if method == "w8a8":  # int8 codes + fp32 row scale + the fp32 1 / smooth per input
        return n + 4 * out_features + 4 * in_features
    if method == "int4wo":  # nibbles + a bf16 scale and zero per group of 32 inputs
        return n // 2 + 4 * out_features * (in_features // INT4WO_GROUP)
    if method in ("nf4", "fp4"):
        blocks = math.ceil(n / 64)
        # packed nibbles + int8 absmax per block of 64 + fp32 absmax per 256 blocks + code tables + state json
        return n // 2 + blocks + 4 * math.ceil(blocks / 256) + 1024 + 64 + 166
    raise ValueError(f"no weight estimate for method {method!r}; choose one of {METHOD_ROWS}")


def estimate_weight_bytes(shape: ModelShape, method: str, dtype_bytes: int = 2) -> int:
    """Weight bytes of `method` applied to `shape`: quantized projections, the rest at `dtype_bytes`.

    bitsandbytes leaves embeddings and lm_head unquantized; int8wo / int4wo store them as int8 rows /
    int4 groups, one shared table when they are tied.
    """
    per_layer = sum(linear_bytes(method, o, i, dtype_bytes) for o, i in shape.layer_linears())
    norms = (2 * shape.num_layers + 1) * shape.hidden_size * dtype_bytes
    tables = 1 if shape.tie_word_embeddings else 2
    v, h = shape.vocab_size, shape.hidden_size
    if method in ("int8wo", "w8a8"):
        embed = tables * (v * h + 4 * v)
    elif method == "int4wo":
        embed = tables * linear_bytes("int4wo", v, h, dtype_bytes)
    else:
        embed = tables * v * h * dtype_bytes
    return shape.num_layers * per_layer + norms + embed


@dataclass(frozen=True)
class CapacityRow:
    variant: str
    weight_bytes: int
    weights_source: str  # "measured" (from a variant manifest) or "config" (estimated)
    kv_bytes_per_block: int
    num_blocks: int
    blocks_per_seq: int
    max_seqs: int


def kv_blocks(memory_bytes: int, weight_bytes: int, bytes_per_block: int, reserve_bytes: int = 0) -> int:
    """KV blocks that fit in what the weights (and a fixed reserve for activations) leave free."""
    return max(0, (memory_bytes - weight_bytes - reserve_bytes) // bytes_per_block)


def kv_cache_memory_gb(memory_gb: float, weight_bytes: int, reserve_gb: float = 0.0) -> float:
    """The engine's `kv_cache_memory_gb` for a total budget: what is left beside the weights."""
    left = memory_gb * GIB - weight_bytes - reserve_gb * GIB
    if left <= 0:
        raise ValueError(f"the weights ({weight_bytes / GIB:.2f} GiB) leave nothing of a {memory_gb} GiB budget")
    return left / GIB


def capacity_row(
    variant: str,
    shape: ModelShape,
    weight_bytes: int,
    memory_bytes: int,
    *,
    seq_len: int,
    block_size: int = 16,
    kv_dtype_bytes: int = 2,
    kv_cache_dtype: str = "auto",
    reserve_bytes: int = 0,
    weights_source: str = "config",
) -> CapacityRow:
    if seq_len < 1 or block_size < 1:
        raise ValueError("seq_len and block_size must be positive")
    per_block = block_size * shape.kv_bytes_per_token(kv_dtype_bytes, kv_cache_dtype)
    blocks = kv_blocks(memory_bytes, weight_bytes, per_block, reserve_bytes)
    per_seq = math.ceil(seq_len / block_size)
    return CapacityRow(variant, weight_bytes, weights_source, per_block, blocks, per_seq, blocks // per_seq)


def capacity_shortfall(row: CapacityRow, memory_bytes: int, reserve_bytes: int = 0) -> str | None:
    """Why a row's capacity is no measurement (its weights leave the budget no KV block), None when it is: a 0 is
    never reported as a capacity, it is said so."""
    if row.num_blocks > 0:
        return None
    return (f"{row.weight_bytes / GIB:.2f} GiB of weights{f' + {reserve_bytes / GIB:.2f} GiB reserved' if reserve_bytes else ''}"
            f" leave no {row.kv_bytes_per_block}-byte KV block of a {memory_bytes / GIB:.2f} GiB budget")


def capacity_table(
    config: dict[str, Any],
    memory_bytes: int,
    *,
    seq_len: int,
    block_size: int = 16,
    dtype: str = "bfloat16",
    reserve_bytes: int = 0,
    measured: dict[str, int] | None = None,
    variants: tuple[str, ...] = METHOD_ROWS,
) -> list[CapacityRow]:
    """One row per variant; `dtype` is the baseline's weights, the variants' unquantized parts and the KV cache
    (unless the name carries a KV suffix: `int4wo+kv8` keeps the cache in int8 codes + scales)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    shape = ModelShape.from_config(config)
    measured = measured or {}
    rows = []
    for variant in variants:
        method, kv = split_variant(variant)
        if method in measured:
            weights, source = measured[method], "measured"
        else:
            weights, source = estimate_weight_bytes(shape, method, DTYPE_BYTES[dtype]), "config"
        rows.append(capacity_row(variant, shape, weights, memory_bytes, seq_len=seq_len, block_size=block_size,
                                 kv_dtype_bytes=DTYPE_BYTES[dtype], kv_cache_dtype=kv, reserve_bytes=reserve_bytes,
                                 weights_source=source))
    return rows


def device_free_bytes(device: str | None = None) -> int:
    """Free memory of the device: CUDA's free memory, or MemAvailable on CPU."""
    if device is None or device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.mem_get_info(torch.device(device or "cuda"))[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def load_config(ref: str) -> dict[str, Any]:
    """A preset name, a config.json path, or any model reference (its config.json)."""
    if ref in PRESETS:
        return dict(PRESETS[ref])
    path = Path(ref).expanduser()
    if path.is_file() and path.suffix == ".json":
        return json.loads(path.read_text())
    from quantgate.models import resolve_model

    return json.loads((resolve_model(ref) / "config.json").read_text())


def format_table(rows: list[CapacityRow], memory_bytes: int, seq_len: int) -> str:
    base = next((r for r in rows if r.variant == "baseline"), None)
    lines = [
        f"budget {memory_bytes / GIB:.2f} GiB, sequences of {seq_len} tokens",
        f"{'variant':<14}{'weights GiB':>12}{'source':>10}{'KV blocks':>12}{'max seqs':>10}{'vs baseline':>13}",
    ]
    for r in rows:
        ratio = "-" if not base or r is base else ("inf" if base.max_seqs == 0 and r.max_seqs else
                                                   f"{r.max_seqs / base.max_seqs:.2f}x" if base.max_seqs else "-")
        lines.append(f"{r.variant:<14}{r.weight_bytes / GIB:>12.3f}{r.weights_source:>10}"
                     f"{r.num_blocks:>12}{r.max_seqs:>10}{ratio:>13}")
    return "\n".join(lines)


def rows_as_dicts(rows: list[CapacityRow]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


def weight_bytes_of(model_dir: str | Path) -> int:
    """Weight bytes of any model directory: a variant's manifest, else its safetensors headers."""
    from serving.model.quant.integrity import is_variant, read_manifest, weight_bytes

    if is_variant(model_dir):
        return int(read_manifest(model_dir)["weight_bytes"])
    total, _ = weight_bytes(Path(model_dir))
    if not total:
        raise ValueError(f"{model_dir} holds no safetensors weights to measure")
    return total


if __name__ == "__main__":  # python -m quantize.capacity --memory-gb 80 --model llama-70b
    import sys

    from quantgate.cli import main

    raise SystemExit(main(["capacity", *sys.argv[1:]]))
