"""A request carried whole to an app in process (`serving.forwarding`): the text a router keys on, and the app's
response streamed back message by message, its errors raised, a departed caller seen as a disconnect."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from specrl.serving.forwarding import ForwardedRequest, prompt_text


def chat(*messages) -> bytes:
    return json.dumps({"model": "m", "messages": list(messages)}).encode()


def test_prompt_text_is_the_context_in_order_and_empty_for_what_computes_nothing():
    system = {"role": "system", "content": "You are terse."}
    parts = {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}
    assert prompt_text("/v1/chat/completions", chat(system, parts)) == "system: You are terse.\nuser: Hi there"
    assert prompt_text("/v1/completions", json.dumps({"prompt": "Once upon"}).encode()) == "Once upon"
    assert prompt_text("/v1/completions", json.dumps({"prompt": ["first", "second"]}).encode()) == "first"
    assert prompt_text("/v1/completions", json.dumps({"prompt": [1, 2, 3]}).encode()) == "[1, 2, 3]"
    assert prompt_text("/admin/swap", json.dumps({"prompt": "x"}).encode()) == ""
    assert prompt_text("/v1/chat/completions", b"{not json") == ""
    assert prompt_text("/v1/chat/completions", b"[1]") == ""
    scope = {"method": "GET", "path": "/v1/completions", "headers": []}
    assert ForwardedRequest.from_scope(scope, b'{"prompt": "x"}').prefix_text == ""  # only a POST computes


def app_under_test() -> tuple[FastAPI, dict]:
    app, seen = FastAPI(), {"closed": asyncio.Event()}

    @app.post("/echo")
    async def echo(request: Request):
        return {"body": (await request.body()).decode(), "query": request.url.query,
                "header": request.headers.get("x-test")}

    @app.get("/stream")
    async def stream():
        async def events():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                seen["closed"].set()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/boom")
    async def boom():
        raise RuntimeError("boom")

    return app, seen


def forwarded(method: str, path: str, body: bytes = b"", query: bytes = b"") -> ForwardedRequest:
    return ForwardedRequest.from_scope({"method": method, "path": path, "query_string": query,
                                        "headers": [(b"x-test", b"yes"), (b"content-type", b"application/json")],
                                        "client": ("127.0.0.1", 5)}, body)


def test_the_apps_response_comes_back_as_its_send_messages():
    from specrl.serving.forwarding import run_app

    async def go():
        app, _ = app_under_test()
        return [m async for m in run_app(app, forwarded("POST", "/echo", b"hello", b"a=1"))]

    messages = asyncio.run(go())
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 200
    body = b"".join(m.get("body", b"") for m in messages[1:])
    assert json.loads(body) == {"body": "hello", "query": "a=1", "header": "yes"}


def test_a_caller_that_stops_reading_ends_the_apps_stream():
    from specrl.serving.forwarding import run_app

    async def go():
        app, seen = app_under_test()
        stream = run_app(app, forwarded("GET", "/stream"))
        chunks = []
        async for message in stream:
            chunks.append(message)
            if len(chunks) == 4:
                break
        await stream.aclose()  # what Serve does when the client went away
        await asyncio.wait_for(seen["closed"].wait(), timeout=5)  # the generator was closed, not left running
        return chunks

    chunks = asyncio.run(go())
    assert chunks[1]["body"] == b"data: 0\n\n"


def test_an_app_that_raises_raises_in_the_caller():
    from specrl.serving.forwarding import run_app

    async def go():
        app, _ = app_under_test()
        return [m async for m in run_app(app, forwarded("GET", "/boom"))]

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(go())
