"""`quantgate bench tenant-leak`: the attacker's statistics on known data, and one small run of each scope."""

from __future__ import annotations

import json

import pytest
from server_fixtures import one_torch_thread

from benchmarks.tenant_leak import LeakWorkload, best_threshold, leak_figures, leave_one_pair_out, run, wilson


def test_best_threshold_separates_or_reports_the_majority():
    acc, t, below = best_threshold([(0.1, True), (0.2, True), (0.9, False), (1.0, False)])
    assert (acc, below) == (1.0, True) and t == pytest.approx(0.55)
    acc, t, below = best_threshold([(0.1, False), (0.9, True), (1.0, True)])  # True above the cut
    assert (acc, t, below) == (1.0, 0.5, False)
    assert best_threshold([(0.5, True), (0.5, False)])[0] == 0.5  # a tie can't be split


def test_leave_one_pair_out_and_wilson():
    separable = [(0.01 * i, 1.0 + 0.01 * i) for i in range(10)]
    assert leave_one_pair_out(separable) == 20
    assert leak_figures(separable)["paired_accuracy"] == 1.0
    lo, hi = wilson(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    assert wilson(64, 64)[1] == 1.0 and wilson(64, 64)[0] == pytest.approx(0.9434, abs=1e-4)


def test_a_small_run_shows_the_leak_only_in_global_scope(tiny_model_dir, tmp_path):
    work = LeakWorkload(pairs=4, prompt_tokens=160, seed=1)
    with one_torch_thread():
        report = run(str(tiny_model_dir), device="cpu", work=work, out_dir=tmp_path, plots=False)
    shared, isolated = report["runs"]["global"], report["runs"]["tenant"]
    assert shared["b_ttft_p_s"]["count"] == isolated["b_ttft_q_s"]["count"] == 4
    assert shared["b_probe_cached_tokens"] == 4 * 144  # nine full blocks of each P_i came from A's cache
    assert isolated["b_probe_cached_tokens"] == 0
    for r in (shared, isolated):  # isolation keeps each tenant's own reuse
        assert r["b_own_cached_tokens"] == [144] * 4 and r["a_again_cached_tokens"] == 144
    assert report["hash_cost"]["sha256_chain_us"] > 0
    saved = json.loads((tmp_path / "tenant_leak.json").read_text())
    assert saved["runs"]["tenant"]["answers"] == 8


def test_bench_verb_refuses_an_unknown_scope(capsys):
    from quantgate.cli import main

    assert main(["bench", "tenant-leak", "--scopes", "global,shared"]) == 2
    assert "--scopes takes global and/or tenant" in capsys.readouterr().err
