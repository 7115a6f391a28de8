"""The RL loop's pipeline without a server: a generator, the scoring pool and a trainer running at once,
with each stage's rate and waits; and the pass@k estimator."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import pytest

from specrl.trainer.envs import ScorePool, Task
from specrl.trainer.grpo import Rollout
from specrl.trainer.rollout import RolloutPipeline, pass_at_k

HERE = Path(__file__).parent
SCORE_S = 0.3                                  # user_envs.Slow: each score takes this long


@pytest.fixture
def user_envs(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def _group(group: int, texts: list[str]) -> list[Rollout]:
    return [Rollout(group, [1], [2], [-1.0], [[0, "base", "day0"]], 0.0, text) for text in texts]


def _run(pool: ScorePool, groups: int, sample_s: float, *, per_step: int = 2, max_scoring: int = 2) -> tuple:
    """A generator thread sampling `groups` groups of two (`sample_s` each), a trainer taking them."""
    pipeline = RolloutPipeline(pool, max_scoring=max_scoring, max_scored=2)
    stop = threading.Event()

    def generate():
        for g in range(groups):
            time.sleep(sample_s)
            if not pipeline.hand_off(Task(f"slow-{g}", "?", "train"), _group(g, ["ab", "abc"]), busy_s=sample_s):
                return

    producer = threading.Thread(target=generate, daemon=True)
    started = time.monotonic()
    pipeline.start()
    producer.start()
    taken = []
    while len(taken) < 2 * groups:
        batch = pipeline.take(per_step, deadline=started + 60)
        assert batch is not None
        taken += batch
        pipeline.trained(0.0)
    took = time.monotonic() - started
    stats = pipeline.stats()
    pipeline.stop()
    stop.set()
    producer.join()
    return taken, took, stats


def test_scoring_runs_while_the_generator_samples(user_envs):
    """Sampling a group and scoring one take about as long: side by side the run takes about one of
    them per group, one after the other it would take both."""
    with ScorePool("user_envs:Slow", workers=2, timeout_s=10.0) as pool:
        pool.score(Task("warm", "?", "train"), ["ab", "ab"])          # both workers up
        taken, took, stats = _run(pool, groups=8, sample_s=SCORE_S)
    sequential = 8 * (SCORE_S + SCORE_S)       # sample, then score the group's two completions in parallel
    assert took < 0.8 * sequential, (took, stats)
    assert [r.reward for r in taken] == [1.0, 0.0] * 8 and sorted({r.group for r in taken}) == list(range(8))
    generator, environment, trainer = (stats["stages"][s] for s in ("generator", "environment", "trainer"))
    assert generator["rollouts"] == environment["scores"] == trainer["samples"] == 16
    assert generator["busy_s"] == pytest.approx(8 * SCORE_S)
    assert environment["busy_s"] == pytest.approx(16 * SCORE_S / 2, rel=0.5)   # per worker
    assert environment["scores_per_s"] == pytest.approx(16 / stats["seconds"], rel=0.2)
    # the environment keeps pace: the generator hardly waits for it; the trainer waits for scored groups
    assert generator["waited_s"]["environment"] < 0.5 * SCORE_S * 8
    assert trainer["waited_s"]["environment"] > 0.5 * took


def test_a_slow_environment_shows_as_the_generator_waiting_for_it(user_envs):
    with ScorePool("user_envs:Slow", workers=1, timeout_s=10.0) as pool:
        pool.score(Task("warm", "?", "train"), ["ab"])
        taken, took, stats = _run(pool, groups=6, sample_s=0.01, max_scoring=1)
    generator, environment = stats["stages"]["generator"], stats["stages"]["environment"]
    assert len(taken) == 12 and took >= 12 * SCORE_S
    # one worker scores 12 completions one by one; the generator, one group ahead at most, waits
    assert generator["waited_s"]["environment"] > 0.5 * 10 * SCORE_S
    assert environment["waited_s"]["generator"] < 2 * SCORE_S
    assert environment["busy_s"] == pytest.approx(12 * SCORE_S, rel=0.3)


def test_take_gives_up_at_the_deadline_and_on_stop(user_envs):
    with ScorePool("user_envs:Slow", workers=1, timeout_s=10.0) as pool:
        pipeline = RolloutPipeline(pool, max_scoring=1, max_scored=1)
        started = time.monotonic()
        assert pipeline.take(1, deadline=started + 0.3) is None and time.monotonic() - started < 1.0
        threading.Timer(0.2, pipeline.stop).start()
        assert pipeline.take(1) is None
        assert pipeline.hand_off(Task("t", "?", "train"), _group(0, ["ab"])) is False   # stopped: nothing queued


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of k-subsets of n samples (the first c passing) that hold a pass."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n, c, k", [(n, c, k) for n in (1, 2, 5, 8) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_is_the_chance_that_k_of_n_hold_a_pass(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_edges():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)               # pass@1 is c / n
    assert pass_at_k(200, 0, 100) == 0.0 and pass_at_k(200, 101, 100) == 1.0
    assert 0.0 < pass_at_k(200, 1, 100) == pytest.approx(0.5)       # one pass in 200: half the 100-subsets
    for bad in ((5, 6, 1), (5, 2, 0), (5, 2, 6), (5, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_a_trainer_that_stops_taking_holds_the_generator_not_the_scorers(user_envs):
    """With the trainer away (an evaluation), the generator stops at the bound, and the pool still
    scores anything else it is given: its workers never wait for the trainer."""
    with ScorePool("user_envs:Slow", workers=1, timeout_s=10.0) as pool:
        pipeline = RolloutPipeline(pool, max_scoring=1, max_scored=1)
        handed = [pipeline.hand_off(Task(f"slow-{g}", "?", "train"), _group(g, ["ab"])) for g in range(2)]
        blocked = threading.Thread(target=pipeline.hand_off, args=(Task("slow-2", "?", "train"), _group(2, ["ab"])))
        blocked.start()
        [evaluation] = pool.score(Task("eval", "?", "heldout"), ["abcd"])   # scored although nobody takes
        time.sleep(2 * SCORE_S)
        assert handed == [True, True] and blocked.is_alive() and evaluation.reward == 1.0
        assert len(pipeline.take(2)) == 2                                   # room again: the third goes in
        blocked.join(timeout=5.0)
        assert not blocked.is_alive() and len(pipeline.take(1)) == 1
        waited = pipeline.stats()["stages"]["generator"]["waited_s"]
        assert waited["trainer"] > SCORE_S
        pipeline.stop()
