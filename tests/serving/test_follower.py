"""Replicas follow their deployment's `current` by themselves: live `specrl serve` processes of one deployment
on one store and the shared Redis. An admin swap on one replica moves the others; a publish nobody pushed
(a trainer that knows no replica) moves them all; a replica that starts after `current` moved on Redis alone
is not ready until it serves it; a version that does not verify leaves the old weights serving, ready, with the
reason; `--no-follow-current` stays put."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
import redis

from specrl.models.drafter import WEIGHTS_FILE, EagleDrafter
from specrl.models.llama import load_llama
from specrl.telemetry import events_stream
from specrl.weights import WeightsStore
from specrl.weights.deployment import DeploymentVersions, control_stream, current_key
from tests.backends import ADMIN_TOKEN, REDIS_URL, publish_start_version, spawn_server, start_server

pytestmark = pytest.mark.redis

FOLLOW = ("--redis-url", REDIS_URL, "--follow-interval-s", "0.5")


@pytest.fixture
def fleet(home, tmp_path, tiny_dir):
    """-> (start(*args) -> a replica of one deployment on one store, the store, the deployment's versions)."""
    deployment, store_dir = f"test-follow-{uuid.uuid4().hex[:10]}", tmp_path / "store"
    started = []

    def start(*args: str, wait: bool = True):
        run = start_server if wait else spawn_server
        server = run(home, tmp_path, "--store", str(store_dir), "--deployment", deployment, *FOLLOW, *args)
        started.append(server)
        return server

    publish_start_version(store_dir, tiny_dir, "drafter")
    versions = DeploymentVersions(WeightsStore(store_dir), REDIS_URL, deployment)
    yield start, WeightsStore(store_dir), versions
    for server in started:
        server.stop()
    redis.Redis.from_url(REDIS_URL).delete(current_key(deployment), control_stream(deployment),
                                           events_stream(deployment))


def publish_drafter(store: WeightsStore, tiny_dir, tmp_path, seed: int) -> str:
    out = tmp_path / f"drafter-{seed}"
    EagleDrafter.day0(load_llama(tiny_dir), seed=seed).save(out)
    return store.publish("drafter", out).version


def health(server) -> httpx.Response:
    return httpx.get(server.url + "/health", timeout=30)


def serves(server, role: str, version: str, deadline_s: float = 60) -> dict:
    """Poll /health until `server` serves `version` of `role` (the follow interval is 0.5 s; a deadline, not a
    speed claim) -> the /health body."""
    key = {"policy": "target_version", "drafter": "drafter_version"}[role]
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        body = health(server).json()
        if body.get(key) == version:
            return body
        time.sleep(0.1)
    raise AssertionError(f"{server.url} still serves {role} {body.get(key)}, not {version}: {body}")


def swaps(server, result: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    line = f'specrl_weight_swaps_total{{result="{result}",role="drafter"}}'
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def test_replicas_follow_an_admin_swap_and_an_unpushed_publish(fleet, tiny_dir, tmp_path):
    start, store, versions = fleet
    a, b = start(), start()
    assert health(a).json()["ready"] and health(b).json()["current"] == {}  # nothing made current yet
    v1 = publish_drafter(store, tiny_dir, tmp_path, seed=5)
    resp = httpx.post(a.url + "/admin/weights", json={"role": "drafter", "version": v1},
                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=120)
    assert resp.status_code == 200, resp.text
    body = serves(b, "drafter", v1)  # nobody asked b
    assert body["status"] == "ok" and body["ready"] and swaps(b, "ok") == 1
    v2 = publish_drafter(store, tiny_dir, tmp_path, seed=6)
    versions.set("drafter", v2)  # a trainer that knows no replica
    for server in (a, b):
        assert serves(server, "drafter", v2)["current"] == {"drafter": v2}
    reply = httpx.post(b.url + "/v1/completions", json={"model": "tiny-random", "prompt": "Hello", "max_tokens": 4},
                       timeout=60)
    assert reply.status_code == 200 and reply.json()["specrl"]["drafter_version"] == v2


def test_a_replica_that_starts_after_current_moved_on_redis_alone_is_ready_only_on_it(fleet, tiny_dir, tmp_path):
    """`current` named on Redis only (no stream entry, no store pointer: a replica without the trainer's disk, or
    one that missed the announcement): it loads the store's pointer, then must swap before /health says 200."""
    start, store, versions = fleet
    v1 = publish_drafter(store, tiny_dir, tmp_path, seed=7)
    redis.Redis.from_url(REDIS_URL).hset(versions.key, mapping={"drafter": v1})
    assert store.current("drafter") is None
    late = start(wait=False)
    first = None
    deadline = time.monotonic() + 120
    while first is None and time.monotonic() < deadline:
        try:
            resp = health(late)
        except httpx.TransportError:
            time.sleep(0.1)
            continue
        if resp.status_code == 200:
            first = resp.json()
        else:
            assert resp.status_code == 503 and resp.json()["ready"] is False
            time.sleep(0.05)
    assert first is not None and first["drafter_version"] == v1 and first["current"] == {"drafter": v1}


def test_a_current_that_does_not_verify_leaves_the_old_weights_serving(fleet, tiny_dir, tmp_path):
    start, store, versions = fleet
    a = start()
    bad = publish_drafter(store, tiny_dir, tmp_path, seed=8)
    weights = store.root / "drafter" / bad / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)  # the manifest's sha256 no longer holds
    versions.set("drafter", bad)
    deadline = time.monotonic() + 60
    while "drafter" not in health(a).json()["behind"] and time.monotonic() < deadline:
        time.sleep(0.1)
    body = health(a).json()
    assert health(a).status_code == 200 and body["ready"] and body["drafter_version"] == "day0"
    assert body["behind"]["drafter"]["version"] == bad and "sha256" in body["behind"]["drafter"]["reason"]
    assert swaps(a, "failed") == 1  # tried once, not again within RETRY_S
    reply = httpx.post(a.url + "/v1/completions", json={"model": "tiny-random", "prompt": "Hi", "max_tokens": 4},
                       timeout=60)
    assert reply.status_code == 200


def test_a_replica_told_not_to_follow_stays_on_its_weights(fleet, tiny_dir, tmp_path):
    start, store, versions = fleet
    still, moving = start("--no-follow-current"), start()
    v1 = publish_drafter(store, tiny_dir, tmp_path, seed=9)
    versions.set("drafter", v1)
    serves(moving, "drafter", v1)
    body = health(still).json()
    assert body["drafter_version"] == "day0" and body["ready"] and "current" not in body
