"""Load for the fleet benchmarks: streamed completions through the ingress, TTFT and latency per request."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx


@dataclass
class Sample:
    sent: float  # seconds from the run's start
    ttft: float | None
    latency: float | None
    status: int
    version: str | None = None
    replica: str | None = None
    kind: str = ""
    error: str | None = None


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, t0: float, kind: str = "") -> Sample:
    sent = time.perf_counter()
    ttft, error = None, None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            status, headers = r.status_code, r.headers
            async for line in r.aiter_lines():
                if line.startswith("data: ") and ttft is None:
                    ttft = time.perf_counter() - sent
                if line.startswith('data: {"error"'):
                    status, error = 503, line[6:300]
    except httpx.HTTPError:
        return Sample(sent - t0, None, None, 599, kind=kind)
    done = time.perf_counter() - sent
    ok = status == 200
    return Sample(sent - t0, ttft if ok else None, done if ok else None, status,
                  headers.get("x-quantgate-version"), headers.get("x-quantgate-replica"), kind, error)


async def closed_loop(url: str, body: dict, concurrency: int, total: int) -> tuple[list[Sample], float]:
    """`concurrency` clients back to back until `total` requests are done; (samples, wall seconds)."""
    samples: list[Sample] = []
    left = total
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                samples.append(await stream_one(client, url, body, t0))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, time.perf_counter() - t0


async def open_loop(url: str, schedule: list[tuple[float, dict, str]]) -> list[Sample]:
    """Send each (at seconds, body, kind) at its time, whatever is still in flight."""
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        async def at(when: float, body: dict, kind: str) -> Sample:
            await asyncio.sleep(max(0.0, t0 + when - time.perf_counter()))
            return await stream_one(client, url, body, t0, kind)

        return list(await asyncio.gather(*(at(w, b, k) for w, b, k in schedule)))
