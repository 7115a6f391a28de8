"""The drafter trainer as a Ray actor on a local Ray cluster: its process killed with SIGKILL mid-training, Ray
restarts it, the loop resumes from the checkpoint, and when asked to stop it has acked every record; killed
mid-publish, it leaves no half version (a version is staged, then renamed into place) and publishes on. Slow: a
Ray cluster starts in ~5 s and the trainer loads in each incarnation."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import time
import uuid

import pytest
import redis
import torch

from specrl.config import Settings
from specrl.telemetry import events_stream
from specrl.trainer.main import GROUP
from specrl.weights import WeightsStore
from specrl.weights.deployment import DeploymentVersions, control_stream, current_key
from tests.backends import REDIS_URL
from tests.trainer.test_trainer import fill_stream

pytestmark = [pytest.mark.redis, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the [ray] extra is not installed")]


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_killed_trainer_actor_is_restarted_resumes_from_its_checkpoint_and_acks_everything(ray_local, home, tmp_path,
                                                                                             tokenizer):
    import ray

    from specrl.trainer.ray_actor import start_trainer_actor

    deployment = f"test-ray-trainer-{uuid.uuid4().hex[:10]}"
    sent = fill_stream(home, deployment, tokenizer, n=32)
    settings = Settings.load(home=home, model="tiny-random", redis_url=REDIS_URL, deployment=deployment,
                             store=str(tmp_path / "store"), threads=1, train_records=2, checkpoint_every_steps=1,
                             heldout_fraction=0.25, publish_every_steps=10 ** 6, publish_every_s=10 ** 6)
    state = home / "trainer" / deployment / f"{settings.consumer}.pt"
    try:
        actor, run = start_trainer_actor(settings)
        first = ray.get(actor.process.remote(), timeout=60)
        deadline = time.monotonic() + 120
        while not state.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        checkpointed = torch.load(state, weights_only=False)["step"]
        assert checkpointed > 0 and not first["restarted"]
        os.kill(first["pid"], signal.SIGKILL)
        second = ray.get(actor.process.remote(), timeout=120)
        assert second["restarted"] and second["pid"] != first["pid"]
        time.sleep(2)  # let the new incarnation train on
        actor.stop.remote()
        result = ray.get(run, timeout=120)
        assert result["steps"] >= checkpointed  # resumed from the checkpoint, not from step 0
        pending = redis.Redis.from_url(REDIS_URL).xpending(events_stream(deployment), GROUP)["pending"]
        assert pending == 0 and sent > 0  # every record it read was acked after the step that used it
    finally:
        redis.Redis.from_url(REDIS_URL).delete(events_stream(deployment), events_stream(deployment) + ":dead")
        shutil.rmtree(home / "trainer" / deployment, ignore_errors=True)


def test_a_trainer_killed_mid_publish_leaves_no_half_version_and_publishes_on(ray_local, home, tmp_path, tokenizer):
    """SIGKILLed the moment a version is staged in the store (the trainer evaluates and publishes after every step
    here): the staged files stay where no reader looks; every version in the store verifies, `current` names one of
    them, and the restarted trainer publishes again."""
    import ray

    from specrl.trainer.ray_actor import start_trainer_actor

    deployment = f"test-ray-trainer-{uuid.uuid4().hex[:10]}"
    fill_stream(home, deployment, tokenizer, n=48)
    settings = Settings.load(home=home, model="tiny-random", redis_url=REDIS_URL, deployment=deployment,
                             store=str(tmp_path / "store"), threads=1, train_records=2, checkpoint_every_steps=1,
                             heldout_fraction=0.25, publish_every_steps=1, publish_every_s=10 ** 6,
                             publish_margin=-1.0)
    store, drafters = WeightsStore(settings.store_path), settings.store_path / "drafter"
    try:
        actor, run = start_trainer_actor(settings)
        staged, kills = [], 0
        deadline = time.monotonic() + 120
        while not staged and time.monotonic() < deadline:
            pid = ray.get(actor.process.remote(), timeout=120)["pid"]
            while time.monotonic() < deadline:  # a tight loop: a tiny drafter is staged for milliseconds
                if drafters.is_dir() and any(e.name.startswith(".publish-") for e in os.scandir(drafters)):
                    os.kill(pid, signal.SIGKILL)
                    kills += 1
                    break
            time.sleep(0.5)  # the process is gone: what it staged stays only if the kill beat the rename
            staged = [p for p in drafters.iterdir() if p.name.startswith(".publish-")]
        assert staged, f"no kill of {kills} landed while a version was staged"
        published = {m.version for m in store.versions("drafter")}
        deadline = time.monotonic() + 120
        while {m.version for m in store.versions("drafter")} <= published and time.monotonic() < deadline:
            time.sleep(0.2)  # the restarted trainer trains on and publishes
        actor.stop.remote()
        ray.get(run, timeout=120)
        versions = store.versions("drafter")
        assert {m.version for m in versions} > published
        for manifest in versions:
            store.verify("drafter", manifest.version)  # raises on a missing or changed file
        current = DeploymentVersions(store, REDIS_URL, deployment).get()["drafter"][0]
        assert current in {m.version for m in versions}
    finally:
        redis.Redis.from_url(REDIS_URL).delete(events_stream(deployment), events_stream(deployment) + ":dead",
                                               current_key(deployment), control_stream(deployment))
        shutil.rmtree(home / "trainer" / deployment, ignore_errors=True)
