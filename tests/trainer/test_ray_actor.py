"""The drafter trainer as a Ray actor on a local Ray cluster: its process killed with SIGKILL mid-training, Ray
restarts it, the loop resumes from the checkpoint, and when asked to stop it has acked every record. Slow: a Ray
cluster starts in ~5 s and the trainer loads in each incarnation."""

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
from tests.backends import REDIS_URL
from tests.trainer.test_trainer import fill_stream

pytestmark = [pytest.mark.redis, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the [ray] extra is not installed")]


def test_a_killed_trainer_actor_is_restarted_resumes_from_its_checkpoint_and_acks_everything(home, tmp_path,
                                                                                             tokenizer):
    import ray

    from specrl.trainer.ray_actor import start_trainer_actor

    deployment = f"test-ray-trainer-{uuid.uuid4().hex[:10]}"
    sent = fill_stream(home, deployment, tokenizer, n=32)
    settings = Settings.load(home=home, model="tiny-random", redis_url=REDIS_URL, deployment=deployment,
                             store=str(tmp_path / "store"), threads=1, train_records=2, checkpoint_every_steps=1,
                             heldout_fraction=0.25, publish_every_steps=10 ** 6, publish_every_s=10 ** 6)
    state = home / "trainer" / deployment / f"{settings.consumer}.pt"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
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
        ray.shutdown()
        redis.Redis.from_url(REDIS_URL).delete(events_stream(deployment), events_stream(deployment) + ":dead")
        shutil.rmtree(home / "trainer" / deployment, ignore_errors=True)
