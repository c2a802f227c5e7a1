"""The HTTP path: the same tasks through lm-eval's `local-completions` against `quantgate serve`.

Tokenization stays on the client with the model's own local tokenizer (`tokenizer_backend=huggingface`,
token-id prompts), which is what lm-eval's in-process `EngineLM` does too, so both paths score and
generate from identical token sequences. Pass the same `max_length` as the in-process run
(`EngineLM(engine).max_length`) to get identical rolling windows for perplexity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evals.lm import DEFAULT_MAX_GEN_TOKS, DEFAULT_MAX_LENGTH
from evals.results import EvalResult


def http_lm(base_url: str, model: str, tokenizer: str | Path | None = None, max_length: int = DEFAULT_MAX_LENGTH,
            num_concurrent: int = 8, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, timeout: int = 300) -> Any:
    """An lm-eval `local-completions` LM for `{base_url}/v1/completions`.

    `model` is the name the server knows the model by; `tokenizer` a model reference or HF dir whose
    tokenizer matches the served model (default: `model` itself, resolved locally, never from a hub).
    """
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from quantgate.env import apply_defaults
    from quantgate.models import resolve_model

    apply_defaults()
    tokenizer_dir = resolve_model(tokenizer if tokenizer is not None else model)
    return LocalCompletionsAPI(
        base_url=base_url.rstrip("/") + "/v1/completions",
        model=model,
        tokenizer=str(tokenizer_dir),
        tokenizer_backend="huggingface",
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
