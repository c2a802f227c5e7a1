"""Helpers for the reliability tests: HTTP bursts with outcome accounting, free ports, a `quantgate serve`
subprocess, and the OpenAPI document of the server's request bodies (for schemathesis)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from serving.http import serve_process as serve_process_
from serving.http.serve_process import free_port  # noqa: F401 (the tests import it from here)

RETRYABLE = (429, 503)


def assert_client_error_shape(r: httpx.Response) -> None:
    """Never a 5xx for what a client sends; a 4xx carries an OpenAI-shaped error naming the problem."""
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"], err
        assert isinstance(err["type"], str) and err["type"], err


@dataclass
class Outcome:
    """What one request of a burst ended as: exactly one of completed / rejected / failed."""

    index: int
    status: int | None = None
    text: str | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    retry_after: str | None = None
    error: str | None = None
    events: list[dict] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_reason is not None

    @property
    def rejected(self) -> bool:
        return self.status in RETRYABLE


async def _one(client: httpx.AsyncClient, url: str, index: int, body: dict) -> Outcome:
    out = Outcome(index)
    try:
        if body.get("stream"):
            async with client.stream("POST", url, json=body) as r:
                out.status, out.retry_after = r.status_code, r.headers.get("retry-after")
                if r.status_code != 200:
                    await r.aread()
                    out.error = r.text
                    return out
                pieces = []
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line.removeprefix("data: "))
                    out.events.append(event)
                    if "error" in event:
                        out.error = json.dumps(event["error"])
                        continue
                    for choice in event.get("choices", []):
                        pieces.append(choice["text"])
                        out.finish_reason = choice["finish_reason"] or out.finish_reason
                    if event.get("usage"):
                        out.completion_tokens = event["usage"]["completion_tokens"]
                out.text = "".join(pieces)
        else:
            r = await client.post(url, json=body)
            out.status, out.retry_after = r.status_code, r.headers.get("retry-after")
            if r.status_code == 200:
                data = r.json()
                out.text = data["choices"][0]["text"]
                out.finish_reason = data["choices"][0]["finish_reason"]
                out.completion_tokens = data["usage"]["completion_tokens"]
            else:
                out.error = r.text
    except httpx.HTTPError as exc:  # transport failure: counted as lost by the caller
        out.error = f"{type(exc).__name__}: {exc}"
    return out


def burst(url: str, bodies: list[dict], timeout: float = 300.0) -> list[Outcome]:
    """Send every body at once (one connection each) and wait for every outcome, bounded by `timeout`."""

    async def run() -> list[Outcome]:
        limits = httpx.Limits(max_connections=len(bodies) + 1)
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
            tasks = [_one(client, url, i, b) for i, b in enumerate(bodies)]
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout)

    return asyncio.run(run())


# ---- a real `quantgate serve` process --------------------------------------------------------------
def spawn_serve(model_dir: Path, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """Start `quantgate serve` on a free loopback port (not waiting for it); returns (process, base URL)."""
    return serve_process_.spawn_serve(model_dir, log, "--served-model-name", "tiny", "--threads", "1",
                                      "--log-level", "warning", *extra, env={"OMP_NUM_THREADS": "1"})


def wait_serve_up(proc: subprocess.Popen, url: str, log: Path, timeout: float = 240.0) -> None:
    try:
        serve_process_.wait_serve_up(proc, url, log, timeout)
    except RuntimeError as exc:
        raise AssertionError(str(exc)) from None


def stop_serve(proc: subprocess.Popen) -> None:
    """Ctrl-C, then kill if it does not exit within 20 s."""
    serve_process_.stop_serve(proc, signal.SIGINT, 20.0)


@contextlib.contextmanager
def serve_process(model_dir: Path, log: Path, *extra: str, startup_s: float = 240.0) -> Iterator[tuple]:
    """`quantgate serve` on a free loopback port; yields (process, base URL). Always reaped."""
    proc, url = spawn_serve(model_dir, log, *extra)
    try:
        wait_serve_up(proc, url, log, timeout=startup_s)
        yield proc, url
    finally:
        stop_serve(proc)


def wait_exit(proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until `proc` exited; AssertionError (and a kill) past `timeout`."""
    start = time.monotonic()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"the server did not exit within {timeout} s of SIGTERM") from None
    return time.monotonic() - start


# ---- the server's request bodies as an OpenAPI document ------------------------------------------------
def openapi_schema(max_tokens_cap: int = 8) -> dict:
    """OpenAPI 3.1 for the JSON endpoints, from the very pydantic models the server validates with.

    The server publishes no schema (its handlers parse bodies themselves, to answer every mistake with
    an OpenAI-shaped 400), so the fuzzer gets one built here. `max_tokens` is capped in the document
    only to keep positive examples short; negative examples still go past it.
    """
    from pydantic.json_schema import models_json_schema

    from serving.http.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        DetokenizeRequest,
        TokenizeRequest,
    )

    models = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
              "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
    _, defs = models_json_schema([(m, "validation") for m in models.values()],
                                 ref_template="#/components/schemas/{model}")
    schemas = defs["$defs"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        for key in ("max_tokens", "max_completion_tokens"):
            prop = schemas[name]["properties"].get(key)
            if prop is not None:
                for option in prop.get("anyOf", [prop]):
                    if option.get("type") == "integer":
                        option["maximum"] = max_tokens_cap
    paths = {}
    for path, model in models.items():
        paths[path] = {"post": {
            "operationId": path.strip("/").replace("/", "_"),
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
            "responses": {"200": {"description": "ok"}, "400": {"description": "bad request"}},
        }}
    return {"openapi": "3.1.0", "info": {"title": "quantgate", "version": "1"}, "paths": paths,
            "components": {"schemas": schemas}}
