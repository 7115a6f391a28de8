"""One HTTP request carried whole from a front to a replica's app, and its response back as ASGI messages.

On Ray Serve the proxy streams a request's body to the deployment it calls, so a router choosing between replicas
sees no body and cannot route on the prompt. The fleet's front (`serving.ray_replicas`) therefore reads the body,
packs it with the request line and headers into a `ForwardedRequest` (which names the text a prefix-affinity router
keys on), and calls a replica through a Serve handle; the replica runs the request through its own FastAPI app in
process (`run_app`) and streams the app's ASGI `send` messages back, which the front sends on unchanged: status,
headers, server-sent events and errors are the app's own.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from functools import cached_property
from typing import AsyncIterator

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
_RUNNING: set[asyncio.Task] = set()  # asyncio holds tasks weakly: an app still finishing after its caller left stays here


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request read whole by the front. prefix_text: what its answer's KV starts from (the chat messages'
    roles and contents in order, or the completion prompt), "" for requests that compute nothing."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None

    @classmethod
    def from_scope(cls, scope: dict, body: bytes) -> "ForwardedRequest":
        client = scope.get("client")
        return cls(scope["method"], scope["path"], scope.get("query_string", b""),
                   tuple((bytes(k), bytes(v)) for k, v in scope.get("headers", ())), body,
                   tuple(client) if client else None)

    @cached_property  # read by the router at each try and after routing
    def prefix_text(self) -> str:
        return prompt_text(self.path, self.body) if self.method == "POST" else ""

    def scope(self) -> dict:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                "query_string": self.query_string, "root_path": "", "headers": list(self.headers),
                "client": self.client, "server": None}


def prompt_text(path: str, body: bytes) -> str:
    """The text a generation request's context starts with, in order ("" for other paths and for bodies that do not
    parse: the app answers those with its own 4xx, wherever they land). Chat: each message as `role: content`
    (content parts' text joined); completions: the prompt (token ids as their JSON), the first of a batch."""
    if path not in GENERATION_PATHS:
        return ""
    try:
        request = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(request, dict):
        return ""
    if path == "/v1/completions":
        prompt = request.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of prompts: the first (a list of ints is one prompt of token ids)
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    messages = request.get("messages")
    if not isinstance(messages, list):
        return ""
    return "\n".join(f"{m.get('role', '')}: {_content_text(m.get('content'))}" for m in messages if isinstance(m, dict))


def _content_text(content) -> str:
    if isinstance(content, list):  # content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


async def run_app(app, request: ForwardedRequest) -> AsyncIterator[dict]:
    """Run `request` through the ASGI `app` in this process -> the app's `send` messages as it sends them. The body
    arrives in one message; once the caller stops reading (the client went away), the app's next receive returns
    http.disconnect, which aborts a streaming generation the way a closed connection does."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.put_nowait(message)

    done = object()
    task = asyncio.ensure_future(app(request.scope(), receive, send))
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    task.add_done_callback(lambda _: sent.put_nowait(done))
    try:
        while (message := await sent.get()) is not done:
            yield message
        task.result()  # an app that raised: the caller's error, not a silent empty response
    finally:
        gone.set()  # the app finishes on its own (a stream it was sending ends at its next disconnect check)
