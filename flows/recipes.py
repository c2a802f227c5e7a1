"""Quantization recipes by name, and the candidates `quantgate tune` tries, smallest first.

A recipe name is a method the release can build: a method of `quantize.methods` (`int8wo`, `int4wo`, ...)
or an int4 recipe `int4_<algorithm>_g<group>` — `int4_rtn_g64` (int4wo's round-to-nearest at group 64),
`int4_awq_g64`, `int4_gptq_g64` (the calibrated methods at that group). Either may carry a KV suffix
(`int4_awq_g64+kv8`: an 8-bit KV cache), as release methods do. So a recipe `tune` chose is released with
`quantgate release --methods <name>` unchanged (`--recipe-from-tune FILE` reads the name from tune's file).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

INT4_ALGORITHMS = {"rtn": "int4wo", "awq": "int4-awq", "gptq": "int4-gptq"}  # algorithm -> quantize method
ALGORITHM_ORDER = ("rtn", "awq", "gptq")  # at equal size: the cheapest build first
GROUP_SIZES = (128, 64, 32)
KV_CHOICES = ("int8", "auto")  # the 8-bit cache first: smaller at equal weights
_INT4 = re.compile(r"^int4_(rtn|awq|gptq)_g(\d+)$")
_KV_SUFFIX = {"int8": "+kv8", "fp8": "+kvfp8", "auto": ""}


@dataclass(frozen=True)
class Recipe:
    """What one recipe name builds: a method of the method table and its options."""

    name: str  # the weights' name, no KV suffix ("int4_awq_g64", "int8wo")
    method: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def group_size(self) -> int | None:
        return self.options.get("group_size")

    @property
    def algorithm(self) -> str:
        m = _INT4.match(self.name)
        return m.group(1) if m else self.name


def parse(name: str) -> Recipe:
    """A weights recipe name (no KV suffix) -> its method and options; unknown names raise ValueError."""
    m = _INT4.match(name)
    if m:
        return Recipe(name, INT4_ALGORITHMS[m.group(1)], {"group_size": int(m.group(2))})
    from quantize.methods import get_method

    return Recipe(name, get_method(name).name, {})


@dataclass(frozen=True)
class Candidate:
    """One recipe with its KV cache, and the size that orders the search."""

    recipe: Recipe
    kv_cache_dtype: str  # "auto" | "int8"
    weight_bytes: int  # estimated from the config with the layout the method writes
    kv_bytes_per_token: int

    @property
    def name(self) -> str:
        """As a release method: "int4_awq_g64+kv8"."""
        return self.recipe.name + _KV_SUFFIX[self.kv_cache_dtype]

    @property
    def label(self) -> str:
        """As recorded (MLflow run, registered version): "int4_awq_g64-kv8"."""
        return self.name.replace("+", "-")

    def sort_key(self) -> tuple:
        rank = ALGORITHM_ORDER.index(self.recipe.algorithm) if self.recipe.algorithm in ALGORITHM_ORDER else 9
        return (self.weight_bytes, self.kv_bytes_per_token, rank, self.name)


@dataclass(frozen=True)
class Refused:
    name: str
    reason: str


def default_names() -> list[str]:
    """int4 groups 128/64/32 x RTN/AWQ/GPTQ, int8wo, each with and without an 8-bit KV cache."""
    weights = [f"int4_{a}_g{g}" for g in GROUP_SIZES for a in ALGORITHM_ORDER] + ["int8wo"]
    return [w + kv for w in weights for kv in ("+kv8", "")]


def quantized_widths(config: dict) -> dict[str, int]:
    """Input width of every kind of layer int4 quantizes (a decoder's projections, lm_head, embedding)."""
    from quantize.capacity import ModelShape

    s = ModelShape.from_config(config)
    return {"q/k/v/gate/up_proj, lm_head, embedding": s.hidden_size, "o_proj": s.num_heads * s.head_dim,
            "down_proj": s.intermediate_size}


def group_refusal(config: dict, group_size: int) -> str | None:
    """Why `group_size` cannot be used on this model (None: it divides every quantized layer's input)."""
    widths = quantized_widths(config)
    bad = {k: w for k, w in widths.items() if w % group_size}
    if not bad:
        return None
    dividing = [g for g in GROUP_SIZES if all(w % g == 0 for w in widths.values())]
    return (f"group size {group_size} does not divide the input width of {', '.join(f'{k} ({w})' for k, w in bad.items())}: "
            f"those layers would stay unquantized; groups that divide every layer: {dividing or 'none'}")


def estimate_weight_bytes(config: dict, recipe: Recipe) -> int:
    """Saved weight bytes of `recipe` on this config: int4 at its group size (a layer whose outputs are not a
    multiple of the kernel's rows stays float32, as int4wo leaves it), int8wo and others by quantize.capacity."""
    from quantize.capacity import ModelShape
    from quantize.capacity import estimate_weight_bytes as estimate
    from serving.model.quant.int4 import KERNEL_ROWS

    shape = ModelShape.from_config(config)
    g = recipe.group_size
    if g is None:
        return estimate(shape, recipe.method, 4)

    def int4(out: int, inp: int) -> int:
        return out * inp // 2 + 4 * out * (inp // g) if out % KERNEL_ROWS == 0 else 4 * out * inp

    per_layer = sum(int4(o, i) for o, i in shape.layer_linears())
    norms = (2 * shape.num_layers + 1) * shape.hidden_size * 4
    tables = (1 if shape.tie_word_embeddings else 2) * int4(shape.vocab_size, shape.hidden_size)
    return shape.num_layers * per_layer + norms + tables


def candidates(config: dict, names: list[str] | None = None) -> tuple[list[Candidate], list[Refused]]:
    """The candidates smallest first (weights, then KV bytes per token, then the cheaper build), and the
    names refused before anything is built, each with its reason."""
    from quantize.capacity import ModelShape
    from quantize.capacity import split_variant as split_method

    shape = ModelShape.from_config(config)
    out: list[Candidate] = []
    refused: list[Refused] = []
    seen: set[str] = set()
    for name in names if names is not None else default_names():
        weights, kv = split_method(name)
        recipe = parse(weights)
        if kv not in KV_CHOICES:
            raise ValueError(f"{name}: tune tries an int8 KV cache or none (kv8), not {kv!r}")
        cand = Candidate(recipe, kv, estimate_weight_bytes(config, recipe), shape.kv_bytes_per_token(4, kv))
        if cand.name in seen:
            raise ValueError(f"candidate {name!r} repeats")
        seen.add(cand.name)
        why = group_refusal(config, recipe.group_size) if recipe.group_size else None
        if why:
            refused.append(Refused(cand.name, why))
        else:
            out.append(cand)
    return sorted(out, key=Candidate.sort_key), refused


def layout_name(c: Candidate) -> str:
    """The candidate whose build has the same served layout (so the same speed): RTN at the same group and
    KV cache; the calibrated methods only choose other codes in int4wo's layout (docs/quantize.md)."""
    if c.recipe.group_size is None:
        return c.name
    return f"int4_rtn_g{c.recipe.group_size}" + _KV_SUFFIX[c.kv_cache_dtype]
