"""A server started inside a host process (the release flow, a benchmark) leaves the host's logging alone:
uvicorn's own logging config used to shut down every handler of the process (the flow's Prefect API log
handler among them), and the flush that came with it stalled the release's first server ~4 s."""

from __future__ import annotations

import logging

import httpx
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from serving.http.server_thread import ServerThread


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.closed, self.records = False, []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())

    def close(self) -> None:
        self.closed = True
        super().close()


def test_a_server_thread_keeps_the_host_s_handlers() -> None:
    handler, host = _Kept(), logging.getLogger("quantgate-test-host")
    host.addHandler(handler)
    root_before = list(logging.getLogger().handlers)
    try:
        app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))])
        with ServerThread(app) as server:
            assert httpx.get(server.url + "/").text == "ok"
        host.warning("still here")
        assert not handler.closed and handler in host.handlers and handler.records == ["still here"]
        assert logging.getLogger().handlers == root_before
        assert logging.getLogger("uvicorn.access").getEffectiveLevel() >= logging.WARNING  # no access lines
    finally:
        host.removeHandler(handler)
