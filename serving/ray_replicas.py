"""The server's replicas as one Ray Serve deployment (`specrl up --ray`).

Each replica is the same FastAPI app `specrl serve` runs (`serving.server.build`: its own engine, telemetry sink
and follower), built inside the replica's process through `serve.ingress` and a builder, so nothing of the
engine is pickled; Serve runs the app's lifespan, so a replica's follower checks the deployment's `current`
before Serve marks it running and sends it traffic (a replica that restarts catches up first). Every replica
writes its records under its own replica name (Serve's replica id) to the deployment's stream, and follows
`current` from Redis (`serving.follower`): a swap pushed to one replica through the proxy, or announced by a
trainer, reaches all of them.

Serve's proxy routes requests (its default router: power of two choices on ongoing requests) and, with
`min_replicas < max_replicas`, autoscales on ongoing requests per replica. Needs the `[ray]` extra.
"""

from __future__ import annotations

import os

from specrl.config import Settings

APP_NAME = "specrl"


def replica_application(settings: Settings, replicas: int, max_replicas: int | None = None,
                        target_ongoing_requests: float = 2.0):
    """-> the Serve application of `replicas` replicas (`max_replicas` > replicas: autoscaled between them on
    ongoing requests). Each replica computes with settings.threads torch threads (>= 1) and asks Ray for as many
    CPUs."""
    from ray import serve

    threads = max(1, settings.threads)

    def build_app():
        import torch

        from specrl.serving.server import build

        torch.set_num_threads(threads)
        replica = serve.get_replica_context().replica_id.unique_id
        loop, app = build(settings.replace(replica=f"ray-{replica}", threads=threads))
        loop.start()
        return app

    scaling = ({"autoscaling_config": {"min_replicas": replicas, "max_replicas": max_replicas,
                                       "target_ongoing_requests": target_ongoing_requests}}
               if max_replicas and max_replicas > replicas else {"num_replicas": replicas})
    deployment = serve.deployment(serve.ingress(build_app)(), name="server", ray_actor_options={"num_cpus": threads},
                                  max_ongoing_requests=max(8, 4 * settings.max_batch),
                                  graceful_shutdown_timeout_s=settings.shutdown_timeout, **scaling)
    return deployment.bind()


def run_replicas(settings: Settings, replicas: int, max_replicas: int | None = None, address: str | None = None):
    """Join (address) or start a local Ray cluster, start Serve's proxy on settings.host:settings.port, deploy the
    replicas and wait until Serve runs them all -> the proxy's URL. A local cluster gets a CPU for each thread of
    the replicas and of a trainer actor, at least the machine's cores. `stop_replicas` undoes it."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        if address:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        else:
            cpus = max(os.cpu_count() or 2, ((max_replicas or replicas) + 1) * max(1, settings.threads))  # + a trainer
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(replica_application(settings, replicas, max_replicas), name=APP_NAME, route_prefix="/")
    return f"http://{settings.host}:{settings.port}"


def stop_replicas(shutdown_ray: bool = True) -> None:
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        if shutdown_ray:
            ray.shutdown()
