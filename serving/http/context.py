"""What every route of the server reads: the engine, its loop, the names it serves under, the tenants."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from serving.core.engine import LLMEngine
from serving.http import openai_format as fmt
from serving.http.engine_loop import EngineLoop
from serving.http.metrics import ServerMetrics
from serving.http.protocol import APIError
from serving.http.tenants import TenantTable


@dataclass
class ServingContext:
    engine: LLMEngine
    loop: EngineLoop
    metrics: ServerMetrics
    model_name: str
    version: str
    tenants: TenantTable | None = None
    metrics_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.tokenizer = self.engine.tokenizer
        self.tokens = fmt.TokenText(self.tokenizer)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.version):
            raise APIError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                           "model_not_found")

    def check_vocab(self, ids: list[int]) -> None:
        bad = [t for t in ids if t >= self.engine.vocab_size]  # before anything decodes them (an id > 2**63: 500)
        if bad:
            raise APIError(400, f"token id {bad[0]} is not in the vocabulary (0..{self.engine.vocab_size - 1})")

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        self.check_vocab(prompt)
        return list(prompt)
