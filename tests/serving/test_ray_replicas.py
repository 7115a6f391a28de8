"""The server's replicas as one Ray Serve deployment on a local Ray cluster (`specrl up --ray`'s serving part):
two tiny-model replicas behind Serve's proxy answer the official `openai` client, both write records under their
own replica names to the deployment's stream, and a drafter announced as the deployment's `current` (no replica
pushed) reaches both. Slow: a Ray cluster and Serve start in ~15 s."""

from __future__ import annotations

import importlib.util
import time
import uuid

import pytest
import redis

from specrl.apps.launch import free_port
from specrl.apps.scrape import sample_metrics
from specrl.config import Settings
from specrl.models.drafter import EagleDrafter
from specrl.models.llama import load_llama
from specrl.telemetry import RECORD_FIELD, SegmentRecord, events_stream
from specrl.weights import WeightsStore
from specrl.weights.deployment import DeploymentVersions, control_stream, current_key
from tests.backends import REDIS_URL, publish_start_version

pytestmark = [pytest.mark.redis, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the [ray] extra is not installed")]


def records(deployment: str) -> list[SegmentRecord]:
    entries = redis.Redis.from_url(REDIS_URL).xrange(events_stream(deployment))
    return [SegmentRecord.from_msgpack(fields[RECORD_FIELD.encode()]) for _, fields in entries]


def test_two_replicas_behind_serves_proxy_answer_write_records_and_follow_current(home, tmp_path, tiny_dir):
    from openai import OpenAI

    from specrl.serving.ray_replicas import run_replicas, stop_replicas

    deployment, store = f"test-ray-{uuid.uuid4().hex[:10]}", WeightsStore(tmp_path / "store")
    publish_start_version(store.root, tiny_dir, "drafter")
    settings = Settings.load(home=home, model="tiny-random", redis_url=REDIS_URL, deployment=deployment,
                             store=str(store.root), port=free_port(), threads=1, follow_interval_s=0.5)
    try:
        url = run_replicas(settings, replicas=2)
        client = OpenAI(base_url=url + "/v1", api_key="unused")
        for i in range(12):
            reply = client.completions.create(model="tiny-random", prompt=f"Hello number {i}", max_tokens=4)
            assert reply.choices[0].text is not None
        deadline = time.monotonic() + 30
        while len({r.replica for r in records(deployment)}) < 2 and time.monotonic() < deadline:
            client.completions.create(model="tiny-random", prompt="Once more", max_tokens=4)
            time.sleep(0.2)  # records leave in batches
        replicas = {r.replica for r in records(deployment)}
        assert len(replicas) == 2 and all(name.startswith("ray-") for name in replicas)
        sample = sample_metrics(url, 0.0)  # one /metrics page names the replica that answered it
        assert sample["replica"] in replicas and sample["drafter"] == "day0" and sample["tokens"] > 0

        out = tmp_path / "drafter-v1"
        EagleDrafter.day0(load_llama(tiny_dir), seed=11).save(out)
        v1 = store.publish("drafter", out).version
        seen_at = len(records(deployment))
        DeploymentVersions(store, REDIS_URL, deployment).set("drafter", v1)  # a trainer that knows no replica
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            client.completions.create(model="tiny-random", prompt="After the swap", max_tokens=4)
            later = records(deployment)[seen_at:]
            if {r.replica for r in later if r.drafter_version == v1} == replicas:
                break
            time.sleep(0.2)
        assert {r.replica for r in records(deployment)[seen_at:] if r.drafter_version == v1} == replicas
    finally:
        stop_replicas()
        redis.Redis.from_url(REDIS_URL).delete(events_stream(deployment), current_key(deployment),
                                               control_stream(deployment))
