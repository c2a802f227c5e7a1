"""The OpenAI-compatible request bodies, validated strictly, and the OpenAI error shape.

Validation is strict on purpose: a wrong type or an unknown field is a 400 that names it, never a
coercion and never a 500. Fields OpenAI defines but the engine does not implement are accepted
only at their neutral value (e.g. `presence_penalty: 0`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_LOGPROBS = 20

NonNegInt = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # extension (as in vLLM); 0 disables it
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None  # extension
    ignore_eos: bool = False  # extension: generate exactly max_tokens tokens
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # extension, as in vLLM
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("n")
    @classmethod
    def _only_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not supported; leave them at 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return stops

    @model_validator(mode="after")
    def _stream_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = str | list[str] | list[NonNegInt] | list[list[NonNegInt]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: NonNegInt | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Prompt) -> Prompt:
        if isinstance(v, str):
            if not v:
                raise ValueError("prompt is empty")
        elif not v:
            raise ValueError("prompt is an empty list")
        elif isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("a token-id prompt in the list is empty")
        elif isinstance(v[0], str) and any(not p for p in v):
            raise ValueError("a prompt in the list is empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (a string or one list of token ids each)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: NonNegInt | None = None
    max_completion_tokens: NonNegInt | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # extension, as in vLLM

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[NonNegInt]


# ---- errors ------------------------------------------------------------------------------------
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error the client should see as an OpenAI-shaped JSON body with this status."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}
        self.param = param


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of text parts",
}


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """One readable sentence from pydantic/FastAPI errors, and the first offending field."""
    by_field: dict[str, list[dict]] = {}
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})", None
        # a union reports one error per member, tagged like `prompt.str`: keep the field's path only
        path = ".".join(x for x in loc if not _is_type_tag(x))
        if loc and loc[0] in ("prompt", "stop"):
            path = loc[0]
        by_field.setdefault(path, []).append(err)
    parts = []
    for field, errs in list(by_field.items())[:5]:
        err = errs[0]
        if err.get("type") == "extra_forbidden":
            parts.append(f"unrecognized request argument: {field}")
        elif err.get("type") == "missing":
            parts.append(f"missing required field: {field}")
        elif len(errs) > 1:
            leaf = field.rsplit(".", 1)[-1]
            parts.append(f"{field}: {UNION_HINTS.get(leaf, 'has the wrong type')}" + _got(err))
        else:
            msg = err.get("msg", "invalid value").removeprefix("Value error, ")
            parts.append(f"{field or 'body'}: {msg}" + _got(err))
    return "; ".join(parts) or "invalid request", next(iter(by_field), None) or None


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in {"str", "int", "float", "bool", "list", "dict", "constrained-int"} or (
        part[:1].isupper() and part.isidentifier()
    )


def _got(err: dict) -> str:
    if "input" not in err:
        return ""
    text = repr(err["input"])
    return f" (got {text[:60]}{'...' if len(text) > 60 else ''})"
