"""A stub OpenAI-compatible streaming server that answers at once: it measures the load generator's own
overhead (how many requests/s it can drive), not any engine. Run in its own process on a free port."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from quantgate.ports import free_port


async def stub_app(scope, receive, send) -> None:
    """Plain ASGI: /v1/models, and streaming /v1/completions and /v1/chat/completions that send
    `max_tokens` one-word chunks, then usage, then [DONE]. A prompt containing "please fail" gets a 429."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    path = scope["path"]
    if path == "/v1/models":
        return await _json(send, 200, {"object": "list", "data": [{"id": "stub-model", "object": "model"}]})
    if path not in ("/v1/completions", "/v1/chat/completions"):
        return await _json(send, 404, {"error": {"message": f"no route {path}", "type": "not_found"}})
    request = json.loads(body)
    chat = path.endswith("chat/completions")
    prompt = request["messages"][-1]["content"] if chat else request["prompt"]
    if "please fail" in prompt:
        return await _json(send, 429, {"error": {"message": "queue full", "type": "rate_limit", "code": 429}})
    n = request.get("max_tokens", 16)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
    for i in range(n):
        choice = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
        choice |= {"delta": {"content": f" w{i}"}} if chat else {"text": f" w{i}"}
        chunk = {"id": "cmpl-stub", "object": "text_completion", "model": request.get("model"), "choices": [choice]}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True})
    usage = {"id": "cmpl-stub", "choices": [],
             "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": n, "total_tokens": n}}
    await send({"type": "http.response.body", "body": f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()})


async def _json(send, status: int, obj) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(obj).encode()})


def wait_for_port(port: int, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listened on 127.0.0.1:{port} within {timeout} s")


@contextlib.contextmanager
def stub_server() -> Iterator[str]:
    """The stub in a uvicorn subprocess (its own core, not the test's GIL); yields its base URL."""
    port = free_port()
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import uvicorn; "
        "from benchmarks_fixtures import stub_app; "
        f"uvicorn.run(stub_app, host='127.0.0.1', port={port}, log_level='warning', access_log=False, "
        "lifespan='off', backlog=4096)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        wait_for_port(port, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
