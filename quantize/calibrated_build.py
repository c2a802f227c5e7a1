"""`int4-gptq` and `int4-awq`: build a variant in int4wo's layout from a plain HF directory.

Calibration chooses the codes, scales and zeros (and AWQ the folded norm weights); the layers are then
int4wo's own `Int4WeightOnlyLinear`/`Int4Embedding`, saved and loaded as int4wo saves and loads them, so
every kernel path serves these variants unchanged.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantize.calibrated import Recipe, calibrate
from quantize.group_grid import GroupCodes, round_to_nearest
from serving.model.quant.int4 import Int4Embedding, Int4WeightOnlyLinear, check_group_size
from serving.model.quant.int8 import keep_embedding_scale

ALGORITHM_OPTIONS = {"gptq": ("damp",), "awq": ("grid",), "rtn": ()}


def recipe_of(algorithm: str, opts: dict[str, Any]) -> Recipe:
    """The recipe the options ask for; a bad value is a ValueError here, before any model is loaded."""
    extra = {k: opts[k] for k in ALGORITHM_OPTIONS[algorithm]}
    recipe = Recipe(algorithm, int(opts["group_size"]), int(opts["bits"]),
                    quantize_lm_head=bool(opts["quantize_lm_head"]), **extra)
    if algorithm != "rtn":
        tokens, seq_len = int(opts["calibration_tokens"]), int(opts["seq_len"])
        if seq_len < 8 or tokens < seq_len or tokens % seq_len:
            raise ValueError(f"calibration_tokens ({tokens}) must be a positive multiple of seq_len ({seq_len} >= 8)")
    return recipe


def build_calibrated(source: Path, opts: dict[str, Any], algorithm: str, show_progress: bool = True) -> nn.Module:
    from transformers import AutoTokenizer

    from quantgate.loading import load_causal_lm
    from quantize.calibration import calibration_set

    recipe = recipe_of(algorithm, opts)
    model = load_causal_lm(source, dtype=getattr(torch, opts["dtype"])).eval()
    check_group_size(model, recipe.group_size, recipe.quantize_lm_head, bool(opts["quantize_embeddings"]))
    record: dict[str, Any] = {"algorithm": {"name": algorithm, **recipe.__dict__}}
    start = time.perf_counter()
    if algorithm == "rtn":
        ids = None
    else:
        calibration = calibration_set(AutoTokenizer.from_pretrained(source), int(opts["calibration_tokens"]),
                                      int(opts["seq_len"]))
        ids, record["calibration"] = calibration.ids, calibration.record
    codes = calibrate(model, ids, recipe, show_progress)
    swap_in(model, codes, recipe, bool(opts["quantize_embeddings"]))
    record["algorithm"]["seconds"] = round(time.perf_counter() - start, 3)
    model.quantgate_record = record
    return model


def swap_in(model: nn.Module, codes: dict[str, GroupCodes], recipe: Recipe, quantize_embeddings: bool) -> None:
    """Replace each calibrated linear by an Int4WeightOnlyLinear holding its codes (and the embedding)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and isinstance(embed, nn.Embedding) and head.weight is embed.weight
    for name, group_codes in codes.items():
        linear = model.get_submodule(name)
        new = Int4WeightOnlyLinear(linear.in_features, linear.out_features, linear.bias is not None,
                                   linear.weight.dtype, recipe.group_size)
        new.codes, new.scales_and_zeros = group_codes.layout()
        if linear.bias is not None:
            new.bias.data.copy_(linear.bias.detach())
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new.to(linear.weight.device))
    if not quantize_embeddings or not isinstance(embed, nn.Embedding):
        return
    new_head = model.get_output_embeddings()
    if tied and isinstance(new_head, Int4WeightOnlyLinear):
        new_embed = Int4Embedding.sharing(new_head, embed.weight.dtype)
    else:
        new_embed = Int4Embedding(embed.num_embeddings, embed.embedding_dim, embed.weight.dtype, recipe.group_size)
        new_embed.codes, new_embed.scales_and_zeros = round_to_nearest(
            embed.weight.detach(), recipe.group_size, recipe.bits).layout()
    model.set_input_embeddings(keep_embedding_scale(embed, new_embed))

