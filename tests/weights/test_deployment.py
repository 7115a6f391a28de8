"""A deployment's current versions (`DeploymentVersions`) on a real store and the shared Redis: set writes the
store's pointer and announces on Redis, get prefers Redis and falls back to the store, wait wakes on an
announcement, and Redis trouble is counted, never raised."""

from __future__ import annotations

import uuid

import pytest
import redis

from specrl.weights import WeightsStore
from specrl.weights.deployment import DeploymentVersions, control_stream, current_key
from tests.backends import DEAD_REDIS_URL, REDIS_URL

pytestmark = pytest.mark.redis


@pytest.fixture
def store(tmp_path):
    store = WeightsStore(tmp_path / "store")
    source = tmp_path / "files"
    source.mkdir()
    for i in range(3):
        (source / "weights.bin").write_bytes(bytes([i]) * 16)
        store.publish("drafter", source)  # v1, v2, v3
    return store


@pytest.fixture
def deployment():
    name = f"test-deploy-{uuid.uuid4().hex[:10]}"
    yield name
    redis.Redis.from_url(REDIS_URL).delete(current_key(name), control_stream(name))


def test_set_moves_the_stores_pointer_and_announces_on_redis(store, deployment):
    versions = DeploymentVersions(store, REDIS_URL, deployment, wait_s=0.2)
    assert versions.get() == {} and versions.cursor() == "0-0"
    versions.set("drafter", "v2")
    assert store.current("drafter") == "v2" and versions.get() == {"drafter": ("v2", "drain")}
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    assert client.hgetall(current_key(deployment)) == {"drafter": "v2", "drafter_mode": "drain"}
    cursor = versions.cursor()
    assert versions.wait(cursor) == cursor  # nothing new: wait_s passes
    versions.set("drafter", "v3", mode="interrupt")
    newer = versions.wait(cursor)
    assert newer != cursor and client.xrange(control_stream(deployment), newer, newer)[0][1] == \
        {"role": "drafter", "version": "v3", "mode": "interrupt"}
    assert versions.get() == {"drafter": ("v3", "interrupt")} and versions.redis_errors == 0


def test_redis_is_read_first_and_the_store_answers_for_what_it_does_not_name(store, deployment):
    """A replica without the trainer's disk learns `current` from Redis alone; a role Redis never named is the
    store's pointer (a deployment that ran without Redis until now)."""
    store.set_current("drafter", "v1")
    versions = DeploymentVersions(store, REDIS_URL, deployment)
    assert versions.get() == {"drafter": ("v1", "drain")}
    redis.Redis.from_url(REDIS_URL).hset(current_key(deployment), mapping={"drafter": "v3"})
    assert versions.get() == {"drafter": ("v3", "drain")} and store.current("drafter") == "v1"


def test_redis_trouble_is_counted_and_the_store_answers(store, deployment):
    versions = DeploymentVersions(store, DEAD_REDIS_URL, deployment, wait_s=0.05)
    versions.set("drafter", "v2")  # the store still moves
    assert store.current("drafter") == "v2" and versions.get() == {"drafter": ("v2", "drain")}
    assert versions.cursor() == "0-0" and versions.wait("0-0") == "0-0"
    assert versions.redis_errors == 4  # set, get, cursor, wait: each counted, none raised


def test_without_redis_the_store_is_the_deployment(store, deployment):
    versions = DeploymentVersions(store, "", deployment, wait_s=0.01)
    versions.set("drafter", "v1")
    assert versions.get() == {"drafter": ("v1", "drain")} and versions.wait("0-0") == "0-0"
    assert versions.redis_errors == 0
