"""The HTTP path: the same tasks through lm-eval's `local-completions` against `quantgate serve`.

Prompts travel as token ids, tokenized by the same rules as the in-process `EngineLM` (lm-eval's
`TemplateAPI`), with the served model's tokenizer: a local copy when `tokenizer` is given
(`tokenizer_backend=huggingface`, never fetched from a hub), else the server's own `/tokenizer_info`,
`/tokenize`, `/detokenize` endpoints (`tokenizer_backend=remote`). Pass the in-process run's
`EngineLM(engine).max_length` as `max_length` to get identical rolling windows for perplexity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evals.lm import DEFAULT_MAX_GEN_TOKS, DEFAULT_MAX_LENGTH
from evals.results import EvalResult


def http_lm(base_url: str, model: str, tokenizer: str | Path | None = None, max_length: int = DEFAULT_MAX_LENGTH,
            num_concurrent: int = 8, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, timeout: int = 300) -> Any:
    """An lm-eval `local-completions` LM for `{base_url}/v1/completions`.

    `model` is the name the server knows the model by; `tokenizer` an optional model reference or HF
    dir whose tokenizer matches the served model.
    """
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from quantgate.env import apply_defaults
    from quantgate.models import resolve_model

    apply_defaults()
    tokenizer_dir = str(resolve_model(tokenizer)) if tokenizer is not None else None
    return LocalCompletionsAPI(
        base_url=base_url.rstrip("/") + "/v1/completions",
        model=model,
        tokenizer=tokenizer_dir,
        tokenizer_backend="huggingface" if tokenizer_dir else "remote",
        tokenized_requests=True,
        max_length=max_length,
        max_gen_toks=max_gen_toks,
        num_concurrent=num_concurrent,
        batch_size=1,
        max_retries=1,
        timeout=timeout,
    )


def run_suite_http(base_url: str, model: str, suites: list[str] | str = ("accuracy", "safety"),
                   limit: int | None = None, out_dir: Path | str | None = None, **lm_kwargs: Any) -> EvalResult:
    """`run_suite` over HTTP; the result has the same structure (backend `LocalCompletionsAPI`)."""
    from evals.run import run_suite

    return run_suite(http_lm(base_url, model, **lm_kwargs), suites, limit=limit, out_dir=out_dir)
