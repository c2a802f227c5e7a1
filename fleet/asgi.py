"""Call an ASGI app in-process and stream its response: how a replica runs `quantgate serve`'s own app.

The replica answers with the very app `quantgate serve` builds (`serving.http.server.build_app`), so the
fleet's endpoints, validation, error shapes and SSE streams are the single server's by construction.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass
class Head:
    status: int
    headers: list[tuple[str, str]]

    @property
    def content_type(self) -> str:
        return next((v for k, v in self.headers if k.lower() == "content-type"), "")


_END = object()


async def call_asgi(app, method: str, path: str, headers: list[tuple[str, str]], body: bytes,
                    query: str = "") -> AsyncIterator[Head | bytes]:
    """Yield the response's Head, then its body chunks as the app sends them. Closing the generator
    early tells the app the client disconnected (so the engine aborts the request)."""
    out: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await out.put(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method.upper(),
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
        "root_path": "", "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "state": {},
    }

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await out.put(_END)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await out.get()
            if message is _END:
                break
            if message["type"] == "http.response.start":
                yield Head(message["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                               for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
    finally:
        disconnected.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
