"""The server's replicas as one Ray Serve deployment behind a front (`specrl up --ray`).

Each replica (`Replica`) is the same FastAPI app `specrl serve` runs (`serving.server.build`: its own engine,
telemetry sink and follower), built inside the replica's process, so nothing of the engine is pickled; Serve runs
the app's lifespan before it marks the replica running, so a replica's follower has checked the deployment's
`current` before it takes traffic (a replica that restarts catches up first). With a durable store (`specrl up
--ray` sets one) a replica keeps its own store under `<home>/weights-cache/<replica>` and pulls each version it
must serve from Ray's object store, else the durable store (`weights.object_store`): no disk is shared with the
trainer. Every replica writes its records
under its own replica name (Serve's replica id) to the deployment's stream and follows `current` from Redis
(`serving.follower`): a swap pushed to one replica, or announced by a trainer, reaches all of them.

Serve's proxy hands each HTTP request to the front (`Front`, no CPU of its own), which reads the body and calls a
replica through a Serve handle with the whole request (`serving.forwarding`), so the handle's router sees the
prompt: `prefix` (`serving.ray_router.PrefixAffinityRouter`) sends a request to the replica that computed its
context's start, `pow2` is Serve's default (power of two choices on queue lengths). The replica runs the request
through its app and streams the app's response back unchanged. With `min_replicas < max_replicas` Serve
autoscales the replicas on ongoing requests. Needs the `[ray]` extra.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

from ray import serve
from ray.serve.config import RequestRouterConfig

from specrl.config import Settings
from specrl.serving.error_handlers import BodyLimit
from specrl.serving.forwarding import ForwardedRequest, run_app
from specrl.serving.protocol import error_body
from specrl.serving.ray_router import PrefixAffinityRouter

APP_NAME = "specrl"
ROUTERS = ("prefix", "pow2")
SCALE_DOWN_S = 600.0  # Serve's own default: a replica costs a model load; a lull shorter than this keeps it
log = logging.getLogger(__name__)


class Replica:
    """One engine behind `specrl serve`'s app, computing with `threads` torch threads. Its constructor runs the
    app's lifespan startup (engine loop, telemetry, the follower's first check of `current`), and Serve marks the
    replica running only after the constructor returns."""

    async def __init__(self, settings: Settings, threads: int):
        import torch

        from specrl.serving.server import build

        torch.set_num_threads(threads)
        name = f"ray-{serve.get_replica_context().replica_id.unique_id}"
        settings = settings.replace(replica=name, threads=threads)
        if settings.durable_store:  # its own copy of every version it serves, pulled (its node's disk on a cluster)
            settings = settings.replace(store=str(settings.home / "weights-cache" / name))
        loop, self.app = build(settings)
        loop.start()
        self.lifespan = contextlib.AsyncExitStack()
        await self.lifespan.enter_async_context(self.app.router.lifespan_context(self.app))

    async def forward(self, request: ForwardedRequest):
        """-> the app's ASGI send messages for `request`, as it sends them."""
        async for message in run_app(self.app, request):
            yield message

    async def __del__(self):  # Serve awaits it when it stops the replica (after its graceful shutdown)
        await self.lifespan.aclose()


@serve.ingress()
class Front:
    """Reads each request whole (at most max_body_bytes: BodyLimit answers 413 past it) and streams it through a
    replica chosen by the replicas' router."""

    def __init__(self, replicas, max_body_bytes: int):
        self.replicas, self.max_body_bytes = replicas.options(stream=True), max_body_bytes

    def __serve_build_asgi_app__(self):
        return BodyLimit(self.handle, self.max_body_bytes)

    async def handle(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":  # startup
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body, more = body + message.get("body", b""), message.get("more_body", False)
        started = False
        try:
            async for message in self.replicas.forward.remote(ForwardedRequest.from_scope(scope, body)):
                started = started or message["type"] == "http.response.start"
                await send(message)
        except Exception as exc:  # the replica died or Serve could not reach one: 503 if nothing was sent yet
            log.warning("forward failed path=%s error=%r", scope.get("path"), exc)
            if started:
                raise
            await _send_json(send, 503, error_body(f"no replica could answer: {exc}", "service_unavailable"))


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def replica_application(settings: Settings, replicas: int, max_replicas: int | None = None, router: str = "prefix",
                        target_ongoing_requests: float = 2.0, scale_down_s: float | None = None):
    """-> the Serve application: the front and `replicas` replicas (`max_replicas` > replicas: autoscaled between
    them on ongoing requests; a replica goes once the load has wanted fewer for `scale_down_s`, None: SCALE_DOWN_S),
    routed by `router` (ROUTERS). Each replica computes with settings.threads torch threads (>= 1) and asks Ray for
    as many CPUs."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)} (got {router!r})")
    threads = max(1, settings.threads)
    scaling = ({"autoscaling_config": {"min_replicas": replicas, "max_replicas": max_replicas,
                                       "target_ongoing_requests": target_ongoing_requests,
                                       "downscale_delay_s": SCALE_DOWN_S if scale_down_s is None else scale_down_s}}
               if max_replicas and max_replicas > replicas else {"num_replicas": replicas})
    # A hot prefix may queue on its replica up to a full batch more than the shortest queue before it moves.
    routing = ({"request_router_config": RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                             request_router_kwargs={"imbalance": settings.max_batch})}
               if router == "prefix" else {})
    server = serve.deployment(Replica, name="server", ray_actor_options={"num_cpus": threads},
                              max_ongoing_requests=max(8, 4 * settings.max_batch),
                              graceful_shutdown_timeout_s=settings.shutdown_timeout, **scaling, **routing)
    front = serve.deployment(Front, name="front", num_replicas=1, ray_actor_options={"num_cpus": 0},
                             max_ongoing_requests=10_000, graceful_shutdown_timeout_s=settings.shutdown_timeout)
    return front.bind(server.bind(settings, threads), settings.max_body_bytes)


def run_replicas(settings: Settings, replicas: int, max_replicas: int | None = None, address: str | None = None,
                 router: str = "prefix", cpus: float = 0, scale_down_s: float | None = None):
    """Join (address) or start a local Ray cluster, start Serve's proxy on settings.host:settings.port (on the head
    node only), deploy the front and the replicas and wait until Serve runs them all -> the proxy's URL. A local
    cluster is a new one (`address="local"`: never a cluster another program started on this machine, which
    `ray.init()` alone would join) with `cpus` Ray CPUs (0: one per thread of the replicas and of a trainer actor), at least the
    machine's cores. `stop_replicas` undoes it."""
    import ray

    if not ray.is_initialized():
        if address:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        else:
            cpus = cpus or ((max_replicas or replicas) + 1) * max(1, settings.threads)  # + a trainer
            ray.init(address="local", num_cpus=max(os.cpu_count() or 2, cpus), include_dashboard=False,
                     log_to_driver=False)
    serve.start(proxy_location="HeadOnly", http_options={"host": settings.host, "port": settings.port})
    serve.run(replica_application(settings, replicas, max_replicas, router, scale_down_s=scale_down_s), name=APP_NAME,
              route_prefix="/")
    return f"http://{settings.host}:{settings.port}"


def stop_replicas(shutdown_ray: bool = True) -> None:
    import ray

    if ray.is_initialized():
        serve.shutdown()
        if shutdown_ray:
            ray.shutdown()
