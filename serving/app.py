"""The HTTP app: OpenAI-compatible generation and vLLM's /tokenize, /detokenize (`openai_api`), the
admin weights API (`admin_api`), health (/health, and vLLM's /ping), /version and Prometheus
metrics. Errors become OpenAI-shaped JSON in one place (`error_handlers`); with an API key set,
`api_key.ApiKeyCheck` guards the OpenAI and tokenizer routes.

The serving loop (`specrl.serving.loop.ServingLoop`: the native engine's thread or vLLM) runs the
model; handlers only submit and await. What the routes share lives on `app.state`: `loop`,
`settings`, `store`, `durable` (where a version this store lacks is pulled from, with Ray's object store:
`weights.object_store`), `versions` (the deployment's current versions), `metrics`, `swap_lock`. With
`follow_current`, a `Follower` keeps this replica on the deployment's current versions.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specrl import __version__
from specrl.config import Settings
from specrl.serving import admin_api, openai_api
from specrl.serving.api_key import ApiKeyCheck
from specrl.serving.error_handlers import BodyLimit, install_error_handlers
from specrl.serving.follower import Follower
from specrl.serving.loop import ServingLoop
from specrl.serving.metrics import ServerMetrics
from specrl.serving.protocol import ERRORS, ERRORS_AS_JSON
from specrl.weights import WeightsStore
from specrl.weights.deployment import DeploymentVersions
from specrl.weights.object_store import DurableStore

_EMPTY_200 = {200: {"description": "alive (an empty body)", "content": {}}, **ERRORS_AS_JSON}


def create_app(loop: ServingLoop, settings: Settings, store: WeightsStore) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await loop.ready()
        if follower is not None:
            await follower.start()  # serves current before it takes a request
        yield
        if follower is not None:
            await follower.stop()
        # uvicorn has stopped accepting and waited for open requests (SIGTERM): finish the rest.
        await asyncio.to_thread(loop.stop, settings.shutdown_timeout)
        versions.close()

    # Every 4xx is OpenAI-shaped (protocol.ERRORS), never FastAPI's 422, and the document says so.
    app = FastAPI(title="specrl", version=__version__, lifespan=lifespan, responses=ERRORS)
    app.state.loop, app.state.settings, app.state.store = loop, settings, store
    app.state.durable = DurableStore(settings.durable_store) if settings.durable_store else None
    app.state.metrics, app.state.swap_lock = ServerMetrics(loop), asyncio.Lock()
    app.state.versions = versions = DeploymentVersions(store, settings.redis_url, settings.deployment,
                                                       wait_s=settings.follow_interval_s)
    follower = Follower(app.state, versions) if settings.follow_current else None
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyCheck, key=settings.api_key)  # added last: runs first, before the body is read
    app.include_router(openai_api.router)
    app.include_router(openai_api.tokens_router)
    app.include_router(admin_api.router)

    @app.get("/health")
    async def health():
        """Alive and ready: 200 once this replica serves the deployment's current versions (or is behind them
        for a stated reason, see `follower`); 503 while it starts (it must not take traffic yet) or if dead."""
        if not loop.alive:
            return JSONResponse({"status": "dead", "error": repr(loop.error)}, status_code=503)
        state = follower.health() if follower is not None else {"ready": True}
        body = {"status": "ok" if state["ready"] else "starting", "target_version": loop.target_version,
                "drafter_version": loop.drafter_version, **state}
        return body if state["ready"] else JSONResponse(body, status_code=503)

    @app.get("/ping", response_class=Response, operation_id="ping_get", responses=_EMPTY_200)
    @app.post("/ping", response_class=Response, operation_id="ping_post", responses=_EMPTY_200)
    async def ping():
        """vLLM's (SageMaker's) liveness probe: 200 with an empty body, 503 when the engine died."""
        return Response(status_code=200 if loop.alive else 503)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse, responses=ERRORS_AS_JSON)
    async def prometheus():
        return PlainTextResponse(generate_latest(app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
