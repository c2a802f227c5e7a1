"""benchmarks/cuda_decode.py's pure parts, which the device check (scripts/gpu_check.sh) judges by: the presets
(the trimmed default and --full), the identity verdict against HF, the HBM share, the targets and the dry run.
The measured parts need a GPU (or minutes of Triton's interpreter: `bash scripts/gpu_check.sh --cpu`)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import cuda_decode as bench


def test_the_default_is_the_trimmed_check_and_full_the_sweep_options_win():
    trimmed = bench.parse_args([])
    assert (trimmed.shapes, trimmed.batches, trimmed.wo_batches, trimmed.graphs) == (["llama-1b"], [1, 64], [1, 64],
                                                                                        [True])
    assert trimmed.variants == ["bf16", "int4wo", "int8wo"] and trimmed.prefill == 512 and trimmed.identity
    full = bench.parse_args(["--full"])
    assert full.shapes == ["smollm2-135m", "llama-1b"] and full.graphs == [True, False] and max(full.batches) == 256
    assert bench.parse_args(["--full", "--shapes", "tiny", "--graphs", "off"]).shapes == ["tiny"]
    assert bench.parse_args(["--full", "--graphs", "off"]).graphs == [False]


@pytest.mark.parametrize("argv", [["--graphs", "sometimes"], ["--variants", "int3wo"], ["--shapes", "gpt-5"],
                                  ["--batches", "0"], ["--prefill", "640"]])
def test_bad_options_stop_before_anything_runs(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_fp32_must_be_token_identical_bf16_within_the_tests_tolerance():
    ref, ref_lps = [[5, 6, 7, 8], [9, 9]], [[-0.1, -0.2, -0.3, -0.4], [-1.0, -1.0]]
    same = bench.compare_greedy(ref, ref_lps, ref, ref_lps, exact=True)
    assert same["ok"] and same["agreed"] == [4, 2] and same["max_gap"] == 0
    parted = [[5, 6, 7, 1], [9, 9]]  # a bf16 near tie parts the first text at its 4th token
    assert not bench.compare_greedy(ref, ref_lps, parted, ref_lps, exact=True)["ok"]
    close = bench.compare_greedy(ref, ref_lps, parted, [[-0.11, -0.2, -0.3, -9.0], [-1.02, -1.0]], exact=False)
    assert close["ok"] and close["agreed"] == [3, 2]  # the 4th token's gap is not compared: the texts parted
    assert close["max_gap"] == pytest.approx(0.02) and close["lengths"] == [4, 2]


def test_bf16_verdicts_fail_on_an_early_parting_or_a_large_gap():
    ref, lps = [[1, 2, 3, 4]], [[-0.1, -0.1, -0.1, -0.1]]
    assert bench.compare_greedy(ref, lps, [[1, 2, 3, 9]], lps, exact=False)["ok"]
    assert not bench.compare_greedy(ref, lps, [[1, 2, 9, 9]], lps, exact=False)["ok"]  # parted before 3 tokens
    assert not bench.compare_greedy(ref, lps, ref, [[-0.1, -0.1, -0.1, -0.7]], exact=False)["ok"]  # max gap 0.6
    assert not bench.compare_greedy(ref, lps, ref, [[-0.2, -0.2, -0.2, -0.2]], exact=False)["ok"]  # mean gap 0.1


def test_nominal_bandwidth_by_device_name():
    assert bench.nominal_bandwidth("NVIDIA H200") == 4.8e12
    assert bench.nominal_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert bench.nominal_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert bench.nominal_bandwidth("NVIDIA GeForce RTX 4090") is None


def _row(variant: str, batch: int, tok_s: float, graphs: bool = True, shape: str = "llama-1b", **extra) -> dict:
    return {"shape": shape, "variant": variant, "graphs": graphs, "batch": batch, "tok_s": tok_s, **extra}


def test_targets_pass_miss_and_na_from_the_decode_rows():
    rows = [_row("bf16", 1, 400.0), _row("bf16", 64, 20000.0, hbm_fraction=0.62, hbm_fraction_nominal=0.556),
            _row("int4wo", 1, 560.0), _row("bf16", 64, 9000.0, graphs=False, hbm_fraction=0.9)]
    b64, int4 = bench.evaluate_targets(rows)
    assert b64["status"] == "PASS" and b64["value"] == 0.62 and "0.556 of the nominal" in b64["note"]
    assert int4["status"] == "MISS" and int4["value"] == pytest.approx(1.4)
    assert bench.target_line(int4) == "target llama-1b: int4wo / bf16 decode tok/s at batch 1 = 1.4 (>= 1.5) MISS"
    na = bench.evaluate_targets([_row("bf16", 1, 1200.0, shape="smollm2-135m")])
    assert [t["status"] for t in na] == ["n/a", "n/a", "PASS"]  # no batch-64 or int4wo row; >= 1 000 tok/s
    assert bench.target_line(na[0]).endswith("= - (>= 0.5) n/a")


def test_decode_row_counts_weights_once_and_kv_over_the_context():
    model = bench.build_model("tiny", "meta", torch.bfloat16, 64)
    run = {"step_s": 1e-3, "mean_context": 9.0}
    row = bench.decode_row(model, run, 4, bandwidth=1e9, nominal=2e9)
    weights, kv = bench.weight_bytes(model, 4), bench.kv_bytes_per_token(model, torch.bfloat16)
    assert kv == 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 KV heads, head_dim 16, bf16
    assert row["hbm_bytes"] == weights + 4 * 10 * kv
    assert row["hbm_fraction"] == pytest.approx(row["hbm_bytes"] / 1e-3 / 1e9)
    assert row["hbm_fraction_nominal"] == pytest.approx(row["hbm_fraction"] / 2)


def test_the_clock_skips_runs_past_its_budget_and_lists_them():
    result: dict = {}
    assert not bench.Clock(None).out("a run", result) and not bench.Clock(60).out("a run", result)
    assert bench.Clock(0).out("llama-1b int8wo batch 64", result)
    assert result["skipped"] == ["llama-1b int8wo batch 64"]


def test_dry_run_plans_without_a_device(capsys):
    result = bench.main(["--dry-run", "--shapes", "tiny,llama-1b"])
    weights = result["dry_run"]["shapes"]["llama-1b"]["weight_bytes"]
    assert result["ok"] and 0 <= weights - 2 * 1_235_814_400 < 1024  # Llama-3.2-1B's parameters; rotary buffers
    assert result["dry_run"]["runs"] == ["bf16 graphs=on batches [1, 64]", "int4wo graphs=on batches [1, 64]",
                                         "int8wo graphs=on batches [1, 64]"]
    assert "prefill: 512 tokens x 5 per variant" in capsys.readouterr().out
