"""`run_beside_engine`: the engine steps on the calling thread while a real HTTP client runs on another;
the client's result or exception comes back to the caller."""

from __future__ import annotations

import threading

import httpx
import pytest
from server_fixtures import tiny_engine

from serving.http.server import build_app
from serving.http.server_thread import ServerThread, run_beside_engine


def test_the_engine_steps_on_the_callers_thread_while_the_client_runs(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir)
    app = build_app(engine, served_model_name="tiny", engine_thread=False)
    loop = app.state.engine_loop
    stepping: list[threading.Thread] = []
    original = engine.step

    def step():
        stepping.append(threading.current_thread())
        return original()

    engine.step = step
    with ServerThread(app) as server:
        def client() -> dict:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
            return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()

        reply = run_beside_engine(loop, client)
        assert reply["usage"]["completion_tokens"] == 5
        assert stepping and set(stepping) == {threading.current_thread()}
        assert not loop.alive  # the loop ends with the client

        def failing() -> None:
            raise ValueError("client broke")

        with pytest.raises(ValueError, match="client broke"):
            run_beside_engine(loop, failing)
