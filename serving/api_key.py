"""The API key (`--api-key`, SPECRL_API_KEY): when one is set, the OpenAI routes (/v1/*) and
/tokenize, /detokenize need `Authorization: Bearer <key>` (compared in constant time); a missing
or wrong key gets 401 in OpenAI's shape (`code: invalid_api_key`). /health, /ping, /metrics and
/version stay open; the admin routes have their own token (`admin_api.require_admin`), which the
API key never stands in for.

An ASGI middleware, so that the check comes before anything reads the body: an unauthenticated
request learns nothing, not even whether its JSON parses.
"""

from __future__ import annotations

import hmac
import json

from specrl.serving.protocol import error_body

def guarded(path: str) -> bool:
    """The paths the API key guards."""
    return path == "/v1" or path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


class ApiKeyCheck:
    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not guarded(scope["path"]):
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key):
            return await self.app(scope, receive, send)
        message = "missing API key: send 'Authorization: Bearer <key>'" if not header else "invalid API key"
        body = json.dumps(error_body(message, "invalid_request_error", code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
