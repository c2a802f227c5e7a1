"""The error handlers every quantgate app installs: OpenAI-shaped JSON bodies for every failure."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.http.protocol import APIError, error_body


def install_error_handlers(app: FastAPI, log: logging.Logger) -> None:
    """APIError as its status and body, 404/405 naming the path, anything else a logged 500."""

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
