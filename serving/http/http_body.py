"""Reading a request body safely: a size limit, and JSON that is an object of valid text, or a 4xx."""

from __future__ import annotations

import json

from starlette.requests import ClientDisconnect, Request

from serving.http.protocol import APIError

MAX_BODY_BYTES = 32 * 2**20


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body, refused with 413 from its Content-Length or as soon as it grows past the limit."""
    too_big = APIError(413, f"request body over {limit} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 15 or int(declared) > limit):
        raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:  # hung up halfway through the body: nobody to answer, nothing to log as a 500
        raise APIError(499, "client disconnected before sending the whole body") from None
    return b"".join(chunks)


def parse_json_object(body: bytes, empty_ok: bool = False) -> dict:
    """The body as a JSON object; 400 for anything else (an empty body is {} when `empty_ok`)."""
    if empty_ok and not body.strip():
        return {}
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # also: invalid UTF-8, nesting too deep, a 5000-digit number
        raise APIError(400, f"the body is not valid JSON: {exc}", "invalid_json") from exc
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    if _has_lone_surrogate(data):
        raise APIError(400, "the body holds a string with a lone UTF-16 surrogate escape; it is not valid UTF-8 text",
                       "invalid_json")
    return data


def _has_lone_surrogate(data: object) -> bool:
    """JSON may escape half a UTF-16 pair (`"\\ud800"`); such a string is no text the tokenizer can take."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
