"""serving/loadgen/client.py against a raw asyncio HTTP server: a keep-alive connection the server drops
before answering is retried once; any other failure is reported, not retried."""

from __future__ import annotations

import asyncio
import json

from serving.loadgen.client import session, stream_completion

CHUNK = {"choices": [{"text": "hi"}], "usage": {"completion_tokens": 1, "prompt_tokens": 3}}
BODY = f"data: {json.dumps(CHUNK)}\n\ndata: [DONE]\n\n".encode()


async def _serve(drop: set[int]):
    """A server answering every request with one SSE chunk, keeping the connection alive; request k
    (0-based, over all connections) in `drop` has its connection closed unanswered, as a server closing
    an idle keep-alive connection does. Returns the server and each request's connection number."""
    requests: list[int] = []
    opened = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection, opened[0] = opened[0], opened[0] + 1
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:  # the client closed it
                return
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            requests.append(connection)
            if len(requests) - 1 in drop:
                writer.close()
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         + f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY)
            await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, requests


async def _two_requests(drop: set[int]):
    server, connections = await _serve(drop)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
    async with server, session(concurrency=1, timeout_s=10) as client:
        outs = [await stream_completion(client, url, {"prompt": [1, 2, 3], "stream": True}) for _ in range(2)]
    return outs, connections


def test_a_dropped_connection_is_retried_once_on_a_fresh_one():
    outs, connections = asyncio.run(_two_requests(drop={1}))
    assert [(o.status, o.error, o.text, o.usage_tokens, o.prompt_tokens) for o in outs] == [(200, None, "hi", 1, 3)] * 2
    assert connections == [0, 0, 1]  # the second request dropped on the kept-alive connection, retried on a new one


def test_a_second_drop_is_reported():
    outs, _ = asyncio.run(_two_requests(drop={1, 2}))
    assert outs[0].error is None
    assert outs[1].status is None and outs[1].error.startswith("ServerDisconnectedError")
