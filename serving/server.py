"""The OpenAI-compatible HTTP server: one LLMEngine stepping on a background thread, many clients.

Requests from every connection join the engine's running batch as they arrive; the engine thread
hands each request's outputs to that request's asyncio queue. A client that goes away aborts its
requests, and the engine frees their KV blocks on its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.engine import LLMEngine, RequestOutput
from serving.http_body import parse_json_object, read_body
from serving.metrics import CONTENT_TYPE, ServerMetrics
from serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    describe_validation_errors,
    error_body,
)
from serving.sampling_params import SamplingParams
from serving.sequence import TokenLogprob
from serving.tenants import DEFAULT_TENANT, TenantTable, key_matches

log = logging.getLogger("quantgate.server")

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.5
ENGINE_STOPPED = APIError(503, "the engine loop is not running; retry on another replica", "engine_stopped",
                          {"Retry-After": str(RETRY_AFTER_S)})
MIN_TEMPERATURE = 1e-5
DRAIN_TIMEOUT_S = 3.0  # after SIGTERM, in-flight requests get this long; `quantgate serve` gives uvicorn 5 s
MIN_TOP_P = 1e-6


# ---- the engine thread -------------------------------------------------------------------------
@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int


class EngineLoop:
    """Steps the engine on a background thread and delivers outputs to asyncio queues."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_waiting: int,
                 tenant_limits: dict[str, int] | None = None):
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.tenant_limits = tenant_limits or {}  # tenant -> max waiting requests
        self._streams: dict[str, _Stream] = {}
        self._queued: dict[str, str] = {}  # request id -> tenant, until first scheduled
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.draining = False
        self._drain_deadline: float | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="quantgate-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def drain(self, timeout: float) -> None:
        """Admit nothing new (503); what is still in flight after `timeout` s is aborted with a clear error."""
        if not self.draining:
            self.draining = True
            self._drain_deadline = time.monotonic() + timeout
            log.warning("draining: no new requests; in-flight ones get %.1f s to finish", timeout)
        self._wake.set()

    def submit(self, prompts: list[list[int]], params: SamplingParams, tenant: str,
               queue: asyncio.Queue, cache_salt: str | None = None) -> list[str]:
        """Queue one engine request per prompt, all or none. 429 when a waiting queue is full."""
        loop = asyncio.get_running_loop()
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica", "server_shutting_down",
                           {"Retry-After": str(RETRY_AFTER_S)})
        if len(prompts) > self.max_waiting:  # it could never fit the queue: no retry would help
            raise APIError(400, f"{len(prompts)} prompts in one request; this server queues at most "
                           f"{self.max_waiting} prompts (its max_waiting)", "too_many_prompts")
        with self._lock:
            if len(self._queued) + len(prompts) > self.max_waiting:  # every prompt is a queued request
                self.metrics.reject(tenant, "server_queue_full")
                raise APIError(429, f"the server's waiting queue is full ({self.max_waiting} requests); retry later",
                               "queue_full", {"Retry-After": str(RETRY_AFTER_S)})
            limit = self.tenant_limits.get(tenant)
            if limit is not None and sum(1 for t in self._queued.values() if t == tenant) + len(prompts) > limit:
                self.metrics.reject(tenant, "tenant_queue_full")
                raise APIError(429, f"tenant {tenant!r} already has {limit} requests waiting (its max_waiting); "
                               "retry later", "tenant_queue_full", {"Retry-After": str(RETRY_AFTER_S)})
            rids: list[str] = []
            try:
                for index, ids in enumerate(prompts):
                    rid = f"cmpl-{uuid.uuid4().hex}"
                    self._streams[rid] = _Stream(loop, queue, index)
                    rids.append(rid)
                    self.engine.add_request(ids, params, request_id=rid, tenant=tenant, cache_salt=cache_salt,
                                            stream_text=True)
                    self._queued[rid] = tenant
            except ValueError as exc:
                for rid in rids:
                    self._streams.pop(rid, None)
                    self._queued.pop(rid, None)
                    self.engine.abort(rid)
                code = "context_length_exceeded" if "context length" in str(exc) else None
                raise APIError(400, str(exc), code) from exc
        self._wake.set()
        return rids

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort(rid)
        self._wake.set()

    # ---- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception as exc:  # an engine bug must fail its requests, not stop the loop (they would hang)
                log.exception("engine step failed")
                self._fail_all(APIError(500, f"the engine failed: {exc}", "engine_error"))
                time.sleep(0.05)

    def _tick(self) -> None:
        if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline and self._streams:
            self._fail_all(APIError(503, "the server shut down before this request finished; it was aborted, "
                                    "retry on another replica", "server_shutting_down",
                                    {"Retry-After": str(RETRY_AFTER_S)}))
        if not self.engine.has_unfinished():
            self._snapshot()
            self._wake.wait(0.1)
            self._wake.clear()
            return
        outputs = self.engine.step()
        self.steps += 1
        for out in outputs:
            self.metrics.on_output(out)
            self._deliver(out)
        self._mark_scheduled()
        self._snapshot()

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self._queued.pop(out.request_id, None)
        if stream is None:
            return
        item: RequestOutput | APIError = out
        if out.finish_reason == "error":  # this request alone: the others of its step went on
            item = APIError(500, "the model produced non-finite logits (NaN/inf) for this request; the variant "
                            "may be broken", "engine_error")
        with contextlib.suppress(RuntimeError):  # the client's event loop is gone
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, (stream.index, item))

    def _mark_scheduled(self) -> None:
        with self._lock:
            for rid in list(self._queued):
                seq = self.engine.sequences.get(rid)
                if seq is not None and seq.metrics.first_scheduled_time is not None:
                    del self._queued[rid]

    def _snapshot(self) -> None:
        stats = self.engine.stats()
        waiting = Counter(s.tenant for s in self.engine.scheduler.waiting)
        blocks: Counter[str] = Counter()
        for seq in self.engine.scheduler.running:
            blocks[seq.tenant] += len(seq.block_table)
        self.metrics.on_stats(stats, dict(waiting), dict(blocks))

    def _fail_all(self, error: APIError) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            self._queued.clear()
        for rid, stream in streams.items():
            self.engine.abort(rid)
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, (stream.index, error))


# ---- helpers -----------------------------------------------------------------------------------
class _AbortingStream(StreamingResponse):
    """A streaming response that aborts its engine requests however it ends (done, error, disconnect)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _parse(request: Request, model: type[BaseModel]) -> BaseModel:
    data = parse_json_object(await read_body(request))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors())
        raise APIError(400, message, param=param) from exc


def _holdback(text: str, stops: list[str], finished: bool) -> str:
    """The part of the cumulative text safe to stream: not a possible stop-string prefix, not half a character."""
    if finished:
        return text
    if stops:
        text = text[: max(0, len(text) - (max(len(s) for s in stops) - 1))]
    return text.rstrip("\ufffd")


class _Tokens:
    """Token strings for logprobs, decoded once per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def top(self, lp: TokenLogprob) -> dict[str, float]:
        """OpenAI's top_logprobs entry: the k best and the actual token, keyed by their text."""
        out: dict[str, float] = {}
        for tid, value in [*lp.top, (lp.token_id, lp.logprob)]:
            key = self.text(tid)
            out[key] = max(out.get(key, float("-inf")), value)
        return out

    def completion_logprobs(self, ids: list[int], lps: list[TokenLogprob | None], start: int = 0,
                            offsets_from: tuple[int, int] | None = None) -> dict:
        tokens = [self.text(t) for t in ids]
        offsets, pos = [], start
        for i, tok in enumerate(tokens):
            if offsets_from is not None and i == offsets_from[0]:
                pos = offsets_from[1]  # generated tokens start right after the echoed prompt's text
            offsets.append(pos)
            pos += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
            "top_logprobs": [None if lp is None else self.top(lp) for lp in lps],
            "text_offset": offsets,
        }

    def chat_logprobs(self, ids: list[int], lps: list[TokenLogprob]) -> list[dict]:
        def entry(tid: int, value: float) -> dict:
            s = self.text(tid)
            return {"token": s, "logprob": value, "bytes": list(s.encode())}

        return [
            {**entry(tid, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for tid, lp in zip(ids, lps, strict=False)
        ]


# ---- the app -----------------------------------------------------------------------------------
def build_app(
    engine: LLMEngine,
    *,
    served_model_name: str | None = None,
    version: str | None = None,
    tenants: TenantTable | None = None,
    max_waiting: int = 256,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
    metrics_key: str | None = None,
) -> FastAPI:
    """The ASGI app over `engine`. With `tenants`, every request needs an API key of a tenant, and
    /metrics the metrics key (`metrics_key`, else the keys file's); without tenants /metrics is open
    unless a `metrics_key` is given."""
    if tenants is not None:
        tenants = tenants.with_metrics_key(metrics_key)
        metrics_key = tenants.metrics_key
        if metrics_key is None:
            log.warning("tenants are configured but no metrics key: /metrics will answer 401 to everyone")
    model_name = served_model_name or engine.model_name.rstrip("/").rsplit("/", 1)[-1]
    version = version or model_name
    tenant_names = sorted(tenants.tenants) if tenants else [DEFAULT_TENANT]
    metrics = ServerMetrics(version, tenant_names)
    if tenants:
        engine.scheduler.tenant_max_kv_blocks = tenants.quotas(engine.block_manager.num_blocks)
    waiting_limits = {n: t.max_waiting for n, t in (tenants.tenants if tenants else {}).items()
                      if t.max_waiting is not None}
    loop = EngineLoop(engine, metrics, max_waiting, waiting_limits)
    tokenizer = engine.tokenizer
    tokens = _Tokens(tokenizer)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        restore = _drain_on_signals(loop, drain_timeout_s)
        try:
            yield
        finally:
            restore()
            loop.stop()

    app = FastAPI(title="quantgate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine_loop, app.state.metrics, app.state.model_name = loop, metrics, model_name

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(error_body(exc.status, exc.message, exc.code, exc.param), exc.status,
                            headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed on "
                   f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(error_body(exc.status_code, message), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), 500)

    def tenant_of(request: Request) -> str:
        if tenants is None:
            return DEFAULT_TENANT
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if not header:
            raise APIError(401, "missing API key: send `Authorization: Bearer <key>`", "missing_api_key")
        tenant = tenants.authenticate(key.strip() if scheme.lower() == "bearer" else None)
        if tenant is None:
            raise APIError(401, "invalid API key", "invalid_api_key")
        return tenant.name

    def check_model(name: str | None) -> None:
        if name is not None and name not in (model_name, version):
            raise APIError(404, f"the model `{name}` does not exist; this server serves `{model_name}`",
                           "model_not_found")

    def encode(prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        bad = [t for t in prompt if t >= engine.vocab_size]  # before anything decodes them (an id > 2**63: 500)
        if bad:
            raise APIError(400, f"token id {bad[0]} is not in the vocabulary (0..{engine.vocab_size - 1})")
        return list(prompt)

    async def next_output(queue: asyncio.Queue) -> tuple[int, RequestOutput | APIError]:
        """The next (index, output) for a stream; an error instead of waiting forever on a dead loop."""
        while True:
            try:
                return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if not loop.alive:
                    return 0, ENGINE_STOPPED

    async def collect(request: Request, queue: asyncio.Queue, rids: list[str]) -> list[RequestOutput]:
        """Wait for every request's final output; a client that hangs up aborts them."""
        finals: dict[int, RequestOutput] = {}
        next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            while len(finals) < len(rids):
                try:
                    index, item = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    item = None
                    if not loop.alive:  # never wait on a loop that can no longer answer
                        raise ENGINE_STOPPED from None
                # on the clock, not on silence: a generating request gets an output every step
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        raise APIError(499, "client disconnected") from None
                if item is None:
                    continue
                if isinstance(item, APIError):
                    raise item
                if item.finished:
                    finals[index] = item
        finally:
            if len(finals) < len(rids):
                loop.abort([r for i, r in enumerate(rids) if i not in finals])
        return [finals[i] for i in range(len(rids))]

    def sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None,
                 prompt_logprobs: int | None) -> SamplingParams:
        # The sampler works in float32, where a temperature or top_p under ~1e-38 is 0: NaN probabilities
        # failed the whole engine step. A temperature that small is greedy (vLLM: < 1e-5); a top_p that small
        # keeps only the best token, as MIN_TOP_P does.
        temperature = 0.0 if body.temperature < MIN_TEMPERATURE else body.temperature
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=max(body.top_p, MIN_TOP_P), top_k=body.top_k,
            seed=body.seed, stop=body.stop or [], stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )

    # ---- completions ---------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        tenant = tenant_of(request)
        body = await _parse(request, CompletionRequest)
        check_model(body.model)
        raw = body.prompts()
        prompts = [encode(p) for p in raw]
        texts = [p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(raw, prompts, strict=True)]
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        no_generation = max_tokens == 0  # lm-eval's scoring call: run one token, report none
        want_prompt_lps = body.echo and body.logprobs is not None
        params = sampling(body, max(1, max_tokens), body.logprobs, body.logprobs if want_prompt_lps else None)
        queue: asyncio.Queue = asyncio.Queue()
        rids = loop.submit(prompts, params, tenant, queue, body.cache_salt)
        rid = rids[0]
        if body.stream:
            return _AbortingStream(stream_completion(body, rid, rids, queue, prompts, texts, no_generation),
                                   lambda: loop.abort(rids))
        outs = await collect(request, queue, rids)
        choices, n_prompt, n_gen = [], 0, 0
        for i, (out, ids, text) in enumerate(zip(outs, prompts, texts, strict=True)):
            gen_ids = [] if no_generation else out.token_ids
            gen_text = "" if no_generation else out.text
            n_prompt, n_gen = n_prompt + len(ids), n_gen + len(gen_ids)
            lp = None
            if body.logprobs is not None:
                gen_lps = [] if no_generation else list(out.logprobs or [])[: len(gen_ids)]
                if body.echo:
                    lp = tokens.completion_logprobs(ids + gen_ids, list(out.prompt_logprobs or [None]) + gen_lps,
                                                    offsets_from=(len(ids), len(text)))
                else:
                    lp = tokens.completion_logprobs(gen_ids, gen_lps)
            choices.append({"index": i, "text": (text if body.echo else "") + gen_text, "logprobs": lp,
                            "finish_reason": "length" if no_generation else out.finish_reason})
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": choices,
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}}

    async def stream_completion(body: CompletionRequest, rid: str, rids: list[str], queue: asyncio.Queue,
                                prompts: list[list[int]], texts: list[str], no_generation: bool):
        sent_text = [""] * len(rids)
        sent_tokens = [0] * len(rids)
        echoed = [False] * len(rids)
        done, n_gen = 0, 0

        def chunk(index: int, text: str, logprobs: dict | None, finish: str | None) -> str:
            return _sse({"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                         "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]})

        while done < len(rids):
            index, out = await next_output(queue)
            if isinstance(out, APIError):
                yield _sse(error_body(out.status, out.message, out.code))
                break
            pieces, lp_ids, lp_vals = "", [], []
            if body.echo and not echoed[index] and (out.prompt_logprobs is None or out.finished
                                                    or len(out.prompt_logprobs) >= len(prompts[index])):
                echoed[index] = True
                pieces = texts[index]
                lp_ids, lp_vals = list(prompts[index]), list(out.prompt_logprobs or [None])[: len(prompts[index])]
            if not no_generation:
                safe = _holdback(out.text, body.stop or [], out.finished)
                if len(safe) > len(sent_text[index]):
                    pieces += safe[len(sent_text[index]):]
                    sent_text[index] = safe
                new_ids = out.token_ids[sent_tokens[index]:]
                lp_ids += new_ids
                lp_vals += list(out.logprobs or [])[sent_tokens[index]: sent_tokens[index] + len(new_ids)]
                sent_tokens[index] += len(new_ids)
            finish = None
            if out.finished:
                done += 1
                n_gen += 0 if no_generation else len(out.token_ids)
                finish = "length" if no_generation else out.finish_reason
            if pieces or finish:
                lp = tokens.completion_logprobs(lp_ids, lp_vals) if body.logprobs is not None else None
                yield chunk(index, pieces, lp, finish)
        else:
            if body.include_usage:
                n_prompt = sum(len(p) for p in prompts)
                yield _sse({"id": rid, "object": "text_completion", "created": int(time.time()),
                            "model": model_name, "choices": [],
                            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen,
                                      "total_tokens": n_prompt + n_gen}})
        yield "data: [DONE]\n\n"

    # ---- chat ----------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        tenant = tenant_of(request)
        body = await _parse(request, ChatCompletionRequest)
        check_model(body.model)
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"the model `{model_name}` has no chat template; use /v1/completions")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=body.add_generation_prompt)
        except Exception as exc:  # the template's own checks (e.g. role order) are the client's problem
            raise APIError(400, f"the chat template rejected the messages: {exc}") from exc
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        limit = body.token_limit
        if limit == 0:
            raise APIError(400, "max_tokens must be at least 1 for chat completions")
        if limit is None:
            limit = engine.max_model_len - len(ids)
            if limit < 1:
                raise APIError(400, f"this model's maximum context length is {engine.max_model_len} tokens and "
                               f"the messages take {len(ids)}", "context_length_exceeded")
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling(body, limit, top, None)
        queue: asyncio.Queue = asyncio.Queue()
        rids = loop.submit([ids], params, tenant, queue, body.cache_salt)
        rid = rids[0].replace("cmpl-", "chatcmpl-", 1)
        if body.stream:
            return _AbortingStream(stream_chat(body, rid, queue, len(ids)), lambda: loop.abort(rids))
        out = (await collect(request, queue, rids))[0]
        logprobs = None
        if body.logprobs:
            logprobs = {"content": tokens.chat_logprobs(out.token_ids, list(out.logprobs or []))}
        n_gen = len(out.token_ids)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                             "logprobs": logprobs, "finish_reason": out.finish_reason}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": n_gen, "total_tokens": len(ids) + n_gen}}

    async def stream_chat(body: ChatCompletionRequest, rid: str, queue: asyncio.Queue, n_prompt: int):
        def chunk(delta: dict, logprobs: list | None = None, finish: str | None = None) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": None if logprobs is None else {"content": logprobs},
                      "finish_reason": finish}
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                         "model": model_name, "choices": [choice]})

        yield chunk({"role": "assistant", "content": ""})
        sent_text, sent_tokens = "", 0
        while True:
            _, out = await next_output(queue)
            if isinstance(out, APIError):
                yield _sse(error_body(out.status, out.message, out.code))
                break
            safe = _holdback(out.text, body.stop or [], out.finished)
            piece = safe[len(sent_text):] if len(safe) > len(sent_text) else ""
            sent_text = safe if piece else sent_text
            lps = None
            if body.logprobs:
                new_ids = out.token_ids[sent_tokens:]
                lps = tokens.chat_logprobs(new_ids, list(out.logprobs or [])[sent_tokens: sent_tokens + len(new_ids)])
                sent_tokens += len(new_ids)
            if piece or out.finished:
                yield chunk({"content": piece} if piece else {}, lps, out.finish_reason if out.finished else None)
            if out.finished:
                if body.include_usage:
                    n_gen = len(out.token_ids)
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                                "model": model_name, "choices": [],
                                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen,
                                          "total_tokens": n_prompt + n_gen}})
                break
        yield "data: [DONE]\n\n"

    # ---- the rest ------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(request: Request):
        tenant_of(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "quantgate", "version": version,
                                            "max_model_len": engine.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        tenant_of(request)
        body = await _parse(request, TokenizeRequest)
        check_model(body.model)
        ids = encode(body.prompt, body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        tenant_of(request)
        body = await _parse(request, DetokenizeRequest)
        check_model(body.model)
        bad = [t for t in body.tokens if t >= engine.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is not in the vocabulary (0..{engine.vocab_size - 1})")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        tenant_of(request)
        return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
                "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
                "chat_template": getattr(tokenizer, "chat_template", None),
                "model_max_length": engine.max_model_len}

    @app.get("/health")
    async def health():
        if not loop.alive:
            raise APIError(503, "the engine loop is not running", "engine_down")
        if loop.draining:
            raise APIError(503, "the server is shutting down", "server_shutting_down")
        return {"status": "ok", "model": model_name, "version": version}

    @app.get("/metrics")
    async def prometheus_metrics(request: Request):
        if tenants is not None or metrics_key is not None:  # per-tenant series are not for tenants to read
            scheme, _, key = request.headers.get("authorization", "").partition(" ")
            if metrics_key is None:
                raise APIError(401, "/metrics needs the metrics key and this server has none: set `metrics_key` "
                               "in the API-keys file or --metrics-key", "no_metrics_key")
            if not key_matches(metrics_key, key.strip() if scheme.lower() == "bearer" else None):
                raise APIError(401, "/metrics needs `Authorization: Bearer <metrics key>` (a tenant's API key "
                               "is not one)", "invalid_metrics_key")
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


# ---- running it --------------------------------------------------------------------------------
def _drain_on_signals(loop: EngineLoop, timeout: float) -> Callable[[], None]:
    """Put a drain in front of the SIGTERM/SIGINT handlers the ASGI server installed (uvicorn's start its
    graceful shutdown: close the socket, wait for open responses). Only the main thread can handle signals;
    elsewhere (tests' ServerThread) nothing changes. Returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    installed: dict[int, tuple[Callable, Callable]] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)
        if not callable(previous):
            continue

        def handler(signum, frame, previous=previous):
            loop.drain(timeout)
            previous(signum, frame)

        signal.signal(sig, handler)
        installed[sig] = (handler, previous)

    def restore() -> None:
        for sig, (handler, previous) in installed.items():
            if signal.getsignal(sig) is handler:
                signal.signal(sig, previous)

    return restore


class ServerThread:
    """Run an ASGI app with uvicorn on a free loopback port in a background thread (tests, benchmarks)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start within {timeout} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
