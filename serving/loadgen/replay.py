"""A replayed traffic sample: the shipped prompts, one user id per request, streamed through a server or router
`concurrency` at a time, each forced to `max_tokens`. The release's canary replays through its router
(flows/canary_stage.py); the release plan's pilot replays a few through one server to cost it (gates/pilot.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from serving.loadgen.client import session, stream_completion
from serving.loadgen.prompts import load_prompts


def traffic(n: int, seed: int = 0) -> list[dict]:
    """The replayed sample: prompts from the shipped prompt set, one user id per request."""
    prompts = load_prompts()
    return [{"user": f"user-{seed}-{i}", "prompt": prompts[i % len(prompts)]} for i in range(n)]


def replay(url: str, sample: list[dict], concurrency: int, max_tokens: int,
           advance: Callable[[int], None] = lambda n: None) -> list[dict]:
    """Stream every request of `sample` to `url`'s /v1/completions; one record per request, in sample order:
    id, user, version (the router's X-Quantgate-Version), status, error, ttft_s, tpot_s, tokens."""
    return asyncio.run(_replay(url, sample, concurrency, max_tokens, advance))


async def _replay(url: str, sample: list[dict], concurrency: int, max_tokens: int,
                  advance: Callable[[int], None]) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)
    async with session(concurrency, timeout_s=300.0) as client:

        async def one(i: int, item: dict) -> dict:
            async with gate:
                record = await _stream_one(client, url, i, item, max_tokens)
            advance(1)
            return record

        return list(await asyncio.gather(*(one(i, item) for i, item in enumerate(sample))))


async def _stream_one(client, url: str, i: int, item: dict, max_tokens: int) -> dict:
    body = {"prompt": item["prompt"], "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "user": item["user"], "ignore_eos": True}
    got = await stream_completion(client, f"{url}/v1/completions", body)
    record: dict = {"id": i, "user": item["user"], "version": got.headers.get("x-quantgate-version"),
                    "status": got.status, "error": got.error, "ttft_s": got.ttft, "tpot_s": None,
                    "tokens": got.usage_tokens or 0}
    if got.error is None:
        if got.ttft is not None and record["tokens"] > 1:
            record["tpot_s"] = got.tpot
        else:
            record["error"] = f"no tokens streamed (usage {record['tokens']})"
    return record
