"""The eval pipeline through the real engine: EngineLM scoring against a direct forward pass, run_suite
outputs, the CLI verbs, bad input. Tiny random model and --limit everywhere; one small real-model run."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from evals.lm import EngineLM
from evals.results import EvalResult
from evals.run import run_suite
from evals.tasks import TASKS, TaskDataError
from quantgate.cli import main as quantgate_main


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir: Path) -> EngineLM:
    from serving import LLMEngine

    engine = LLMEngine.from_pretrained(str(tiny_model_dir), device="cpu", num_kv_blocks=256)
    return EngineLM(engine, model_name="tiny", show_progress=False)


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _logprob_sum(model, tokens: list[int], start: int) -> float:
    with torch.no_grad():
        logp = model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
    return float(sum(logp[i - 1, tokens[i]] for i in range(start, len(tokens))))


def _instances(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(kind, doc={}, arguments=a, idx=0) for a in args]


def test_loglikelihood_matches_a_direct_forward_pass(tiny_lm: EngineLM, hf_tiny) -> None:
    pairs = [("Question: What is 2 + 2?\nAnswer:", " 4"), ("The opposite of hot is", " cold"),
             ("The opposite of hot is ", "cold"), ("", "Hello world")]
    results = tiny_lm.loglikelihood(_instances("loglikelihood", pairs))
    tok = tiny_lm.tokenizer
    for (ctx, cont), (ll, greedy) in zip(pairs, results, strict=True):
        if ctx:
            ctx_s = ctx.rstrip()
            whole = tok(ctx_s + ctx[len(ctx_s):] + cont, add_special_tokens=False).input_ids
            start = len(tok(ctx_s, add_special_tokens=False).input_ids)
        else:
            whole = [tiny_lm.prefix_token_id] + tok(cont, add_special_tokens=False).input_ids
            start = 1
        assert ll == pytest.approx(_logprob_sum(hf_tiny, whole, start), abs=2e-3)
        assert isinstance(greedy, bool)


def test_rolling_loglikelihood_covers_every_token_once(tiny_lm: EngineLM, hf_tiny) -> None:
    text = "The market in Saltby opens at seven o'clock, and by noon most of the pears are gone. " * 3
    tokens = [tiny_lm.prefix_token_id] + tiny_lm.tok_encode(text)
    (full,) = tiny_lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]))
    assert full == pytest.approx(_logprob_sum(hf_tiny, tokens, 1), abs=5e-3)  # one window
    small = EngineLM(tiny_lm.engine, max_length=16, show_progress=False)
    (windowed,) = small.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]))
    assert windowed != pytest.approx(full, abs=1e-3)  # shorter contexts score differently...
    assert math.isfinite(windowed) and windowed < 0  # ...but every token is still scored once


def test_generate_until_applies_stop_strings(tiny_lm: EngineLM, hf_tiny) -> None:
    prompt = "Question: What is the capital of France?\nAnswer:"
    (free,) = tiny_lm.generate_until(_instances("generate_until", [(prompt, {"until": [], "max_gen_toks": 12})]))
    ids = tiny_lm.tok_encode(prompt)
    with torch.no_grad():
        out = hf_tiny.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert free == tiny_lm.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    stop = free[len(free) // 2: len(free) // 2 + 3]
    assert stop.strip()
    (cut,) = tiny_lm.generate_until(_instances("generate_until", [(prompt, {"until": [stop], "max_gen_toks": 12})]))
    assert cut == free[: free.find(stop)]


def test_run_suite_writes_complete_results(tiny_lm: EngineLM, tmp_path: Path) -> None:
    out = tmp_path / "tiny-eval"
    result = run_suite(tiny_lm, ["quantgate"], limit=3, out_dir=out)
    own = {name: spec for name, spec in TASKS.items() if spec.own}
    assert list(result.tasks) == list(own)
    assert sorted(p.name for p in out.iterdir()) == ["lm_eval_results.json", "results.md", "samples", "summary.json"]
    lm_eval_out = json.loads((out / "lm_eval_results.json").read_text())
    assert set(lm_eval_out["results"]) == set(own)
    assert lm_eval_out["n-shot"] == {name: spec.num_fewshot for name, spec in own.items()}
    assert lm_eval_out["n-shot"]["arith"] == 5  # few-shot counts are fixed and recorded
    loaded = EvalResult.load(out)
    for name, task in loaded.tasks.items():
        assert task.n == 3 and [s.doc_id for s in task.samples] == [0, 1, 2]
        assert task.score == pytest.approx(result.tasks[name].score)
        assert f"| {name} |" in (out / "results.md").read_text()
    facts = loaded.tasks["facts_mc"]
    assert all(len(s.extra["lls"]) == 4 and s.response and s.target for s in facts.samples)
    assert facts.score == pytest.approx(lm_eval_out["results"]["facts_mc"]["acc,none"])
    ppl = loaded.tasks["perplexity"]
    assert ppl.score == pytest.approx(lm_eval_out["results"]["perplexity"]["bits_per_byte,none"])
    assert ppl.score > 2.0  # a random model is near the uniform-vocabulary chance level
    over = loaded.tasks["over_refusal"]
    assert all(s.correct == (s.score == 0.0) for s in over.samples)
    assert "refusal_pattern" in over.samples[0].extra
    assert not list(tmp_path.glob(".*partial*"))


def test_bad_inputs_leave_nothing_behind(tiny_lm: EngineLM, tmp_path: Path) -> None:
    out = tmp_path / "never"
    with pytest.raises(ValueError, match="unknown task or suite 'facts'"):
        run_suite(tiny_lm, ["facts"], limit=2, out_dir=out)
    data = tmp_path / "data"
    shutil.copytree(Path(TASKS["arith"].data_file()).parent, data)
    lines = (data / "arith.jsonl").read_text().splitlines()
    lines[6] = lines[6][:-5]
    (data / "arith.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(TaskDataError, match=r"arith\.jsonl:7: malformed JSON"):
        run_suite(tiny_lm, ["arith"], limit=2, out_dir=out, data_dir=data)
    (data / "cloze.jsonl").write_text("")
    with pytest.raises(TaskDataError, match="task 'cloze' has no items"):
        run_suite(tiny_lm, ["cloze"], limit=2, out_dir=out, data_dir=data)
    with pytest.raises(ValueError, match="--limit must be a positive"):
        run_suite(tiny_lm, ["refusal"], limit=0, out_dir=out)
    assert not out.exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and holds no earlier eval result"):
        run_suite(tiny_lm, ["refusal"], limit=1, out_dir=foreign)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_cli_eval_and_compare(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        rc = quantgate_main(["eval", "--model", str(tiny_model_dir), "--suite", "arith,refusal", "--limit", "2",
                             "--out", str(out)])
        assert rc == 0
    assert set(EvalResult.load(a).tasks) == {"arith", "refusal"}
    rc = quantgate_main(["compare", str(a), str(b), "--out", str(tmp_path / "cmp")])
    assert rc == 0
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert {r["task"] for r in report["rows"]} == {"arith", "refusal"}
    assert all(r["delta"] == 0.0 for r in report["rows"])  # greedy decoding is deterministic
    assert (tmp_path / "cmp" / "scores.png").is_file() and (tmp_path / "cmp" / "flips.png").is_file()
    capsys.readouterr()
    assert quantgate_main(["eval", "--model", str(tiny_model_dir), "--suite", "arith,nope", "--out",
                           str(tmp_path / "c")]) == 2
    assert "unknown task or suite 'nope'" in capsys.readouterr().err
    assert quantgate_main(["eval", "--model", str(tiny_model_dir), "--suite", "arith", "--threads", "0", "--out",
                           str(tmp_path / "c")]) == 2
    assert "--threads must be at least 1" in capsys.readouterr().err
    assert quantgate_main(["compare", str(a), str(tmp_path / "missing"), "--out", str(tmp_path / "d")]) == 2
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


@pytest.mark.slow
def test_default_model_scores_above_chance(default_model_dir: Path, tmp_path: Path) -> None:
    result = run_suite(str(default_model_dir), ["facts_mc", "arith", "perplexity"], limit=16, out_dir=tmp_path / "r")
    assert result.tasks["facts_mc"].score >= 0.6  # chance 0.25
    assert result.tasks["arith"].score >= 0.3  # chance ~0
    assert result.tasks["perplexity"].score < 2.0  # chance ~3.9 bits per byte
