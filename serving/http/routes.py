"""The OpenAI-compatible routes, on an APIRouter; the tenant (from the API key) is a dependency.

Every route reads the app's `ServingContext` (`app.state.serving`): the engine, its loop, the names it
serves under and the tenants table. Completions and chat stream with SSE or answer in one body.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from serving.core.engine import RequestOutput
from serving.core.sampling_params import SamplingParams
from serving.http import openai_format as fmt
from serving.http.context import ServingContext
from serving.http.engine_loop import DISCONNECT_POLL_S, ENGINE_STOPPED, EngineLoop
from serving.http.http_body import parse_json_object, read_body
from serving.http.metric_buckets import CONTENT_TYPE
from serving.http.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    describe_validation_errors,
)
from serving.http.streams import AbortingStream, stream_chat, stream_completion
from serving.http.tenants import DEFAULT_TENANT, key_matches

MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6


async def serving(request: Request) -> ServingContext:
    """Async, as every dependency here: a sync one would hop to a thread before the body is read, and a
    client that sends its request and hangs up at once would be gone before it was ever queued."""
    return request.app.state.serving


async def tenant_of(request: Request) -> str:
    """The tenant whose API key the request bears (401 without one); the default tenant without tenants."""
    tenants = request.app.state.serving.tenants
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


Tenant = Annotated[str, Depends(tenant_of)]
Context = Annotated[ServingContext, Depends(serving)]
router = APIRouter()


async def parse(request: Request, model: type[BaseModel]) -> BaseModel:
    data = parse_json_object(await read_body(request))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors())
        raise APIError(400, message, param=param) from exc


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


async def collect(request: Request, loop: EngineLoop, queue: asyncio.Queue, rids: list[str]) -> list[RequestOutput]:
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


# ---- completions -------------------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(request: Request, tenant: Tenant, ctx: Context):
    body = await parse(request, CompletionRequest)
    ctx.check_model(body.model)
    raw = body.prompts()
    prompts = [ctx.encode(p) for p in raw]
    texts = [p if isinstance(p, str) else ctx.tokenizer.decode(ids) for p, ids in zip(raw, prompts, strict=True)]
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    no_generation = max_tokens == 0  # lm-eval's scoring call: run one token, report none
    want_prompt_lps = body.echo and body.logprobs is not None
    params = sampling(body, max(1, max_tokens), body.logprobs, body.logprobs if want_prompt_lps else None)
    queue: asyncio.Queue = asyncio.Queue()
    rids = ctx.loop.submit(prompts, params, tenant, queue, body.cache_salt)
    if body.stream:
        return AbortingStream(stream_completion(ctx, body, rids, queue, prompts, texts, no_generation),
                              lambda: ctx.loop.abort(rids))
    outs = await collect(request, ctx.loop, queue, rids)
    choices, n_prompt, n_gen = [], 0, 0
    for i, (out, ids, text) in enumerate(zip(outs, prompts, texts, strict=True)):
        gen_ids = [] if no_generation else out.token_ids
        n_prompt, n_gen = n_prompt + len(ids), n_gen + len(gen_ids)
        lp = None
        if body.logprobs is not None:
            gen_lps = [] if no_generation else list(out.logprobs or [])[: len(gen_ids)]
            if body.echo:
                lp = ctx.tokens.completion_logprobs(ids + gen_ids, list(out.prompt_logprobs or [None]) + gen_lps,
                                                    offsets_from=(len(ids), len(text)))
            else:
                lp = ctx.tokens.completion_logprobs(gen_ids, gen_lps)
        gen_text = "" if no_generation else out.text
        choices.append(fmt.completion_choice(i, (text if body.echo else "") + gen_text, lp,
                                             "length" if no_generation else out.finish_reason))
    return fmt.envelope(rids[0], "text_completion", ctx.model_name, choices, (n_prompt, n_gen))


# ---- chat --------------------------------------------------------------------------------------
def chat_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    if not getattr(ctx.tokenizer, "chat_template", None):
        raise APIError(400, f"the model `{ctx.model_name}` has no chat template; use /v1/completions")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        prompt = ctx.tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=body.add_generation_prompt)
    except Exception as exc:  # the template's own checks (e.g. role order) are the client's problem
        raise APIError(400, f"the chat template rejected the messages: {exc}") from exc
    return ctx.tokenizer.encode(prompt, add_special_tokens=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, tenant: Tenant, ctx: Context):
    body = await parse(request, ChatCompletionRequest)
    ctx.check_model(body.model)
    ids = chat_prompt(ctx, body)
    limit = body.token_limit
    if limit == 0:
        raise APIError(400, "max_tokens must be at least 1 for chat completions")
    if limit is None:
        limit = ctx.engine.max_model_len - len(ids)
        if limit < 1:
            raise APIError(400, f"this model's maximum context length is {ctx.engine.max_model_len} tokens and "
                           f"the messages take {len(ids)}", "context_length_exceeded")
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling(body, limit, top, None)
    queue: asyncio.Queue = asyncio.Queue()
    rids = ctx.loop.submit([ids], params, tenant, queue, body.cache_salt)
    rid = rids[0].replace("cmpl-", "chatcmpl-", 1)
    if body.stream:
        return AbortingStream(stream_chat(ctx, body, rid, queue, len(ids)), lambda: ctx.loop.abort(rids))
    out = (await collect(request, ctx.loop, queue, rids))[0]
    logprobs = ctx.tokens.chat_logprobs(out.token_ids, list(out.logprobs or [])) if body.logprobs else None
    return fmt.envelope(rid, "chat.completion", ctx.model_name,
                        [fmt.chat_choice(out.text, logprobs, out.finish_reason)], (len(ids), len(out.token_ids)))


# ---- the rest ----------------------------------------------------------------------------------
@router.get("/v1/models")
async def models(tenant: Tenant, ctx: Context):
    return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": ctx.created,
                                        "owned_by": "quantgate", "version": ctx.version,
                                        "max_model_len": ctx.engine.max_model_len}]}


@router.post("/tokenize")
async def tokenize(request: Request, tenant: Tenant, ctx: Context):
    body = await parse(request, TokenizeRequest)
    ctx.check_model(body.model)
    ids = ctx.encode(body.prompt, body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": ctx.engine.max_model_len}


@router.post("/detokenize")
async def detokenize(request: Request, tenant: Tenant, ctx: Context):
    body = await parse(request, DetokenizeRequest)
    ctx.check_model(body.model)
    ctx.check_vocab(body.tokens)
    return {"prompt": ctx.tokenizer.decode(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(tenant: Tenant, ctx: Context):
    tok = ctx.tokenizer
    return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
            "pad_token": tok.pad_token, "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": ctx.engine.max_model_len}


@router.get("/health")
async def health(ctx: Context):
    if not ctx.loop.alive:
        raise APIError(503, "the engine loop is not running", "engine_down")
    if ctx.loop.draining:
        raise APIError(503, "the server is shutting down", "server_shutting_down")
    return {"status": "ok", "model": ctx.model_name, "version": ctx.version}


@router.get("/metrics")
async def prometheus_metrics(request: Request, ctx: Context):
    if ctx.tenants is not None or ctx.metrics_key is not None:  # per-tenant series are not for tenants to read
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if ctx.metrics_key is None:
            raise APIError(401, "/metrics needs the metrics key and this server has none: set `metrics_key` "
                           "in the API-keys file or --metrics-key", "no_metrics_key")
        if not key_matches(ctx.metrics_key, key.strip() if scheme.lower() == "bearer" else None):
            raise APIError(401, "/metrics needs `Authorization: Bearer <metrics key>` (a tenant's API key "
                           "is not one)", "invalid_metrics_key")
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)
