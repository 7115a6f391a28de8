"""`specrl rl --ray` on the tiny model and a local Ray cluster: the server as a replica on Ray Serve, the drafter
trainer, GRPO, the rollout worker and the scoring workers as Ray actors; versions advance, every published policy
is swapped in and evaluated, the records come from the Serve replica, and GRPO's checkpoint (written by its
actor) resumes at the last publish. Slow: a Ray cluster and Serve (~20 s) and a 30 s loop."""

import importlib.util
import uuid

import pytest
import redis

from specrl.apps.launch import free_port
from specrl.apps.ray_fleet import Fleet
from specrl.apps.rl import policy_state_path, run_rl
from specrl.config import Settings
from specrl.telemetry import RECORD_FIELD, SegmentRecord, events_stream
from specrl.trainer.grpo import GRPOConfig, GRPOTrainer
from specrl.weights import WeightsStore
from specrl.weights.deployment import control_stream, current_key
from tests.serving.conftest import REDIS_URL

pytestmark = [pytest.mark.redis, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the [ray] extra is not installed")]


def test_rl_roles_on_ray_publish_swap_and_resume(home, tmp_path, tiny_dir):
    deployment = f"test-rl-ray-{uuid.uuid4().hex[:8]}"
    settings = Settings.load(home=home, model="tiny-random", deployment=deployment, redis_url=REDIS_URL,
                             port=free_port(), store=str(tmp_path / "store"), threads=1)
    fleet = Fleet.check("local", replicas=1, max_replicas=0, trainers=2)
    r = redis.Redis.from_url(REDIS_URL)
    try:
        report = run_rl(settings, env_name="format", minutes=0.5, group_size=3, tasks_per_step=2,
                        publish_every=1, eval_every=2, eval_tasks=4, max_tokens=8,
                        config=GRPOConfig(lr=1e-4, max_lag=1), out_dir=str(tmp_path / "run"), window_tokens=16,
                        sample_every_s=0.5, speed_tasks=2, speed_rounds=1, score_workers=2, fleet=fleet)
        replicas = {SegmentRecord.from_msgpack(fields[RECORD_FIELD.encode()]).replica
                    for _, fields in r.xrange(events_stream(deployment))}
    finally:
        r.delete(events_stream(deployment), f"{events_stream(deployment)}:dead", current_key(deployment),
                 control_stream(deployment))
    assert report["ray"] == {"address": "local", "replicas": 1}
    assert any(name.startswith("ray-") for name in replicas)  # the Serve replica served the rollouts
    published = [p["version"] for p in report["publishes"] if "version" in p]
    assert report["steps"] and len(published) == sum(1 for s in report["steps"] if s["trained"])
    stages = report["pipeline"]["stages"]
    assert stages["environment"]["scores"] > 0 and stages["environment"]["workers"] == 2
    assert report["rollout_tokens_per_s"] > 0  # counted by the rollout worker actor
    if published:
        assert report["evals"][-1]["policy"] == published[-1]  # swapped in through the proxy
        resumed = GRPOTrainer(tiny_dir, GRPOConfig(), state_path=policy_state_path(settings),
                              store=WeightsStore(settings.store_path))
        assert resumed.version == published[-1] and resumed.published[1:] == published
    assert report["speed"]["ratio"] > 0
