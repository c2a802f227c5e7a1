"""Run quantgate's task suites through lm-eval and write results, per-sample logs and a Markdown table."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

from evals.refusal import detect_refusal
from evals.results import SUMMARY, EvalResult, SampleResult, TaskResult, aggregate
from evals.tasks import TaskSpec, lm_eval_config, resolve_tasks, validate_task_data
from quantgate.env import apply_defaults


def make_lm(model: Any) -> tuple[Any, str, str]:
    """A model reference, an LLMEngine, or a ready lm-eval LM → (lm, model name, backend)."""
    from lm_eval.api.model import LM

    from evals.lm import EngineLM

    if isinstance(model, EngineLM):
        return model, model.model_name, "engine"
    if isinstance(model, LM):
        name = getattr(model, "model", None) or getattr(model, "pretrained", None) or type(model).__name__
        return model, str(name), type(model).__name__
    if isinstance(model, str | Path):
        from quantgate.models import resolve_model

        resolve_model(model)  # clear ModelReferenceError before the engine is built
        return EngineLM.from_model(str(model)), str(model), "engine"
    if hasattr(model, "add_request") and hasattr(model, "tokenizer"):
        return EngineLM(model, model_name=str(getattr(model, "model_name", "engine"))), "engine", "engine"
    raise TypeError(f"cannot evaluate a {type(model).__name__}: pass a model reference, an LLMEngine or an lm-eval LM")


def _prepare_out_dir(out_dir: Path) -> Path:
    """Refuse to overwrite anything that is not an earlier eval result; returns the staging dir."""
    out_dir = Path(out_dir).resolve()
    if out_dir.exists():
        if not out_dir.is_dir():
            raise ValueError(f"--out {out_dir} exists and is not a directory")
        if any(out_dir.iterdir()) and not (out_dir / SUMMARY).is_file():
            raise ValueError(f"--out {out_dir} is not empty and holds no earlier eval result; choose another")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    return staging


def _lm_eval_samples(spec: TaskSpec, samples: list[dict]) -> list[SampleResult]:
    """Per-item rows of a task run with lm-eval's own config: its per-sample metric is the score."""
    out = []
    picked = [s for s in samples if s.get("filter", "none") == spec.lm_eval_filter]
    for s in sorted(picked, key=lambda x: x["doc_id"]):
        score = float(s[spec.metric])
        extra: dict = {}
        if spec.output_type == "multiple_choice":
            lls = [float(r[0]) for r in s["filtered_resps"]]
            pred = max(range(len(lls)), key=lls.__getitem__)
            response = str(s["arguments"][pred][1]).strip() if "arguments" in s else str(pred)
            extra = {"lls": lls, "pred": pred, **({"acc_norm": float(s["acc_norm"])} if "acc_norm" in s else {})}
        elif spec.output_type == "loglikelihood":
            ll, greedy = s["filtered_resps"][0]
            response, extra = ("(greedy)" if greedy else "(not greedy)"), {"ll": float(ll)}
        else:
            response = str(s["filtered_resps"][0])
            extra = {"raw": str(s["resps"][0][0])[:2000]}
        out.append(SampleResult(s["doc_id"], str(s["doc"].get("id", s["doc_id"])), target=str(s["target"]),
                                response=response, score=score, correct=spec.desired(score), extra=extra))
    return out


def _sample_results(spec: TaskSpec, samples: list[dict]) -> list[SampleResult]:
    if spec.lm_eval is not None:
        return _lm_eval_samples(spec, samples)
    out = []
    for s in sorted(samples, key=lambda x: x["doc_id"]):
        doc = s["doc"]
        item_id = str(doc.get("id", s["doc_id"]))
        if spec.output_type == "multiple_choice":
            lls = [float(r[0]) for r in s["filtered_resps"]]
            choices = list(doc[spec.doc_to_choice])
            pred = max(range(len(lls)), key=lls.__getitem__)
            score = float(s["acc"])
            out.append(SampleResult(s["doc_id"], item_id, target=str(choices[int(doc["answer"])]),
                                    response=str(choices[pred]), score=score, correct=bool(score),
                                    extra={"acc_norm": float(s["acc_norm"]), "lls": lls}))
        elif spec.output_type == "loglikelihood_rolling":
            ll, n_bytes = s["bits_per_byte"]
            out.append(SampleResult(s["doc_id"], item_id, target="", response="", score=float(ll),
                                    correct=None, weight=float(n_bytes),
                                    extra={"bits_per_byte": -float(ll) / float(n_bytes) / math.log(2)}))
        else:
            response = s["filtered_resps"][0]
            score = float(s[spec.metric])
            extra = {m: float(s[m]) for m in spec.extra_metrics}
            if spec.suite == "safety":
                extra["refusal_pattern"] = detect_refusal(response).pattern
            if "check" in doc:
                extra["check"] = {k: v for k, v in doc["check"].items() if v is not None}
            out.append(SampleResult(s["doc_id"], item_id, target=str(s["target"]), response=response,
                                    score=score, correct=spec.desired(score), extra=extra))
    return out


def _task_result(spec: TaskSpec, lm_results: dict, samples: list[dict]) -> TaskResult:
    rows = _sample_results(spec, samples)
    if not rows:
        raise ValueError(f"task {spec.name!r} produced no samples (empty task or limit=0)")
    score = aggregate(spec.metric, [r.score for r in rows], [r.weight for r in rows])
    reported = lm_results.get(f"{spec.metric},{spec.lm_eval_filter}")
    if reported is not None and not math.isclose(score, float(reported), rel_tol=1e-6, abs_tol=1e-9):
        raise RuntimeError(f"{spec.name}: per-sample {spec.metric}={score} disagrees with lm-eval's {reported}")
    suffix = f",{spec.lm_eval_filter}"
    others = {k.split(",")[0]: float(v) for k, v in lm_results.items()
              if k.endswith(suffix) and "stderr" not in k and not k.startswith(spec.metric + ",")
              and isinstance(v, int | float)}
    return TaskResult(task=spec.name, suite=spec.suite, metric=spec.metric, score=score, n=len(rows),
                      higher_is_better=spec.higher_is_better, binary=spec.binary, chance=spec.chance,
                      chat=spec.chat, num_fewshot=spec.num_fewshot, other_metrics=others, samples=rows)


def markdown_table(result: EvalResult) -> str:
    lines = [f"# Eval: {result.model}", "",
             f"backend `{result.backend}`, limit {result.limit if result.limit is not None else 'none'}, "
             f"created {result.created}", "",
             "| task | suite | metric | score | n | chance | few-shot | chat |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for t in result.tasks.values():
        arrow = "↑" if t.higher_is_better else "↓"
        lines.append(f"| {t.task} | {t.suite} | {t.metric} {arrow} | {t.score:.4f} | {t.n} | {t.chance:g} | "
                     f"{t.num_fewshot} | {'yes' if t.chat else 'no'} |")
    return "\n".join(lines) + "\n"


def run_suite(model: Any, suites: list[str] | str = ("accuracy", "safety"), limit: int | None = None,
              out_dir: Path | str | None = None, data_dir: Path | None = None,
              docs: range | None = None, system_prompt: str | None = None,
              chat_template: bool | None = None) -> EvalResult:
    """Evaluate `model` (reference, LLMEngine or lm-eval LM) on suites and/or task names; `docs` instead
    of `limit` picks the same items of every task by index (a shard of a long run). `system_prompt` and
    `chat_template` (None: each task's own) are the deployment's: they apply to the safety suite's tasks.

    Writes to out_dir (if given) only when every task finished: files are staged in a hidden sibling
    directory and moved into place at the end, summary.json last.
    """
    apply_defaults()
    specs = resolve_tasks(list(suites) if not isinstance(suites, str) else suites)
    if limit is not None and int(limit) < 1:
        raise ValueError(f"--limit must be a positive number of items, got {limit}")
    if docs is not None and (limit is not None or len(docs) == 0):
        raise ValueError("docs takes a non-empty range of item indices, and no limit beside it")
    if system_prompt is not None and (not isinstance(system_prompt, str) or not system_prompt.strip()):
        raise ValueError(f"system_prompt must be a non-empty string or None, got {system_prompt!r}")
    for spec in specs:
        validate_task_data(spec, data_dir)
    staging = _prepare_out_dir(Path(out_dir)) if out_dir is not None else None
    try:
        result, lm_eval_out = _evaluate(model, specs, limit, data_dir, docs, (system_prompt, chat_template))
        if staging is not None:
            _write(result, lm_eval_out, staging, Path(out_dir).resolve())
        return result
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _evaluate(model: Any, specs: list[TaskSpec], limit: int | None,
              data_dir: Path | None, docs: range | None = None,
              deployment: tuple[str | None, bool | None] = (None, None)) -> tuple[EvalResult, dict]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    lm, model_name, backend = make_lm(model)
    manager = TaskManager(include_defaults=False)
    merged: dict[str, Any] = {}
    tasks: dict[str, TaskResult] = {}
    groups: dict[tuple[bool, str | None], list[TaskSpec]] = {}
    for spec in specs:
        groups.setdefault(_prompting(spec, *deployment), []).append(spec)
    for (chat, system), group in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        out = simple_evaluate(model=lm, tasks=[lm_eval_config(s, data_dir) for s in group], task_manager=manager,
                              limit=limit, apply_chat_template=chat, fewshot_as_multiturn=chat,
                              system_instruction=system,
                              samples=None if docs is None else {s.name: list(docs) for s in group},
                              bootstrap_iters=0, log_samples=True)
        for spec in group:
            tasks[spec.name] = _task_result(spec, out["results"][spec.name], out["samples"][spec.name])
        for key in ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples"):
            merged.setdefault(key, {}).update(out.get(key, {}))
        for key, value in out.items():
            if key not in merged and key != "samples":
                merged[key] = value
    result = EvalResult(model=model_name, backend=backend, suites=sorted({s.suite for s in specs}),
                        limit=limit, created=time.strftime("%Y-%m-%dT%H:%M:%S"),
                        tasks={s.name: tasks[s.name] for s in specs})
    if deployment != (None, None):
        result.meta["deployment"] = {"system_prompt": deployment[0], "chat_template": deployment[1]}
    return result, merged


def _prompting(spec: TaskSpec, system_prompt: str | None, chat_template: bool | None) -> tuple[bool, str | None]:
    """(chat template?, system prompt) a task runs with: the deployment's for safety tasks, else its own."""
    if spec.suite != "safety":
        return spec.chat, None
    return (spec.chat if chat_template is None else chat_template), system_prompt


def _write(result: EvalResult, lm_eval_out: dict, staging: Path, out_dir: Path) -> None:
    (staging / "lm_eval_results.json").write_text(json.dumps(lm_eval_out, indent=2, default=str))
    (staging / "results.md").write_text(markdown_table(result))
    result.meta["out_dir"] = str(out_dir)
    result.save(staging)  # summary.json last
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
