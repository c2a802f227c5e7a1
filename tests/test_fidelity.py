"""Fidelity gates: KL and top-1 flips of a variant against the baseline, teacher-forced through the engine
on the held text, judged on the CI's high end; a variant with perturbed weights is refused, an identical
one passes, also end to end through MLflow."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from evals import fidelity as F
from flows import fidelity_stage
from gates.judging import fidelity_gates as G
from gates.judging.policy import PolicyError, parse_policy

PLAN = F.FidelityPlan(chunks=6, chunk_tokens=48)
POLICY = {"tasks": {"max_drop": 0.1}, "fidelity": {"max_kl": 0.05, "max_flip_rate": 0.2}}


def _engine(path: Path):
    from serving import LLMEngine

    return LLMEngine.from_pretrained(str(path), device="cpu", num_kv_blocks=64)


def _variant_of(tiny_model_dir: Path, out: Path, noise: float) -> Path:
    """The tiny model with its final norm scaled up (peaked next-token distributions, as a trained model
    has: a random one's are nearly flat over the vocabulary) and `noise` x each matrix's spread added."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.model.norm.weight.mul_(40.0)
        for name, p in model.named_parameters():
            if noise and p.dim() == 2 and "embed" not in name:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * noise)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def records(tiny_model_dir: Path, tmp_path_factory) -> dict[str, dict]:
    base_dir = _variant_of(tiny_model_dir, tmp_path_factory.mktemp("sharp"), 0.0)
    perturbed_dir = _variant_of(tiny_model_dir, tmp_path_factory.mktemp("perturbed"), 0.5)
    return {"baseline": F.teacher_force(_engine(base_dir), PLAN), "same": F.teacher_force(_engine(base_dir), PLAN),
            "perturbed": F.teacher_force(_engine(perturbed_dir), PLAN)}


def _fidelity_verdicts(metrics: dict[str, float]) -> dict[str, str]:
    from gates.judging.judge import judge

    return {r.name: r.verdict for r in judge(parse_policy(POLICY), metrics, {}) if r.name.startswith("fidelity/")}


def test_held_text_is_fixed_prose_and_chunks_are_disjoint(records) -> None:
    text = F.held_text()
    assert len(text) > 100_000 and "::=" not in text and ">>>" not in text
    tokens = records["baseline"]["tokens"]
    assert len(tokens) == PLAN.chunks and all(len(c) == PLAN.chunk_tokens for c in tokens)
    assert records["baseline"]["text_sha256"] == F.text_sha256()
    assert len(records["baseline"]["top"][0]) == PLAN.chunk_tokens - 1  # every position but the first scored


def test_identical_variant_has_zero_divergence_and_passes(records) -> None:
    r = F.compare(records["baseline"], records["same"])
    assert r.kl == pytest.approx(0.0, abs=1e-6) and r.kl_ci_high == pytest.approx(0.0, abs=1e-6)
    assert r.flip_rate == 0.0 and r.flip_ci_high == 0.0 and r.flips == []
    assert r.positions == PLAN.chunks * (PLAN.chunk_tokens - 1)
    verdicts = _fidelity_verdicts(fidelity_stage.fidelity_metrics(r))
    assert verdicts == {"fidelity/kl/max": "pass", "fidelity/flip_rate/max": "pass"}


def test_perturbed_variant_is_refused_on_kl_and_flips(records) -> None:
    r = F.compare(records["baseline"], records["perturbed"])
    assert r.kl_ci_low <= r.kl <= r.kl_ci_high and r.flip_ci_low <= r.flip_rate <= r.flip_ci_high
    assert r.kl > 0.05 and r.flip_rate > 0.2, r
    assert r.flips and r.flips[0]["baseline"] != r.flips[0]["variant"]
    verdicts = _fidelity_verdicts(fidelity_stage.fidelity_metrics(r))
    assert verdicts == {"fidelity/kl/max": "fail", "fidelity/flip_rate/max": "fail"}


def test_position_kl_is_exact_on_the_shared_partition() -> None:
    p = [0.5, 0.3, 0.2]
    q = [0.2, 0.3, 0.5]
    base = [[1, 2], [math.log(p[0]), math.log(p[1])]]  # token 3 outside both top-2: the "rest"
    var = [[3, 2, 1], [math.log(q[2]), math.log(q[1]), math.log(q[0])]]
    kl, tail = F.position_kl(base, var)
    assert kl == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q, strict=True)))
    assert tail == pytest.approx(0.2)


def test_ci_high_decides_not_the_point() -> None:
    """A point estimate under the threshold with a CI above it fails (non-inferiority)."""
    metrics = {G.FIDELITY_KL: 0.04, G.ci_key(G.FIDELITY_KL, "high"): 0.07,
               G.FIDELITY_FLIP_RATE: 0.1, G.ci_key(G.FIDELITY_FLIP_RATE, "high"): 0.15}
    assert _fidelity_verdicts(metrics) == {"fidelity/kl/max": "fail", "fidelity/flip_rate/max": "pass"}
    missing = _fidelity_verdicts({})
    assert missing == {"fidelity/kl/max": "fail", "fidelity/flip_rate/max": "fail"}  # not measured fails


def test_different_text_is_refused(records) -> None:
    other = {**records["same"], "text_sha256": "0" * 64}
    with pytest.raises(ValueError, match="different text"):
        F.compare(records["baseline"], other)


def test_policy_sections_are_strict() -> None:
    p = parse_policy(POLICY)
    assert p.fidelity.max_kl == 0.05 and p.fidelity.enabled and not p.long_context.enabled
    for bad, match in (({"max_kl": -1}, "fidelity.max_kl"), ({"max_flip_rate": 2}, "fidelity.max_flip_rate"),
                       ({"chunks": 1}, "fidelity.chunks"), ({"kl": 0.1}, "unknown key 'fidelity.kl'")):
        with pytest.raises(PolicyError, match=match):
            parse_policy({"tasks": {"max_drop": 0.1}, "fidelity": bad})
    with pytest.raises(ValueError, match="chunk_tokens"):
        F.FidelityPlan(chunks=4, chunk_tokens=1)


def test_gate_verdicts_are_recorded_in_mlflow(store, records, tmp_path) -> None:
    """Baseline and variant measure dirs -> compare -> MLflow run -> evaluate_run: the refusal is recorded."""
    from gates.records.evaluation import evaluate_run
    from gates.records.tracking import get_client, log_variant, start_release

    dirs = {}
    for name in ("baseline", "perturbed"):
        dirs[name] = tmp_path / name
        F.save(records[name], dirs[name] / fidelity_stage.FIDELITY_FILE)
    metrics, paths = fidelity_stage.compare(dirs["baseline"], dirs["perturbed"], tmp_path / "cmp")
    assert paths and paths[0].name == fidelity_stage.REPORT_FILE
    release = start_release("tiny", "sha256:beef", {})
    log_variant(release, "baseline", params={}, metrics={})
    run = log_variant(release, "perturbed", params={}, metrics=metrics, artifacts=paths)
    policy = parse_policy(POLICY)
    evaluation = evaluate_run(run, policy)
    by_name = {r.name: r for r in evaluation.results}
    assert not by_name["fidelity/kl/max"].passed and not by_name["fidelity/flip_rate/max"].passed
    tags = get_client().get_run(run).data.tags
    assert tags["gate/fidelity/kl/max/verdict"] == "fail"
    assert float(tags["gate/fidelity/kl/max/observed"]) == pytest.approx(metrics["fidelity/kl_ci_high"])
