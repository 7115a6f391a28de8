"""`specrl serve`: assemble engine, telemetry sink, weights store and HTTP app; run uvicorn.

A (re)start serves the store's `current` versions when there are any, else the base model
and the drafter named in the settings.
"""

from __future__ import annotations

import logging
import sys

import uvicorn

from specrl.config import Settings
from specrl.engine.engine import Engine
from specrl.errors import SpecrlError
from specrl.serving.app import create_app
from specrl.serving.engine_loop import EngineLoop
from specrl.telemetry import MemorySink, RedisSink, events_stream
from specrl.telemetry.fleet import FleetFeed
from specrl.weights import WeightsStore

log = logging.getLogger("specrl.serving")


def build(settings: Settings):
    """-> (engine loop, app) ready to serve; nothing runs until the loop is started."""
    store = WeightsStore(settings.store_path)
    if settings.backend == "vllm":
        from specrl.serving.vllm.build import build_vllm_loop

        loop = build_vllm_loop(settings, store)
        return loop, create_app(loop, settings, store)
    if settings.backend != "native":
        raise SpecrlError(f"unknown backend {settings.backend!r}: use native or vllm")
    features = settings.record_features_max_bytes if settings.record_features else 0  # content off: the sink takes none
    sink = (RedisSink(settings.redis_url, events_stream(settings.deployment), maxlen=settings.telemetry_maxlen,
                      content=settings.telemetry_content, features_max_bytes=features)
            if settings.redis_url else MemorySink(capacity=10_000))
    engine = Engine.from_settings(settings, sink=sink, store=store)
    fleet = (FleetFeed(settings.redis_url, events_stream(settings.deployment), settings.replica, engine.suffix,
                       deployment=settings.deployment) if settings.redis_url and engine.suffix is not None else None)
    loop = EngineLoop(engine, telemetry=sink, fleet=fleet)
    return loop, create_app(loop, settings, store)


def serve(settings: Settings) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    loop, app = build(settings)
    loop.start()
    log.info("serving backend=%s model=%s target_version=%s drafter_version=%s url=http://%s:%d redis=%s",
             settings.backend, settings.model, loop.target_version, loop.drafter_version, settings.host, settings.port,
             settings.redis_url or "off")
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                            timeout_graceful_shutdown=int(settings.shutdown_timeout))
    server = _GracefulServer(config)
    # A dead engine cannot come back: exit non-zero so that a supervisor restarts the server.
    loop.on_death = lambda: setattr(server, "should_exit", True)
    server.run()
    if not server.started:  # the engine failed to start (lifespan error): uvicorn logged why
        return 1
    return 0 if loop.error is None else 1


class _GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM after its graceful shutdown, so the process would die of the
    signal; a completed graceful shutdown is a clean exit (status 0) for a supervisor."""

    def handle_exit(self, sig, frame):
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
