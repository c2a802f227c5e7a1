"""Helpers for the server, tenant and router tests: real engines behind real uvicorn servers on loopback."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from serving import LLMEngine
from serving.core.fairness import TenantFairness
from serving.http.server import build_app
from serving.http.server_thread import ServerThread


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """The tiny model's steps are ~10x faster single-threaded on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_engine(model_dir: Path, **kwargs) -> LLMEngine:
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("num_kv_blocks", 256)
    return LLMEngine.from_pretrained(str(model_dir), **kwargs)


@contextlib.contextmanager
def running_server(model_dir: Path, engine_kwargs: dict | None = None, **app_kwargs) -> Iterator[ServerThread]:
    """A tiny engine behind the server; with `tenants`, the engine's scheduler has their quotas."""
    engine_kwargs = dict(engine_kwargs or {})
    engine_kwargs.setdefault("tenant_fairness", TenantFairness.for_tenants(app_kwargs.get("tenants")))
    engine = tiny_engine(model_dir, **engine_kwargs)
    app_kwargs.setdefault("served_model_name", "tiny")
    server = ServerThread(build_app(engine, **app_kwargs)).start()
    server.engine = engine
    try:
        yield server
    finally:
        server.stop()


def scrape(url: str, headers: dict | None = None) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(samples: dict, name: str, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
