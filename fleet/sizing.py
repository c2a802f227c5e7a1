"""How many KV tokens a request body asks for (prompt + max_tokens): the router's `need_tokens`."""

from __future__ import annotations

import json

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as serving's routes


class RequestSizer:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def parse(self, body: bytes) -> dict:
        try:
            data = json.loads(body or b"{}")
        except (ValueError, UnicodeDecodeError):
            return {}
        return data if isinstance(data, dict) else {}

    def need_tokens(self, path: str, data: dict) -> int:
        """An estimate; a body the replica will refuse (400) gets 1: it needs no KV."""
        try:
            if path.endswith("/chat/completions"):
                prompt = self._chat_tokens(data.get("messages") or [])
                limit = data.get("max_completion_tokens") or data.get("max_tokens")
                return prompt + int(limit if limit else max(1, self.max_model_len - prompt))
            prompts = data.get("prompt")
            if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
                prompts = [prompts]
            max_tokens = data.get("max_tokens")
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max(1, int(max_tokens))
            return sum(self._tokens(p) + max_tokens for p in prompts or [])
        except (TypeError, ValueError, AttributeError):
            return 1

    def _tokens(self, prompt) -> int:
        return len(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)

    def _chat_tokens(self, messages: list) -> int:
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # the replica will say what is wrong with them
            text = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        return len(self.tokenizer.encode(text, add_special_tokens=False))
