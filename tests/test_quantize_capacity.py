"""Capacity from a config alone: exact block arithmetic, weight estimates equal to what variants store."""

from __future__ import annotations

import json

import pytest

from quantgate.cli import main as cli_main
from quantize.capacity import (
    GIB,
    LLAMA_70B,
    ModelShape,
    capacity_row,
    capacity_table,
    estimate_weight_bytes,
    kv_cache_memory_gb,
)

CRAFTED = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 1000,
    "tie_word_embeddings": True,
}


def test_crafted_config_numbers_are_exact():
    shape = ModelShape.from_config(CRAFTED)
    assert shape.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2 == 256
    # q 64x64, k 32x64, v 32x64, o 64x64, gate/up/down 128x64: 36,864 per layer; tied 1000x64 table; 5 norms
    assert shape.num_params() == 2 * 36864 + 64000 + 5 * 64 == 138048
    assert estimate_weight_bytes(shape, "baseline", 2) == 276096
    row = capacity_row("baseline", shape, 100_000, 1 << 20, seq_len=100, block_size=16)
    assert row.kv_bytes_per_block == 4096
    assert row.num_blocks == (1048576 - 100_000) // 4096 == 231
    assert row.blocks_per_seq == 7 and row.max_seqs == 33
    reserved = capacity_row("baseline", shape, 100_000, 1 << 20, seq_len=100, reserve_bytes=4096 * 31)
    assert reserved.num_blocks == 200 and reserved.max_seqs == 28
    assert capacity_row("baseline", shape, 2 << 20, 1 << 20, seq_len=100).max_seqs == 0  # weights do not fit


def test_70b_shaped_config_from_the_config_alone():
    shape = ModelShape.from_config(LLAMA_70B)
    assert shape.num_params() == 70_553_706_496
    assert shape.kv_bytes_per_token(2) == 327_680  # 320 KiB of bf16 K+V per token
    rows = {r.variant: r for r in capacity_table(LLAMA_70B, 160 * GIB, seq_len=4096)}
    assert rows["baseline"].weight_bytes == 2 * shape.num_params()
    assert rows["nf4"].weight_bytes < rows["int8"].weight_bytes < rows["baseline"].weight_bytes / 1.9
    # at 160 GiB, 16-bit weights leave ~29 GiB of KV; INT8 weights leave ~92 GiB
    assert rows["baseline"].max_seqs == 22 and rows["int8"].max_seqs == 73
    assert rows["int8"].max_seqs >= 2 * rows["baseline"].max_seqs
    assert rows["nf4"].max_seqs > rows["int8"].max_seqs


def test_estimates_equal_the_bytes_variants_actually_store(tiny_model_dir):
    import quantize
    from quantize.variant import measured_weight_bytes

    for method in ("int8", "int8wo", "nf4"):
        quantize.quantize(tiny_model_dir, method)
    measured = measured_weight_bytes(tiny_model_dir, "float32")
    shape = ModelShape.from_config(json.loads((tiny_model_dir / "config.json").read_text()))
    for method in ("baseline", "int8", "int8wo"):
        assert estimate_weight_bytes(shape, method, 4) == measured[method], method
    assert estimate_weight_bytes(shape, "nf4", 4) == pytest.approx(measured["nf4"], abs=64)  # json state blob


def test_engine_budget_helper(tiny_model_dir):
    import quantize
    from quantize.capacity import weight_bytes_of

    assert weight_bytes_of(tiny_model_dir) == 12_879_104  # fp32, the tied table stored once
    variant = quantize.quantize(tiny_model_dir, "int8wo")
    assert weight_bytes_of(variant) == quantize.read_manifest(variant)["weight_bytes"] < 12_879_104 / 3
    assert kv_cache_memory_gb(10, 2 * GIB, reserve_gb=1) == pytest.approx(7.0)
    with pytest.raises(ValueError, match="leave nothing"):
        kv_cache_memory_gb(1, 2 * GIB)


def test_cli_capacity_table(tmp_path, capsys):
    out = tmp_path / "cap.json"
    assert cli_main(["capacity", "--model", "llama-70b", "--memory-gb", "160", "--seq-len", "4096",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "llama-70b" in text and "3.32x" in text
    data = json.loads(out.read_text())
    assert [r["variant"] for r in data["rows"]][:2] == ["baseline", "int8"]
    assert data["rows"][1]["max_seqs"] == 73
    assert cli_main(["capacity", "--model", "llama-70b", "--dtype", "int2", "--memory-gb", "1"]) == 2
