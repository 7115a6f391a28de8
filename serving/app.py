"""The HTTP app: OpenAI-compatible generation, health, metrics and the admin (weights) API.

Errors are mapped to OpenAI-shaped JSON in one place (`_install_error_handlers`). The engine
runs on its own thread (`EngineLoop`); handlers only submit and await.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from specrl.config import Settings
from specrl.errors import (AuthError, ForbiddenError, InvalidRequestError, ModelNotFoundError, SpecrlError, SwapError,
                           SwapInProgressError)
from specrl.serving.engine_loop import EngineLoop
from specrl.serving.generation import ChoiceStream, run_choices
from specrl.serving.metrics import ServerMetrics
from specrl.serving.protocol import (ChatCompletionRequest, CompletionRequest, error_body, fingerprint, new_id, now,
                                     usage)
from specrl.serving.swap import MODES, ROLES
from specrl.weights import WeightsStore

log = logging.getLogger("specrl.serving")


class SwapBody(BaseModel):
    role: str
    version: str
    mode: str = "drain"


class RollbackBody(BaseModel):
    role: str
    mode: str = "drain"


def create_app(loop: EngineLoop, settings: Settings, store: WeightsStore, sink=None) -> FastAPI:
    """`loop`: the native `EngineLoop` or the vLLM backend's `VllmLoop` (the same interface)."""
    metrics = ServerMetrics(loop, sink)
    swap_lock = asyncio.Lock()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await loop.ready()
        yield
        # uvicorn has stopped accepting and waited for open requests (SIGTERM): finish the rest.
        await asyncio.to_thread(loop.stop, settings.shutdown_timeout)
        if sink is not None and hasattr(sink, "close"):
            await asyncio.to_thread(sink.close, 5.0)

    app = FastAPI(title="specrl", lifespan=lifespan)
    app.state.loop, app.state.metrics = loop, metrics
    _install_error_handlers(app)
    app.add_middleware(_BodyLimit, limit=settings.max_body_bytes)

    def check_model(name: str) -> None:
        if name != settings.model:
            raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves {settings.model!r}")

    @app.get("/health")
    async def health():
        if not loop.alive:
            return JSONResponse({"status": "dead", "error": repr(loop.error)}, status_code=503)
        return {"status": "ok", "target_version": loop.target_version, "drafter_version": loop.drafter_version}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model, "object": "model", "created": 0,
                                            "owned_by": "specrl", "root": settings.model}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        body.check_supported()
        prompts = _completion_prompts(body.prompt, loop.tokenizer)
        streams = [ChoiceStream(loop.tokenizer, i * body.n + j, p, body.sampling(body.max_tokens, body.logprobs, j),
                                chat=False, return_token_ids=body.return_token_ids)
                   for i, p in enumerate(prompts) for j in range(body.n)]
        return await _respond(body, streams, "text_completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        body.check_supported()
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        prompt = list(loop.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        max_tokens = body.max_completion_tokens or body.max_tokens or settings.max_seq_len - len(prompt)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        streams = [ChoiceStream(loop.tokenizer, j, prompt, body.sampling(max_tokens, logprobs, j), chat=True,
                                return_token_ids=body.return_token_ids) for j in range(body.n)]
        return await _respond(body, streams, "chat.completion", request)

    async def _respond(body, streams: list[ChoiceStream], kind: str, request: Request):
        rid = new_id("chatcmpl" if kind == "chat.completion" else "cmpl")
        arrival = time.perf_counter()
        try:  # validation and saturation errors surface here, before any response starts
            for choice in streams:
                choice.submit(loop, f"{rid}-{choice.index}")
        except SpecrlError:
            for choice in streams:  # do not leave the choices already queued running for nobody
                if choice.seq is not None:
                    loop.abort(choice.request_id)
            raise
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(rid, kind, streams, include_usage, arrival), media_type="text/event-stream")
        await run_choices(loop, streams, metrics, arrival)
        metrics.requests.labels(kind, "ok").inc()
        return _final_body(rid, kind, streams)

    def _final_body(rid: str, kind: str, streams: list[ChoiceStream]) -> dict:
        prompt_tokens = sum({id(s.prompt_ids): len(s.prompt_ids) for s in streams}.values())
        completion_tokens = sum(len(s.token_ids) for s in streams)
        last, stats = streams[-1], _spec_stats(streams)
        return {"id": rid, "object": kind, "created": now(), "model": settings.model,
                "system_fingerprint": fingerprint(last.target_version, last.drafter_version),
                "choices": [s.final_choice() for s in streams],
                "usage": usage(prompt_tokens, completion_tokens),
                "specrl": stats, "metrics": {"speculative_decoding": stats["spec_decode"]}}

    async def _sse(rid, kind, streams, include_usage, arrival):
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
        events: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(run_choices(loop, streams, metrics, arrival, events))
        try:
            if kind == "chat.completion":
                for s in streams:
                    yield _sse_line(_chunk(rid, chunk_kind, s, {"role": "assistant", "content": ""}, None, None))
            done = 0
            while done < len(streams):
                choice, delta, logprobs, finish = await events.get()
                if choice is None:  # the run failed: report it in-band, then end the stream
                    yield _sse_line(error_body(str(delta), "server_error"))
                    break
                payload = ({"content": delta} if kind == "chat.completion" else delta)
                yield _sse_line(_chunk(rid, chunk_kind, choice, payload, logprobs, finish))
                done += finish is not None
            if include_usage:
                prompt_tokens = sum({id(s.prompt_ids): len(s.prompt_ids) for s in streams}.values())
                yield _sse_line({"id": rid, "object": chunk_kind, "created": now(), "model": settings.model,
                                 "system_fingerprint": fingerprint(streams[-1].target_version, streams[-1].drafter_version),
                                 "choices": [], "usage": usage(prompt_tokens, sum(len(s.token_ids) for s in streams)),
                                 "specrl": _spec_stats(streams)})
            yield "data: [DONE]\n\n"
            metrics.requests.labels(kind, "ok").inc()
        finally:
            task.cancel()

    def _chunk(rid, chunk_kind, choice: ChoiceStream, payload, logprobs, finish):
        entry = {"index": choice.index, "logprobs": logprobs, "finish_reason": finish}
        entry.update({"delta": payload} if chunk_kind == "chat.completion.chunk" else {"text": payload})
        return {"id": rid, "object": chunk_kind, "created": now(), "model": settings.model,
                "system_fingerprint": fingerprint(choice.target_version, choice.drafter_version), "choices": [entry]}

    # ---- admin: weights ----------------------------------------------------------------------
    def admin(request: Request) -> None:
        if not settings.admin_token:
            raise ForbiddenError("the admin API is disabled: set SPECRL_ADMIN_TOKEN to enable it")
        header = request.headers.get("authorization", "")
        if not header.startswith("Bearer "):
            raise AuthError("missing 'Authorization: Bearer <token>' header")
        if not hmac.compare_digest(header[7:].encode(), settings.admin_token.encode()):
            raise ForbiddenError("wrong admin token")

    @app.get("/admin/weights", dependencies=[Depends(admin)])
    async def list_weights():
        return {"serving": _serving(), "current": {r: store.current(r) for r in ROLES},
                "stored": {r: [m.to_dict() for m in store.versions(r)] for r in ROLES}}

    @app.post("/admin/weights", dependencies=[Depends(admin)])
    async def swap_weights(body: SwapBody):
        return await _swap(body.role, body.version, body.mode)

    @app.post("/admin/weights/rollback", dependencies=[Depends(admin)])
    async def rollback(body: RollbackBody):
        if body.role not in ROLES:
            raise SwapError(f"role must be one of {', '.join(ROLES)}, got {body.role!r}")
        serving = _serving()[body.role]
        parent = store.parent(body.role, serving)
        if parent is None:
            raise InvalidRequestError(f"{body.role} {serving} has no parent to roll back to")
        return await _swap(body.role, parent, body.mode)

    async def _swap(role: str, version: str, mode: str):
        if role not in ROLES:
            raise SwapError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if role == "policy" and mode not in MODES:
            raise SwapError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if role == "drafter" and not loop.has_drafter:
            raise SwapError("this server runs without a drafter (--drafter none)")
        if swap_lock.locked():
            raise SwapInProgressError("another swap is loading; retry when it is done")
        async with swap_lock:
            try:
                directory = await asyncio.to_thread(store.verify, role, version)
                result = await loop.swap(role, version, mode, directory)
                await asyncio.to_thread(store.set_current, role, version)
            except SpecrlError:
                metrics.swaps.labels(role, "failed").inc()
                raise
        metrics.swaps.labels(role, "ok").inc()
        log.info("swap role=%s version=%s mode=%s load_ms=%.1f swap_ms=%.1f", role, version, mode,
                 result.load_ms, result.swap_ms)
        return {"role": role, "version": version, "mode": mode, "load_ms": round(result.load_ms, 2),
                "swap_ms": round(result.swap_ms, 2), "serving": _serving()}

    def _serving() -> dict:
        return {"policy": loop.target_version, "drafter": loop.drafter_version}

    return app


def _spec_stats(streams: list[ChoiceStream]) -> dict:
    drafts = sum(s.drafts for s in streams)
    draft_tokens = sum(s.draft_tokens for s in streams)
    accepted = sum(s.accepted for s in streams)
    steps = sum(s.steps for s in streams)
    return {"target_version": streams[-1].target_version, "drafter_version": streams[-1].drafter_version,
            "versions": [s.version_runs for s in streams],
            "spec_decode": {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
                            "mean_acceptance_length": round((accepted + steps) / steps, 4) if steps else None}}


def _completion_prompts(prompt, tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if prompt and all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode(p) for p in prompt]
    if prompt and all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    raise InvalidRequestError("prompt must be a string, a list of strings, or token ids", param="prompt")


def _sse_line(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SpecrlError)
    async def specrl_error(request: Request, exc: SpecrlError):
        headers = {"Retry-After": "1"} if exc.http_status == 429 else None
        return JSONResponse(error_body(exc.message, exc.error_type, exc.param), status_code=exc.http_status,
                            headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
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


class _BodyLimit:
    """Refuse request bodies over `limit` bytes with 413, whether or not Content-Length is sent."""

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
