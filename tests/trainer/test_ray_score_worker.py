"""Scoring workers as Ray actors (`envs.ray_worker.RayScoreWorker` behind `ScorePool`): on a local Ray cluster
the pool scores good and bad scorers, cuts a hanging one at its timeout and replaces a dying one, as it does with
local processes; an environment that does not build scores 0 with its reason. Slow: a Ray cluster (~5 s)."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import psutil

import pytest

from specrl.trainer.envs import ScorePool, Task

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the [ray] extra is not installed")]
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])  # user_envs:Name resolves in actors
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


def alive_score_actors(expected: int, wait_s: float = 15.0) -> int:
    """Processes hosting a ScoreWorkerActor (Ray titles them `ray::ScoreWorkerActor...`), once their count is
    `expected` or after `wait_s` (a killed actor's process exits shortly after)."""
    deadline = time.monotonic() + wait_s
    while True:
        count = sum(any("ray::ScoreWorkerActor" in part for part in (p.info["cmdline"] or []))
                    for p in psutil.process_iter(["cmdline"]))
        if count == expected or time.monotonic() > deadline:
            return count
        time.sleep(0.2)


def test_without_ray_a_worker_scores_zero_and_starts_no_ray():
    """A lane that starts a worker when Ray is not running (its cluster ended first) must not start one: a cluster
    started from a lane's thread dies with the thread, and takes the process's Ray connection with it."""
    import ray

    from specrl.trainer.envs.ray_worker import RayScoreWorker

    ray.shutdown()  # no cluster of an earlier module
    with ScorePool("user_envs:Echo", workers=1, timeout_s=2.0, start_worker=RayScoreWorker) as pool:
        [score] = pool.score(Task("t", "?", "train"), ["1"])
    assert score.reward == 0.0 and "Ray is not running" in score.error
    assert not ray.is_initialized()


def test_ray_scoring_workers_score_cut_hangs_and_replace_the_dead(ray_cluster):
    from specrl.trainer.envs.ray_worker import RayScoreWorker

    task = Task("echo-1", "?", "train")
    with ScorePool("user_envs:Echo", workers=2, timeout_s=2.0, start_worker=RayScoreWorker) as pool:
        scores = pool.score(task, ["0.5", "raise", "junk", "sleep", "die", "1"])
        after = pool.score(task, ["1"] * 4)  # the lanes whose actor was cut or died start fresh ones
        stats = pool.stats()
        alive = alive_score_actors(2)
    assert [s.reward for s in scores] == [0.5, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert "KeyError" in scores[1].error and "invalid" in scores[2].error
    assert "scorer timeout" in scores[3].error and "died" in scores[4].error
    assert [s.reward for s in after] == [1.0] * 4
    assert stats["timeouts"] == 1 and stats["deaths"] == 1 and stats["restarts"] >= 1
    assert alive <= 2  # the hung and the dead actors are gone: at most one per lane
    assert alive_score_actors(0) == 0  # closing the pool kills its actors


def test_an_environment_that_does_not_build_scores_zero_with_its_reason(ray_cluster):
    from specrl.trainer.envs.ray_worker import RayScoreWorker

    with ScorePool("user_envs:NeedsArguments", workers=1, timeout_s=2.0, start_worker=RayScoreWorker) as pool:
        [score] = pool.score(Task("t", "?", "train"), ["1"])
    assert score.reward == 0.0 and "could not start" in score.error and "TypeError" in score.error
