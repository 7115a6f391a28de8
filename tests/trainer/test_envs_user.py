"""Environments users write (`--env package.module:ClassName`): docs/rl.md's example, one-line errors for
specs that do not resolve, and the scoring pool against scorers that raise, hang, return junk or die."""

from __future__ import annotations

import itertools
import re
import threading
import time
from pathlib import Path

import psutil
import pytest

from specrl.errors import InvalidRequestError
from specrl.trainer.envs import ScorePool, Task, make_env, take_tasks

HERE = Path(__file__).parent
RL_DOC = HERE.parents[1] / "docs" / "rl.md"


@pytest.fixture
def user_envs(monkeypatch):
    """tests/trainer on sys.path (and so in the spawned scoring workers'): `user_envs:Name` resolves."""
    monkeypatch.syspath_prepend(str(HERE))


def _documented_example() -> str:
    """The example environment of docs/rl.md's "Environments" section: the python block after its marker."""
    text = RL_DOC.read_text()
    section = text[text.index("## Environments"):]
    return re.search(r"<!-- example environment -->\n```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_documented_example_environment_runs(tmp_path, monkeypatch):
    code = _documented_example()
    assert len(code.splitlines()) <= 20              # the "20-line example"
    (tmp_path / "reverse_word.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("reverse_word:ReverseWord")
    train = take_tasks(env, "reverse_word:ReverseWord", "train", 0, 50)
    held = take_tasks(env, "reverse_word:ReverseWord", "heldout", 0, 50)
    assert train and held and not {t.prompt for t in train} & {t.prompt for t in held}
    with ScorePool("reverse_word:ReverseWord", workers=1, timeout_s=env.timeout_s) as pool:
        task = held[0]
        word = re.search(r"'(\w+)'", task.prompt).group(1)
        right, wrong = pool.score(task, [f"{word[::-1]}.", word])
    assert (right.reward, wrong.reward) == (1.0, 0.0) and right.error is None


@pytest.mark.parametrize("spec, message", [
    ("chess", "unknown environment 'chess': use one of arithmetic, code, format, humaneval, ifeval, or package.module:"),
    ("no_such_module_here:Env", "cannot import module 'no_such_module_here'"),
    ("user_envs:Missing", "module user_envs has no class 'Missing'"),
    ("user_envs:NoScore", "NoScore has no method score(task, completion)"),
    ("user_envs:BadSignature", "BadSignature.tasks cannot be called as tasks(split, seed)"),
    ("user_envs:NeedsArguments", "NeedsArguments() failed: TypeError"),
])
def test_a_spec_that_does_not_resolve_is_one_line_naming_what_is_missing(user_envs, spec, message):
    with pytest.raises(InvalidRequestError) as info:
        make_env(spec)
    assert message in info.value.message and "\n" not in info.value.message


def test_a_task_stream_that_yields_no_tasks_is_refused(user_envs):
    env = make_env("user_envs:YieldsStrings")
    with pytest.raises(InvalidRequestError, match="yielded a str, not a specrl.trainer.envs.Task"):
        take_tasks(env, "user_envs:YieldsStrings", "train", 0, 1)


def test_take_tasks_is_distinct_and_stops_when_a_split_repeats(user_envs):
    env = make_env("user_envs:EvenLength")
    held = take_tasks(env, "user_envs:EvenLength", "heldout", 0, 128)
    assert [t.id for t in held] == ["even-heldout-omega", "even-heldout-sigma", "even-heldout-kappa"]


# ---- the scoring pool ----------------------------------------------------------------------------------

def _pool_threads() -> int:
    return sum(t.name.startswith("score-lane") for t in threading.enumerate())


def _scorers() -> set[int]:
    """Our scoring worker processes (spawned interpreters; not multiprocessing's resource tracker)."""
    return {p.pid for p in psutil.Process().children(recursive=True) if "spawn_main" in " ".join(p.cmdline())}


def test_the_pool_scores_good_and_bad_scorers_and_never_stops(user_envs, caplog):
    task = Task("echo-1", "?", "train")
    with ScorePool("user_envs:Echo", workers=2, timeout_s=1.0) as pool:
        scores = pool.score(task, ["0.5", "1", "raise", "junk", "nan", "2", "true", "details", "0"])
        stats = pool.stats()
    rewards = [s.reward for s in scores]
    assert rewards == [0.5, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.25, 0.0]
    assert [s.error for s in scores[:2]] == [None, None] and scores[-1].error is None
    assert "KeyError" in scores[2].error and all("invalid" in s.error for s in scores[3:7])
    assert scores[7].details == {"object": scores[7].details["object"], "3": "three"}   # made JSON-safe
    assert stats["scores"] == 9 and stats["faults"] == 5 and stats["timeouts"] == 0
    assert sum("event=score_failed" in r.message for r in caplog.records) == 5


def test_a_hanging_scorer_is_cut_at_the_timeout_without_leaking_a_thread_or_process(user_envs):
    task = Task("echo-1", "?", "train")
    threads_before = threading.active_count()
    with ScorePool("user_envs:Echo", workers=1, timeout_s=0.5) as pool:
        [first] = pool.score(task, ["0.5"])            # the worker is up
        workers_before = _scorers()
        started = time.monotonic()
        hung = pool.score(task, ["sleep", "sleep", "0.75"])
        took = time.monotonic() - started
        after = _scorers()
        stats = pool.stats()
    assert first.reward == 0.5
    assert [s.reward for s in hung] == [0.0, 0.0, 0.75] and all("scorer timeout" in s.error for s in hung[:2])
    assert took < 2 * 0.5 + 2 * 3.0                    # two cuts and two fresh workers, not an hour
    assert stats["timeouts"] == 2 and stats["restarts"] == 2
    assert not workers_before & after and len(after) == 1   # the hung ones are gone, one fresh worker serves
    assert threading.active_count() == threads_before and _pool_threads() == 0
    assert not _scorers()                              # closing the pool ends its worker


def test_a_dying_scorer_and_its_sandbox_child_are_cleaned_up(user_envs):
    task = Task("echo-1", "?", "train")
    marker = "SPECRL_TEST_SANDBOX_SLEEP"
    with ScorePool("user_envs:Echo", workers=1, timeout_s=1.0) as pool:
        died, sleeper, fine = pool.score(task, ["die", f"sandbox-sleep {marker}", "1"])
    assert died.reward == 0.0 and "died (exit status 3)" in died.error
    assert sleeper.reward == 0.0 and "timeout" in sleeper.error and fine.reward == 1.0
    time.sleep(0.5)                                    # the kernel delivers the parent-death signal
    left = [p for p in psutil.process_iter(["cmdline"]) if any(marker in part for part in (p.info["cmdline"] or []))]
    assert not left, left


def test_groups_are_scored_in_parallel_and_done_runs_once_per_group(user_envs):
    done: list[tuple[list, float]] = []
    with ScorePool("user_envs:Slow", workers=3, timeout_s=5.0) as pool:
        pool.score(Task("slow-0", "?", "train"), ["ab"] * 3)        # all three workers up
        started = time.monotonic()
        futures = [pool.submit(Task(f"slow-{i}", "?", "train"), ["ab", "abc", "abcd"],
                               lambda scores, busy: done.append((scores, busy))) for i in range(2)]
        results = [f.result() for f in futures]
        took = time.monotonic() - started
    assert [[s.reward for s in r] for r in results] == [[1.0, 0.0, 1.0]] * 2
    assert len(done) == 2 and all(busy >= 3 * 0.3 for _, busy in done)
    assert took < 6 * 0.3 * 0.75                      # six 0.3 s scores on three workers: not one after another


def test_a_closed_pool_answers_at_once(user_envs):
    pool = ScorePool("user_envs:Echo", workers=1, timeout_s=1.0)
    pool.close()
    [score] = pool.score(Task("echo-1", "?", "train"), ["1"])
    assert score.reward == 0.0 and "closed" in score.error


def test_the_pool_builds_builtin_environments_in_its_workers():
    task = next(itertools.islice(make_env("arithmetic").tasks("train", 0), 1))
    with ScorePool("arithmetic", workers=1, timeout_s=5.0) as pool:
        right, wrong = pool.score(task, [f"Answer: {task.data['answer']}", "Answer: -12345"])
    assert (right.reward, wrong.reward) == (1.0, 0.0) and right.details["method"] == "answer"
