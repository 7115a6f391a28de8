"""A short `specrl rl --env ifeval` loop on the tiny model: versions advance, swaps happen, nothing fails, and the
report has acceptance recovery per swap, rollout tokens/s with and without speculation, and the final paired
evaluation of base against the last published policy."""

import uuid
from pathlib import Path

import pytest
import redis

from specrl.config import Settings
from specrl.errors import InvalidRequestError, SpecrlError
from specrl.apps.launch import free_port
from specrl.trainer.grpo import GRPOConfig, GRPOTrainer
from specrl.apps.rl import policy_state_path, run_rl
from specrl.telemetry import events_stream
from specrl.weights import WeightsStore
from tests.serving.conftest import REDIS_URL

pytestmark = pytest.mark.redis


def test_short_rl_loop_publishes_and_swaps_policies(home, tmp_path, tiny_dir):
    deployment = f"test-rl-{uuid.uuid4().hex[:8]}"
    settings = Settings.load(home=home, model="tiny-random", deployment=deployment, redis_url=REDIS_URL,
                             port=free_port(), store=str(tmp_path / "store"))
    try:
        report = run_rl(settings, env_name="ifeval", minutes=0.5, group_size=3, tasks_per_step=2,
                        publish_every=1, eval_every=2, eval_tasks=4, final_eval_tasks=6, max_tokens=8,
                        config=GRPOConfig(lr=1e-4, max_lag=1), out_dir=str(tmp_path / "run"), window_tokens=16,
                        sample_every_s=0.5, speed_tasks=2, speed_rounds=1)
    finally:
        redis.Redis.from_url(REDIS_URL).delete(events_stream(deployment), events_stream(deployment) + ":dead")
    published = [p["version"] for p in report["publishes"] if "version" in p]
    assert report["steps"] and len(report["evals"]) >= 2
    # a policy is published whenever a step trained on something; each was swapped in (interrupt)
    assert len(published) == sum(1 for s in report["steps"] if s["trained"])
    assert all(p["swap_ms"] >= 0 for p in report["publishes"] if "version" in p)
    if published:
        assert report["evals"][-1]["policy"] == published[-1]
        # `specrl rl` again on this deployment: the policy trainer resumes from its last publish
        resumed = GRPOTrainer(tiny_dir, GRPOConfig(), state_path=policy_state_path(settings),
                              store=WeightsStore(settings.store_path))
        assert resumed.version == published[-1] and resumed.published[1:] == published
    assert all(0.0 <= e["reward"] <= 1.0 for e in report["evals"])
    # at the end, base and the last published policy on the same held-out tasks, paired, IFEval's own numbers too
    final = report["final_eval"]
    if published:
        assert final["policy"] == published[-1] and final["tasks"] == 6 and Path(final["report"]).is_file()
        for metric in ("reward", "prompt_strict", "prompt_loose", "instruction_strict", "instruction_loose"):
            assert final[metric]["diff"] == pytest.approx(final[metric]["trained"] - final[metric]["base"])
    else:
        assert final == {"skipped": "no policy was published"}
    assert all(s["groups"] >= s["flat_groups"] >= 0 for s in report["steps"])
    # one recovery entry per policy swap seen in the /metrics samples, the last swap included
    recovery = report["recovery"]
    assert len(recovery["swaps"]) == len(published) and recovery["window_tokens"] == 16
    for swap in recovery["swaps"]:
        assert swap["recovered"] in (True, False, None) and swap["tokens_seen"] >= 0
        assert swap["pre"] is None or swap["pre"] >= 1.0
        assert (swap["tokens_to_recover"] is not None) == bool(swap["recovered"])
    assert any(s["eval"] for s in report["samples"]) and not all(s["eval"] for s in report["samples"])
    for e in report["drafter_evaluations"]:  # the drafter trainer's own held-out curve, from its log
        assert e["t"] >= 0 and e["records"] >= 0
        assert e["serving_tau"] is None or 1.0 <= e["serving_tau"] <= 5.0
    speed = report["speed"]
    assert speed["ratio"] > 0 and speed["policy"] == speed["policy_without"] == report["evals"][-1]["policy"]
    assert speed["ratio_median"] == pytest.approx(speed["with_speculation"]["rounds_tokens_per_s"][0]
                                                  / speed["without_speculation"]["rounds_tokens_per_s"][0], rel=1e-3)
    for arm in ("with_speculation", "without_speculation"):
        assert speed[arm]["tokens"] > 0 and speed[arm]["tokens_per_s"] > 0
    # the server without speculation paid for telemetry as the live one does, on a stream of its own, deleted after
    assert speed["without_speculation"]["records_sent"] > 0
    for arm in ("with_speculation", "without_speculation"):  # each engine's decode steps: a share of the request time
        assert speed[arm]["steps"] > 0 and 0 < speed[arm]["decode_seconds"] <= speed[arm]["seconds"]
    assert not redis.Redis.from_url(REDIS_URL).exists(events_stream(f"{deployment}-no-speculation"))
    logs = "".join((tmp_path / "run" / name).read_text()
                   for name in ("server.log", "drafter-trainer.log", "server-no-speculation.log"))
    assert "Traceback" not in logs
    assert (tmp_path / "run" / "rl-report.png").read_bytes()[:4] == b"\x89PNG"
    # the stages side by side: every sample GRPO took was generated and scored first
    stages = report["pipeline"]["stages"]
    assert stages["trainer"]["samples"] == 3 * 2 * len(report["steps"])
    assert stages["generator"]["rollouts"] >= stages["environment"]["scores"] >= stages["trainer"]["samples"]
    assert stages["environment"]["workers"] == 4 and stages["environment"]["timeouts"] == 0
    for stage, unit in (("generator", "rollouts"), ("environment", "scores"), ("trainer", "samples")):
        assert stages[stage][f"{unit}_per_s"] > 0 and stages[stage]["busy_s"] >= 0
        assert all(0 <= s <= report["pipeline"]["seconds"] + 1 for s in stages[stage]["waited_s"].values())


def test_a_store_serving_a_policy_this_deployment_did_not_train_is_refused(home, tmp_path, tiny_dir):
    """GRPO would start from the base model while the server serves a later policy: every rollout
    would be beyond the staleness bound. One clear error, before any process starts."""
    store = WeightsStore(tmp_path / "store")
    version = store.publish("policy", tiny_dir, make_current=True).version
    settings = Settings.load(home=home, model="tiny-random", deployment=f"test-rl-{uuid.uuid4().hex[:8]}",
                             redis_url=REDIS_URL, port=free_port(), store=str(tmp_path / "store"))
    with pytest.raises(SpecrlError, match=f"already serves policy {version}"):
        run_rl(settings, env_name="format", minutes=0.1, out_dir=str(tmp_path / "run"))
    assert not list((tmp_path / "run").glob("*.log"))


def test_an_environment_that_does_not_resolve_fails_before_any_process_starts(home, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    settings = Settings.load(home=home, model="tiny-random", deployment=f"test-rl-{uuid.uuid4().hex[:8]}",
                             redis_url=REDIS_URL, port=free_port(), store=str(tmp_path / "store"))
    for spec, message in (("user_envs:NoScore", "has no method score"), ("not_a_module:Env", "cannot import"),
                          ("user_envs:YieldsStrings", "yielded a str")):
        with pytest.raises(InvalidRequestError, match=message):
            run_rl(settings, env_name=spec, minutes=0.1, out_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists() and not (tmp_path / "store").exists()
