"""OpenAI's response shapes as plain functions: the envelope, usage, logprobs, stream events.

Nothing here touches the engine or the request: the routes hand in what was generated.
"""

from __future__ import annotations

import functools
import json
import time

from serving.core.sequence import TokenLogprob
from serving.http.protocol import APIError, error_body

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def error_event(error: APIError) -> str:
    return sse(error_body(error.status, error.message, error.code))


def usage(n_prompt: int, n_gen: int) -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


def envelope(rid: str, kind: str, model: str, choices: list[dict], n_tokens: tuple[int, int] | None = None) -> dict:
    """A response or stream chunk: `kind` is its `object`; `n_tokens` (prompt, generated) adds `usage`."""
    body = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if n_tokens is not None:
        body["usage"] = usage(*n_tokens)
    return body


def holdback(text: str, stops: list[str], finished: bool) -> str:
    """The part of the cumulative text safe to stream: not a possible stop-string prefix, not half a character."""
    if finished:
        return text
    if stops:
        text = text[: max(0, len(text) - (max(len(s) for s in stops) - 1))]
    return text.rstrip("\ufffd")


class TokenText:
    """Token strings for logprobs, decoded once per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def top(self, lp: TokenLogprob) -> dict[str, float]:
        """OpenAI's top_logprobs entry: the k best and the actual token, keyed by their text."""
        out: dict[str, float] = {}
        for tid, value in [*lp.top, (lp.token_id, lp.logprob)]:
            key = self.text(tid)
            out[key] = max(out.get(key, float("-inf")), value)
        return out

    def completion_logprobs(self, ids: list[int], lps: list[TokenLogprob | None], start: int = 0,
                            offsets_from: tuple[int, int] | None = None) -> dict:
        tokens = [self.text(t) for t in ids]
        offsets, pos = [], start
        for i, tok in enumerate(tokens):
            if offsets_from is not None and i == offsets_from[0]:
                pos = offsets_from[1]  # generated tokens start right after the echoed prompt's text
            offsets.append(pos)
            pos += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
            "top_logprobs": [None if lp is None else self.top(lp) for lp in lps],
            "text_offset": offsets,
        }

    def chat_logprobs(self, ids: list[int], lps: list[TokenLogprob]) -> list[dict]:
        def entry(tid: int, value: float) -> dict:
            s = self.text(tid)
            return {"token": s, "logprob": value, "bytes": list(s.encode())}

        return [
            {**entry(tid, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for tid, lp in zip(ids, lps, strict=False)
        ]


def completion_choice(index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def chat_choice(content: str, logprobs: list[dict] | None, finish: str | None) -> dict:
    return {"index": 0, "message": {"role": "assistant", "content": content},
            "logprobs": None if logprobs is None else {"content": logprobs}, "finish_reason": finish}


def chat_delta(delta: dict, logprobs: list[dict] | None, finish: str | None) -> dict:
    return {"index": 0, "delta": delta, "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": finish}
