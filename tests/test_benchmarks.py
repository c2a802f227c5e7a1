"""The HOL lab, the sweep and the KV-waste benchmark on the tiny model / the real block manager."""

from __future__ import annotations

import contextlib
import json

import pytest

from benchmarks.hol_lab import make_workload, run_hol_lab
from benchmarks.kv_waste import count_admitted, measure_allocation, realistic_lengths, run_kv_waste
from benchmarks.sweep import best_point, run_sweep
from quantgate.cli import main


@contextlib.contextmanager
def one_torch_thread():
    """The tiny model's steps are much faster single-threaded on a shared 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_workload_is_reproducible_and_shaped():
    w = make_workload(50, seed=4, rate=10.0)
    assert w == make_workload(50, seed=4, rate=10.0)
    assert sum(r.kind == "short" for r in w) == 40
    assert all(8 <= r.max_tokens <= 32 for r in w if r.kind == "short")
    assert all(256 <= r.max_tokens <= 512 for r in w if r.kind == "long")
    assert [r.arrival for r in w[:3]] == [0.0, 0.1, 0.2]
    same = make_workload(50, seed=4)  # the rate changes arrivals only
    assert [(r.kind, r.max_tokens, r.prompt) for r in same] == [(r.kind, r.max_tokens, r.prompt) for r in w]
    with pytest.raises(ValueError, match="short_tokens"):
        make_workload(5, short_tokens=(9, 3))
    with pytest.raises(ValueError, match="rate"):
        make_workload(5, rate=0)


def test_hol_lab_static_blocks_short_requests(tiny_model_dir, tmp_path):
    with one_torch_thread():
        report = run_hol_lab(str(tiny_model_dir), num_requests=10, max_num_seqs=3, rate=None, seed=1,
                             short_tokens=(2, 4), long_tokens=(24, 32), out_dir=tmp_path, progress=False)
    static, cont = report["schedulers"]["static"], report["schedulers"]["continuous"]
    for s in (static, cont):
        assert s["num_requests"] == 10 and s["num_short"] == 8 and s["num_preemptions"] == 0
        for key in ("completion_short_s", "completion_all_s", "ttft_s", "tpot_s"):
            assert set(s[key]) >= {"p50", "p95", "p99", "mean"} and s[key]["count"] > 0
        assert s["throughput_tokens_per_s"] > 0
    # every request got exactly its forced number of tokens under both schedulers
    workload = {r.request_id: r.max_tokens for r in make_workload(10, seed=1, short_tokens=(2, 4), long_tokens=(24, 32))}
    for name in ("static", "continuous", "dynamic"):
        assert {d["request_id"]: d["output_tokens"] for d in report["runs"][name]["requests"]} == workload
    assert report["schedulers"]["dynamic"]["padding_waste"] > 0  # batches of 3 mixed lengths pad
    # head-of-line blocking in engine steps (deterministic); the seconds, on a tiny model a few ms per
    # step, are the machine's noise (CI once measured static 0.144 s vs continuous 0.151 s), so only their
    # bookkeeping is checked here: speed lives in `quantgate bench hol`
    assert static["completion_short_steps"]["p99"] > 1.5 * cont["completion_short_steps"]["p99"]
    assert report["short_p99_speedup_steps"] > 1.5
    assert report["short_p99_speedup"] == pytest.approx(
        static["completion_short_s"]["p99"] / cont["completion_short_s"]["p99"])
    assert report["short_p99_continuous_over_static"] == pytest.approx(1 / report["short_p99_speedup"])
    # the Gantt data: slots within the batch size, never two requests in one slot at once
    for name in ("static", "continuous", "dynamic"):
        intervals = report["runs"][name]["intervals"]
        assert {iv["request_id"] for iv in intervals} == set(workload)
        assert all(0 <= iv["slot"] < 3 and iv["start"] < iv["end"] for iv in intervals)
        for slot in range(3):
            spans = sorted((iv["start"], iv["end"]) for iv in intervals if iv["slot"] == slot)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    # static never admits into a running batch: each of its slots is refilled only after all ended
    static_starts = sorted({iv["start"] for iv in report["runs"]["static"]["intervals"]})
    assert len(static_starts) == 4  # ceil(10 / 3) batches
    saved = json.loads((tmp_path / "hol_lab.json").read_text())
    assert saved["short_p99_speedup"] == report["short_p99_speedup"]
    for png in report["plots"].values():
        assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_kv_waste_exact_on_crafted_lengths(tmp_path):
    pairs = [(16, 0), (10, 7), (1, 0), (20, 12)]  # 16, 17, 1 and 32 tokens
    paged = measure_allocation(pairs, block_size=16)
    assert (paged.used_tokens, paged.reserved_tokens) == (66, 96)  # 1 + 2 + 1 + 2 blocks
    assert paged.waste == pytest.approx(30 / 96)
    contiguous = measure_allocation(pairs, block_size=64)
    assert contiguous.reserved_tokens == 256 and contiguous.waste == pytest.approx(190 / 256)
    # 256 slots: 4 contiguous reservations; paged blocks (cycling the list) 1,2,1,2,1,2,1,2,1,2,1 = 16
    assert count_admitted(pairs, 64, 256) == 4
    assert count_admitted(pairs, 16, 256) == 11
    report = run_kv_waste(pairs, max_len=64, block_size=16, memory_tokens=256, block_sizes=(1, 16),
                          out_dir=tmp_path)
    assert report["paged"]["waste"] == pytest.approx(30 / 96)
    assert report["contiguous"]["admitted_seqs"] == 4 and report["paged"]["admitted_seqs"] == 11
    assert report["waste_by_block_size"]["1"] == 0.0
    assert json.loads((tmp_path / "kv_waste.json").read_text())["used_tokens"] == 66
    with pytest.raises(ValueError, match="longer than max_len"):
        run_kv_waste([(60, 10)], max_len=64, out_dir=False)


def test_kv_waste_realistic_lengths_meet_the_target():
    pairs = realistic_lengths(200, max_len=2048, seed=0)
    assert all(p >= 1 and p + o <= 2048 for p, o in pairs)
    report = run_kv_waste(pairs, max_len=2048, block_sizes=(16,), out_dir=False)
    assert report["paged"]["waste"] <= 0.04 < report["contiguous"]["waste"]
    assert report["paged"]["admitted_seqs"] > 2 * report["contiguous"]["admitted_seqs"]


def test_best_point_respects_the_slo():
    pts = [{"max_num_seqs": 4, "throughput_tokens_per_s": 10.0, "tpot_p99_ms": 50.0},
           {"max_num_seqs": 16, "throughput_tokens_per_s": 30.0, "tpot_p99_ms": 120.0},
           {"max_num_seqs": 8, "throughput_tokens_per_s": 20.0, "tpot_p99_ms": 80.0}]
    assert best_point(pts)["max_num_seqs"] == 16
    assert best_point(pts, slo_tpot_ms=100)["max_num_seqs"] == 8
    assert best_point(pts, slo_tpot_ms=1) is None


def test_sweep_on_tiny_model(tiny_model_dir, tmp_path):
    with one_torch_thread():
        report = run_sweep(str(tiny_model_dir), batch_sizes=(1, 4), kv_blocks=(None, 4), num_requests=6,
                           short_tokens=(2, 3), long_tokens=(20, 24), out_dir=tmp_path, progress=False)
    points = report["points"]
    assert [(p["max_num_seqs"], p["kv_budget"]) for p in points] == [(1, "auto"), (4, "auto"), (1, 4), (4, 4)]
    assert all(p["throughput_tokens_per_s"] > 0 and p["tpot_p99_ms"] > 0 for p in points)
    assert points[0]["mean_batch_size"] == 1 and points[1]["mean_batch_size"] > 1
    assert points[3]["mean_batch_size"] < points[1]["mean_batch_size"]  # 4 KV blocks hold fewer sequences
    assert points[3]["num_kv_blocks"] == 4 and points[1]["num_kv_blocks"] > 4
    assert report["best"] in points
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_cli_kv_waste_and_bad_input(tmp_path, capsys):
    assert main(["bench", "kv-waste", "--num-seqs", "50", "--out-dir", str(tmp_path), "--no-plots"]) == 0
    assert json.loads((tmp_path / "kv_waste.json").read_text())["config"]["num_seqs"] == 50
    assert main(["bench", "kv-waste", "--num-seqs", "0", "--out-dir", str(tmp_path)]) == 2
    assert "num_seqs must be at least 1" in capsys.readouterr().err


def test_tenants_benchmark_on_tiny_model(tiny_model_dir, tmp_path):
    """The three runs, B's latencies counted, and in one FIFO B's requests wait for A's whole burst."""
    with one_torch_thread():
        assert main(["bench", "tenants", "--model", str(tiny_model_dir), "--device", "cpu", "--b-requests", "4",
                     "--a-requests", "4", "--a-prompt-tokens", "100-120", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "tenants.json").read_text())
    assert set(report["runs"]) == {"alone", "fair", "fifo"}
    assert all(run["b_latency_s"]["count"] == 4 for run in report["runs"].values())
    assert report["runs"]["alone"]["a_prompt_tokens_done"] == 0
    assert 400 <= report["runs"]["fifo"]["a_prompt_tokens_done"] <= 480  # all of A's prompts, before B's
    assert report["p99_ratio_fifo_vs_alone"] is not None and (tmp_path / "tenants.png").is_file()


def test_script_benchmarks_take_their_own_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "throughput", "--help"])
    assert exit_info.value.code == 0 and "--num-requests" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "tenants", "--no-such-option"])


def test_variants_benchmark_times_interleaved_rounds_on_tiny_model(tiny_model_dir, tmp_path):
    import benchmarks.variants as bench

    report = bench.main(["--model", str(tiny_model_dir), "--variants", "baseline,int8wo,int4wo", "--batches", "1,3",
                         "--decode-tokens", "4", "--prompt-len", "16", "--repeats", "2", "--dtype", "float32",
                         "--out-dir", str(tmp_path)])
    names = [r["variant"] for r in report["results"]]
    assert names == ["baseline", "int8wo", "int4wo"]
    for r in report["results"]:
        assert r["prefill_tokens_per_s"] > 0 and set(r["decode_tokens_per_s"]) == {1, 3}
        assert all(v > 0 for v in r["decode_tokens_per_s"].values())
    ratios = report["ratios_to_baseline"]
    assert ratios["int4wo"]["weight_bytes"] < ratios["int8wo"]["weight_bytes"] < 0.6
    assert report["results"][1]["top1_agreement"] > 0.5
    paired = report["paired_ratios"]  # 2 rounds: each column's paired ratio with its interval
    assert set(paired) == {"int8wo", "int4wo"}
    for columns in paired.values():
        assert set(columns) == {"prefill", "decode_b1", "decode_b3"}
        assert all(c["rounds"] == 2 and c["low"] <= c["ratio"] <= c["high"] for c in columns.values())
    shares = report["b1_bandwidth_share"]
    assert set(shares) == set(names) and all(v > 0 for v in shares.values())
    assert (tmp_path / "variants.json").is_file() and (tmp_path / "variants.png").is_file()


def test_variants_on_the_avx2_path_times_torch_on_avx2_too(tiny_model_dir, tmp_path):
    """An AVX2-only CPU runs the baseline's GEMMs in AVX2: on a CPU with more, the benchmark re-runs itself
    with torch forced there (on an AVX2-only CPU it already is)."""
    from benchmarks import variants
    from serving.kernels.cpu import isa

    if "avx2" not in isa.cpu_flags():
        pytest.skip("not an x86 CPU with AVX2")
    report = variants.main(["--model", str(tiny_model_dir), "--variants", "baseline,int8wo", "--batches", "1",
                            "--decode-tokens", "2", "--prompt-len", "8", "--repeats", "1", "--isa", "avx2",
                            "--out-dir", str(tmp_path)])
    assert report["torch_isa"] == "AVX2" and report["args"]["isa"] == "avx2"
    assert [r["variant"] for r in report["results"]] == ["baseline", "int8wo"]
