"""Long-context gates: a KV variant that loses retrieval at 4k is refused at 4k and passes at 512; a
baseline that cannot retrieve makes its gate `uninformative`; the deployment's system prompt reaches the
safety prompts (and only those).

The retrieval model is a stand-in engine (the `LLMEngine` calls EngineLM drives): it "attends" to its
cached prompt tokens and answers with the pass key it reads there, so the baseline retrieves exactly.
Its KV-quantized twin corrupts each cached token with a probability that grows with the context length
(none up to 2k tokens, every token from 4k on): what a KV format whose error builds up over many cached
keys does to retrieval. A tiny random model through the real engine checks the probes' plumbing.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from evals import long_context as L
from flows import fidelity_stage
from gates.judging.policy import parse_policy

POLICY = {"tasks": {"max_drop": 0.1}, "long_context": {"max_drop": 0.2}}
PLAN = L.ProbePlan(lengths=(512, 4096), probes_per_length=6)


@dataclass
class _Out:
    request_id: str
    text: str
    finished: bool = True


@dataclass
class StandInEngine:
    """Answers every request at once: the pass key found in its (possibly corrupted) cached tokens."""

    tokenizer: object
    corrupt_from: int | None = None  # context length where corruption starts; all tokens corrupt at 2x
    max_model_len: int = 8192
    prompts: list[list[int]] = field(default_factory=list)
    _pending: list[tuple[str, list[int]]] = field(default_factory=list)

    def add_request(self, prompt: list[int], params: object) -> str:
        self.prompts.append(list(prompt))
        rid = str(len(self.prompts))
        self._pending.append((rid, list(prompt)))
        return rid

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    def abort(self, request_id: str) -> None:
        self._pending = [p for p in self._pending if p[0] != request_id]

    def step(self) -> list[_Out]:
        done, self._pending = self._pending, []
        return [_Out(rid, self._answer(tokens)) for rid, tokens in done]

    def _answer(self, tokens: list[int]) -> str:
        cached = self._cache(tokens)
        found = re.findall(r"pass key is (\d+)", self.tokenizer.decode(cached))
        return f" {found[0]}." if found else " I cannot help with that."

    def _cache(self, tokens: list[int]) -> list[int]:
        if self.corrupt_from is None:
            return tokens
        n = len(tokens)
        p = min(max((n - self.corrupt_from) / self.corrupt_from, 0.0), 1.0)
        rng = random.Random(n)
        noise = self.tokenizer.convert_tokens_to_ids("x")
        return [noise if rng.random() < p else t for t in tokens]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _verdicts(base: StandInEngine, variant: StandInEngine, policy: dict = POLICY) -> dict[str, object]:
    from gates.judging.judge import judge

    rows = L.compare(L.run_probes(base, PLAN), L.run_probes(variant, PLAN))
    metrics: dict[str, float] = {}
    for row in rows.values():
        metrics |= fidelity_stage.long_context_metrics(row)
    return {r.name: r for r in judge(parse_policy(policy), metrics, {}) if r.name.startswith("long_context/")}


def test_probe_has_exact_length_and_hides_the_key_at_its_depth(tokenizer) -> None:
    for depth in (0.0, 0.5, 1.0):
        probe = L.build_probe(tokenizer, 1024, depth, "48213", max_new_tokens=8)
        assert len(probe.tokens) == 1024 - 8 and probe.tokens[0] == tokenizer.bos_token_id
        text = tokenizer.decode(probe.tokens[1:])
        assert text.count("48213") == 2 and text.endswith(L.QUESTION)
        at = text.index("The pass key is") / len(text)
        assert abs(at - depth) < 0.12, (depth, at)
    probes = L.build_probes(tokenizer, PLAN)
    assert [p.length for p in probes] == [512] * 6 + [4096] * 6
    assert len({p.key for p in probes}) == len(probes)
    assert L.answer_correct(" 48213. Remember", "48213") and not L.answer_correct(" 4821", "48213")


def test_kv_variant_losing_retrieval_at_4k_is_refused_at_4k_and_passes_at_512(tokenizer) -> None:
    verdicts = _verdicts(StandInEngine(tokenizer), StandInEngine(tokenizer, corrupt_from=2048))
    assert set(verdicts) == {"long_context/512/max_drop", "long_context/4096/max_drop"}
    short, long = verdicts["long_context/512/max_drop"], verdicts["long_context/4096/max_drop"]
    assert short.verdict == "pass" and short.observed == 0.0
    assert long.verdict == "fail" and long.observed == -1.0 and "baseline 1, variant 0" in long.reason


def test_identical_variant_passes_every_length(tokenizer) -> None:
    verdicts = _verdicts(StandInEngine(tokenizer), StandInEngine(tokenizer))
    assert {r.verdict for r in verdicts.values()} == {"pass"}


def test_baseline_that_cannot_retrieve_makes_the_gate_uninformative(tokenizer) -> None:
    broken = StandInEngine(tokenizer, corrupt_from=2048)
    verdicts = _verdicts(broken, StandInEngine(tokenizer, corrupt_from=2048))
    long = verdicts["long_context/4096/max_drop"]
    assert long.verdict == "uninformative" and long.passed  # sensitivity.tasks defaults to report
    assert "baseline retrieves 0%" in long.reason
    blocking = {**POLICY, "sensitivity": {"tasks": "block"}}
    assert not _verdicts(broken, StandInEngine(tokenizer, corrupt_from=2048), blocking)[
        "long_context/4096/max_drop"].passed
    assert verdicts["long_context/512/max_drop"].verdict == "pass"


def test_probes_run_through_the_engine_capped_to_its_context(tiny_model_dir: Path) -> None:
    from serving import LLMEngine

    engine = LLMEngine.from_pretrained(str(tiny_model_dir), device="cpu", num_kv_blocks=128)
    assert engine.max_model_len == 1024
    answers = L.run_probes(engine, L.ProbePlan(lengths=(512, 2048), probes_per_length=2))
    assert [a.length for a in answers] == [512, 512]  # 2048 does not fit the tiny model's context
    assert all(isinstance(a.answer, str) and a.answer for a in answers)
    with pytest.raises(ValueError, match="no probe length"):
        L.ProbePlan(lengths=(2048,)).capped(1024)


def test_policy_picks_the_probed_variants() -> None:
    kv = fidelity_stage.config_fields(parse_policy(POLICY), ["int8wo", "int4wo+kv8"])
    assert kv["probe_models"] == ("baseline", "int4wo-kv8") and kv["probe_lengths"] == (512, 1024, 2048, 4096, 8192)
    every = parse_policy({**POLICY, "long_context": {"max_drop": 0.2, "variants": "all", "lengths": [512]}})
    assert fidelity_stage.config_fields(every, ["int8wo"])["probe_models"] == ("baseline", "int8wo")
    off = fidelity_stage.config_fields(parse_policy({"tasks": {"max_drop": 0.1}}), ["int4wo+kv8"])
    assert off["probe_models"] == () and off["fidelity_chunks"] == 0 and off["system_prompt"] is None


def test_system_prompt_reaches_the_safety_prompts_only(tokenizer, tmp_path) -> None:
    from evals.run import run_suite

    engine = StandInEngine(tokenizer)
    secret = "You are DEPLOYED-ASSISTANT-7; refuse harmful requests."
    result = run_suite(engine, ["refusal", "arith"], limit=2, system_prompt=secret)
    texts = [tokenizer.decode(p) for p in engine.prompts]
    safety = [t for t in texts if "<|im_start|>user" in t]
    assert len(safety) == 2 and all(f"<|im_start|>system\n{secret}" in t for t in safety)
    assert all(secret not in t for t in texts if t not in safety) and len(texts) == 4
    assert result.meta["deployment"]["system_prompt"] == secret
    assert result.tasks["refusal"].score == 1.0  # the stand-in declines everything
    engine = StandInEngine(tokenizer)
    run_suite(engine, ["refusal"], limit=1)
    assert secret not in tokenizer.decode(engine.prompts[0])
    with pytest.raises(ValueError, match="system_prompt"):
        run_suite(engine, ["refusal"], limit=1, system_prompt="  ")
