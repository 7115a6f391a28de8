"""`specrl bench fleet --scenarios publish,restart`: how fast the replicas on Ray take a published version, and how
fast a killed replica's successor serves `current` (the method is in `specrl.apps.bench.fleet`'s docstring).

Times come from the deployment's event stream: a record's stream entry id is the Redis server's clock (ms) when the
replica's sink appended it, so one clock measures every replica; a publish's start is read from the same server
(`TIME`).
"""

from __future__ import annotations

import os
import signal
import time
import uuid

from specrl.apps.bench.fleet_clients import FleetClients
from specrl.config import Settings

PUBLISH_GAP_S = 3.0
WAIT_S = 120.0


def run_lifecycle(settings: Settings, replicas: int, users: int, publishes: int, restart: bool) -> dict:
    """Deploy the replicas (Ray must be initialized), run the traffic, publish `publishes` drafters, then (with
    `restart`) kill one replica -> {"publish": ..., "restart": ..., "failed_requests": ...}."""
    from specrl.apps.redis_server import RedisServer
    from specrl.assets import resolve_model
    from specrl.models.drafter import EagleDrafter
    from specrl.models.llama import load_llama
    from specrl.serving.ray_replicas import run_replicas, stop_replicas
    from specrl.weights import WeightsStore
    from specrl.weights.deployment import DeploymentVersions
    from specrl.weights.object_store import publish_object, registry

    deployment = f"bench-fleet-{uuid.uuid4().hex[:8]}"
    redis_server = RedisServer(settings.redis_url)
    store = WeightsStore(settings.home / "bench-fleet" / deployment / "store")
    settings = settings.replace(redis_url=redis_server.url, deployment=deployment, store=str(store.root),
                                durable_store=str(store.root), follow_current=True)
    stream = _Stream(redis_server.url, deployment)
    traffic = None
    try:
        print(f"bench fleet: publish/restart: starting {replicas} replicas", flush=True)
        url = run_replicas(settings, replicas, router="prefix")
        traffic = FleetClients(url, settings.model, max_tokens=4).set_users(users)
        names = stream.wait_for(lambda recs: len({r.replica for r in recs}) >= replicas, "every replica's records")
        target = load_llama(resolve_model(settings.model, settings.home))
        versions = DeploymentVersions(store, redis_server.url, deployment)
        rows = []
        for i in range(publishes):
            out = settings.home / "bench-fleet" / deployment / f"drafter-{i}"
            EagleDrafter.day0(target, seed=100 + i).save(out)
            started = stream.server_time()
            version = store.publish("drafter", out).version
            publish_object(deployment, store, "drafter", version)
            versions.set("drafter", version)
            firsts = stream.first_records(lambda r, v=version: r.drafter_version == v, names)
            rows.append({"version": version, "seconds": {n: round(t - started, 3) for n, t in firsts.items()}})
            print(f"bench fleet: publish {version}: " + ", ".join(f"{n} {t - started:.2f} s" for n, t in
                                                                   sorted(firsts.items())), flush=True)
            time.sleep(PUBLISH_GAP_S)
        seconds = sorted(s for row in rows for s in row["seconds"].values())
        result = {"deployment": deployment, "replicas": sorted(names),
                  "publish": {"rows": rows, "p50_s": _quantile(seconds, 0.5), "p90_s": _quantile(seconds, 0.9)},
                  "failed_requests_before_restart": traffic.failed}
        if restart:
            result["restart"] = _restart(stream, names, rows[-1]["version"] if rows else "day0", traffic)
        result["failed_requests"], result["requests"] = traffic.failed, traffic.ok + traffic.failed
        return result
    finally:
        if traffic is not None:
            traffic.set_users(0)
        stop_replicas(shutdown_ray=False)
        owner = registry(deployment)
        if owner is not None:
            import ray

            ray.kill(owner)
        stream.delete()
        redis_server.stop()


def _restart(stream, names: set[str], current: str, traffic) -> dict:
    """SIGKILL one replica's process -> seconds until a new replica's first record, and its drafter."""
    pids = replica_pids()
    if not pids:
        return {"error": "no replica process found"}
    failed_before = traffic.failed
    killed_at = stream.server_time()
    os.kill(pids[0], signal.SIGKILL)
    print(f"bench fleet: restart: SIGKILLed pid {pids[0]}", flush=True)
    firsts = stream.first_records(lambda r: r.replica not in names, None, want=1)
    if not firsts:
        return {"error": f"no new replica wrote a record within {WAIT_S:g} s"}
    replica, at = min(firsts.items(), key=lambda item: item[1])
    first = stream.first_record_of(replica)
    return {"replica": replica, "seconds_to_first_record": round(at - killed_at, 3),
            "drafter": first.drafter_version, "serves_current": first.drafter_version == current,
            "failed_requests": traffic.failed - failed_before}


def replica_pids() -> list[int]:
    """The process ids of this Ray cluster's `server` replicas (asked of each replica actor: never a process of
    another cluster on the machine)."""
    import ray

    pids = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith("SERVE_REPLICA::") and "#server#" in actor["name"]:
            handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
            pids.append(ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=30))
    return pids


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


class _Stream:
    """The deployment's event stream, read forward from where the run began."""

    def __init__(self, url: str, deployment: str):
        from specrl.redis_conn import connect
        from specrl.telemetry import events_stream

        self.client, self.key = connect(url), events_stream(deployment)
        self.cursor, self.records = "0-0", []  # (entry time s, record)

    def server_time(self) -> float:
        seconds, micros = self.client.time()
        return seconds + micros / 1e6

    def poll(self) -> None:
        from specrl.telemetry import RECORD_FIELD, SegmentRecord

        for entry_id, fields in self.client.xrange(self.key, min=f"({self.cursor}" if self.cursor != "0-0" else "-"):
            self.cursor = entry_id.decode()
            self.records.append((int(self.cursor.split("-")[0]) / 1000,
                                 SegmentRecord.from_msgpack(fields[RECORD_FIELD.encode()])))

    def wait_for(self, done, what: str) -> set[str]:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            self.poll()
            if done([r for _, r in self.records]):
                return {r.replica for _, r in self.records}
            time.sleep(0.2)
        raise TimeoutError(f"bench fleet: no {what} within {WAIT_S:g} s")

    def first_records(self, match, names: set[str] | None, want: int | None = None) -> dict[str, float]:
        """-> {replica: entry time of its first record matching} for `names` (None: any replica, until `want`)."""
        firsts: dict[str, float] = {}
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            self.poll()
            for at, record in self.records:
                if match(record) and record.replica not in firsts and (names is None or record.replica in names):
                    firsts[record.replica] = at
            if (names is not None and set(firsts) >= names) or (want is not None and len(firsts) >= want):
                break
            time.sleep(0.1)
        return firsts

    def first_record_of(self, replica: str):
        return next(r for _, r in self.records if r.replica == replica)

    def delete(self) -> None:
        self.client.delete(self.key)
