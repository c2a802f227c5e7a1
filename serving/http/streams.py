"""Server-sent-event streams of completions and chat completions, as OpenAI streams them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from serving.http import openai_format as fmt
from serving.http.context import ServingContext
from serving.http.protocol import APIError, ChatCompletionRequest, CompletionRequest


class AbortingStream(StreamingResponse):
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


async def stream_completion(ctx: ServingContext, body: CompletionRequest, rids: list[str], queue: asyncio.Queue,
                            prompts: list[list[int]], texts: list[str], no_generation: bool) -> AsyncIterator[str]:
    rid = rids[0]
    sent_text = [""] * len(rids)
    sent_tokens = [0] * len(rids)
    echoed = [False] * len(rids)
    done, n_gen = 0, 0
    while done < len(rids):
        index, out = await ctx.loop.next_output(queue)
        if isinstance(out, APIError):
            yield fmt.error_event(out)
            break
        pieces, lp_ids, lp_vals = "", [], []
        if body.echo and not echoed[index] and (out.prompt_logprobs is None or out.finished
                                                or len(out.prompt_logprobs) >= len(prompts[index])):
            echoed[index] = True
            pieces = texts[index]
            lp_ids, lp_vals = list(prompts[index]), list(out.prompt_logprobs or [None])[: len(prompts[index])]
        if not no_generation:
            safe = fmt.holdback(out.text, body.stop or [], out.finished)
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
            lp = ctx.tokens.completion_logprobs(lp_ids, lp_vals) if body.logprobs is not None else None
            yield fmt.sse(fmt.envelope(rid, "text_completion", ctx.model_name,
                                       [fmt.completion_choice(index, pieces, lp, finish)]))
    else:
        if body.include_usage:
            n_prompt = sum(len(p) for p in prompts)
            yield fmt.sse(fmt.envelope(rid, "text_completion", ctx.model_name, [], (n_prompt, n_gen)))
    yield fmt.DONE


async def stream_chat(ctx: ServingContext, body: ChatCompletionRequest, rid: str, queue: asyncio.Queue,
                      n_prompt: int) -> AsyncIterator[str]:
    def chunk(choices: list[dict], n_tokens: tuple[int, int] | None = None) -> str:
        return fmt.sse(fmt.envelope(rid, "chat.completion.chunk", ctx.model_name, choices, n_tokens))

    yield chunk([fmt.chat_delta({"role": "assistant", "content": ""}, None, None)])
    sent_text, sent_tokens = "", 0
    while True:
        _, out = await ctx.loop.next_output(queue)
        if isinstance(out, APIError):
            yield fmt.error_event(out)
            break
        safe = fmt.holdback(out.text, body.stop or [], out.finished)
        piece = safe[len(sent_text):] if len(safe) > len(sent_text) else ""
        sent_text = safe if piece else sent_text
        lps = None
        if body.logprobs:
            new_ids = out.token_ids[sent_tokens:]
            lps = ctx.tokens.chat_logprobs(new_ids, list(out.logprobs or [])[sent_tokens: sent_tokens + len(new_ids)])
            sent_tokens += len(new_ids)
        if piece or out.finished:
            yield chunk([fmt.chat_delta({"content": piece} if piece else {}, lps,
                                        out.finish_reason if out.finished else None)])
        if out.finished:
            if body.include_usage:
                yield chunk([], (n_prompt, len(out.token_ids)))
            break
    yield fmt.DONE
