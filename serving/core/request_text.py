"""A request's text at both ends of the engine: the prompt checked and tokenized, the stop and length rules
that finish a sequence, and the output record a step returns. No scheduling, no KV cache, no model."""

from __future__ import annotations

from serving.core.engine_interface import RequestOutput
from serving.core.sequence import Sequence, SequenceStatus


def tokenize_prompt(tokenizer, vocab_size: int, prompt: str | list[int]) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt given as text or as token ids; ValueError naming what is wrong."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt, tokenizer.encode(prompt)
    if not isinstance(prompt, list | tuple) or not prompt:
        raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"token id {t!r} is not in the vocabulary (0..{vocab_size - 1})")
    return None, list(prompt)


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every end-of-sequence id the generation config, the model config or the tokenizer names."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return ids


class Finisher:
    """Decides, after each sampled token, whether a sequence ends (stop string, stop or EOS token, length)
    and sets its text."""

    def __init__(self, tokenizer, eos_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len

    def check(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if seq.stream_text or p.stop:
            previous = len(seq.text)
            seq.text = self.decode(seq)
            if p.stop:
                window = max(0, previous - max(len(s) for s in p.stop))
                hits = [i for s in p.stop if (i := seq.text.find(s, window)) != -1]
                if hits:  # the stop string itself is not part of the output, as in OpenAI's API
                    return self.finish(seq, "stop", seq.text[: min(hits)])
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            return self.finish(seq, "stop")
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return self.finish(seq, "length")

    def finish(self, seq: Sequence, reason: str, text: str | None = None) -> None:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        seq.text = text if text is not None else self.decode(seq)

    def decode(self, seq: Sequence) -> str:
        ids = seq.output_token_ids
        if ids and not seq.params.ignore_eos and ids[-1] in self.eos_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def request_output(seq: Sequence, new_tokens: list[int]) -> RequestOutput:
    """What a step returns for a sequence that gained tokens or finished."""
    return RequestOutput(
        request_id=seq.request_id,
        prompt=seq.prompt,
        prompt_token_ids=seq.prompt_token_ids,
        text=seq.text,
        token_ids=seq.output_token_ids,
        new_token_ids=new_tokens,
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        logprobs=seq.logprobs,
        prompt_logprobs=seq.prompt_logprobs,
        metrics=seq.metrics,
        num_cached_tokens=seq.num_cached_tokens,
        tenant=seq.tenant,
    )
