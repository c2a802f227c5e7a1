"""The one streaming client: an OpenAI-style SSE completion over aiohttp, timed on the client side.

Used by the load generator (benchmarks/serving.py), the soak (benchmarks/soak.py) and the release
flow's canary replay (flows/canary_stage.py). TTFT is the time to the first non-empty text; ITLs are the gaps
between text chunks; the token count is the server's `usage` when it sends one, else the text chunks.

aiohttp, not httpx: against a stub that answers at once (64 streams in flight, 2 shared cores) it drives
~500 requests/s where httpx drives ~30-50, and the generator must not be what a benchmark measures.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Streamed:
    status: int | None = None
    error: str | None = None
    ttft: float | None = None  # seconds after the request was sent
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    chunks: int = 0  # chunks that carried text
    usage_tokens: int | None = None  # completion_tokens of the server's usage chunk
    prompt_tokens: int | None = None
    text: str = ""
    retry_after: float | None = None  # on 429/503, what the server asked for
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunks

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def error_message(body: str) -> str:
    """The `error.message` of an OpenAI error body, else the body's start."""
    try:
        err = json.loads(body).get("error")
        return (err.get("message") if isinstance(err, dict) else str(err)) or body[:200]
    except (ValueError, AttributeError):
        return body[:200]


def _piece(choice: dict, chat: bool) -> str | None:
    return (choice.get("delta") or {}).get("content") if chat else choice.get("text")


def session(concurrency: int | None = None, timeout_s: float = 600.0,
            headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    """A client session for `stream_completion`: at most `concurrency` connections (None: no cap)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency or 0),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s), headers=headers)


async def stream_completion(client: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                            chat: bool = False) -> Streamed:
    """POST `payload` (with stream: true) to `url` and read the stream to its end; never raises. A pooled
    keep-alive connection the server closed before answering (llama-server does) is retried once, fresh."""
    out = await _stream_once(client, url, payload, chat)
    if out.status is None and out.error is not None and out.error.startswith("ServerDisconnectedError"):
        out = await _stream_once(client, url, payload, chat)
    return out


async def _stream_once(client: aiohttp.ClientSession, url: str, payload: dict[str, Any], chat: bool) -> Streamed:
    out = Streamed()
    start = last = time.perf_counter()
    pieces: list[str] = []
    try:
        async with client.post(url, json=payload) as response:
            out.status, out.headers = response.status, {k.lower(): v for k, v in response.headers.items()}
            if response.status != 200:
                body = await response.text(errors="replace")
                out.error = f"HTTP {response.status}: {error_message(body)}"
                if response.status in (429, 503):
                    out.retry_after = float(response.headers.get("retry-after", "1"))
                return out
            async for raw in response.content:  # one SSE line at a time; read to the end (keep-alive)
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"stream error: {error_message(data.decode(errors='replace'))}"
                    return out
                usage = chunk.get("usage")
                if usage:
                    out.usage_tokens = usage.get("completion_tokens", out.usage_tokens)
                    out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
                for choice in chunk.get("choices") or []:
                    piece = _piece(choice, chat)
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if out.ttft is None:
                        out.ttft = now - start
                    else:
                        out.itls.append(now - last)
                    last = now
                    out.chunks += 1
                    pieces.append(piece)
        out.e2e = time.perf_counter() - start
        out.text = "".join(pieces)
    except Exception as exc:  # a client reports failures, it does not stop on them
        out.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return out
