"""Errors to OpenAI-shaped JSON, in one place, and the request-body limit.

`SpecrlError`s carry their HTTP status and error type (specrl.errors); pydantic's validation
errors become 400 naming the field; anything unexpected is a 500 with the details in the log only.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specrl.errors import SpecrlError
from specrl.serving.protocol import error_body

log = logging.getLogger("specrl.serving")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SpecrlError)
    async def specrl_error(request: Request, exc: SpecrlError):
        headers = {"Retry-After": "1"} if exc.http_status == 429 else None
        return JSONResponse(error_body(exc.message, exc.error_type, exc.param), status_code=exc.http_status,
                            headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = field_path(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            message, loc = "the request body is not valid JSON", []
        elif first.get("type") == "extra_forbidden":
            message = f"unsupported parameter: {'.'.join(loc)}"
        else:
            message = f"{'.'.join(loc) or 'body'}: {first.get('msg')}"
        return JSONResponse(error_body(message, "invalid_request_error", ".".join(loc) or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body("internal error; see the server log", "server_error"), status_code=500)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def field_path(loc) -> list[str]:
    """pydantic's error location -> the field path a person reads (`messages.0.role`): without the leading
    `body`, the tags pydantic gives the members of a union (`prompt.list[constrained-int]`, `stop.str`) and dict
    keys (a logit_bias key is data, not a field)."""
    path = []
    for part in loc:
        if isinstance(part, int):
            path.append(str(part))
        elif part != "body" and part.isidentifier() and part not in _TYPE_TAGS:
            path.append(part)
    return path


class BodyLimit:
    """ASGI middleware: refuse request bodies over `limit` bytes with 413, whether or not
    Content-Length is sent."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._refuse(send)

    async def _refuse(self, send):
        body = json.dumps(error_body(f"request body over {self.limit} bytes", "invalid_request_error")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
