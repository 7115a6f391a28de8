"""One interface for every environment, built in or written by a user: a seeded task source and a scorer.

    env.tasks(split, seed) -> Task, Task, ...          deterministic, endless
    env.score(task, completion) -> float | Score       reward in [0, 1] (a Score adds details, error)
    checked_score(env, task, completion) -> Score      the same, but never raises and never returns junk

The loop scores in worker processes (`pool.ScorePool`), which also cut a scorer that runs past its
timeout. `Score.error` says why a completion earned nothing because it could not be evaluated at
all (no number in it, no code, a sandbox timeout, a scorer fault); it is None for a completion that
was evaluated, right or wrong. The reward is still the reward: a sample with an error is a valid
sample with reward 0, and the loop trains on it.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Protocol, runtime_checkable

from specrl.data.prompts import SPLITS

DEFAULT_TIMEOUT_S = 10.0   # a score() that runs longer scores 0 (an environment's `timeout_s` overrides it)
DEFAULT_MAX_TOKENS = 64    # completion tokens per sample (an environment's `max_tokens` overrides it)


@dataclass(frozen=True)
class Task:
    id: str                                   # "<env>-<10 hex of sha1(prompt)>": the same prompt has the same id
    prompt: str                               # the user turn, ending with how to give the answer
    split: str                                # "train" or "heldout"
    data: Mapping[str, Any] = field(default_factory=dict, hash=False)   # what the scorer needs; never shown

    @property
    def messages(self) -> list[dict[str, str]]:
        """The prompt as OpenAI chat messages (one user turn)."""
        return [{"role": "user", "content": self.prompt}]


@dataclass(frozen=True)
class Score:
    reward: float                             # in [0, 1]
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None                  # why nothing could be evaluated; None when it was


@runtime_checkable
class Environment(Protocol):
    """What `specrl rl --env package.module:ClassName` and `specrl eval-policy` need of a class.

    The class is built with no arguments (`make_env`; a constructor with a `cache_dir` parameter
    gets `<home>/cache`, for what it prepares once) in the supervisor, which draws the tasks, and
    again in every scoring worker process, which scores them: keep the constructor cheap and
    deterministic, and put what scoring needs into `Task.data` (it travels to the workers by
    pickle). The module must be importable there: on sys.path, or in the current directory.

    Optional class attributes (logs and reports name the environment by its `--env` spec):
        timeout_s: float     a score() running longer is cut (its worker process killed) and
                             scores 0; default DEFAULT_TIMEOUT_S; `--score-timeout` overrides it
        max_tokens: int      completion tokens per sample when --max-tokens is not given

    A score() that raises, hangs, returns something other than a finite number in [0, 1] (or a
    Score with one), or kills its process scores 0 with the reason in `Score.error`; the loop
    goes on.
    """

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        """An endless stream of Tasks of one split ("train" or "heldout"; held-out tasks are never
        trained on); the same (split, seed) gives the same stream."""
        ...

    def score(self, task: Task, completion: str) -> float | Score:
        """The reward in [0, 1] of one completion (the assistant's text) for one task of this environment."""
        ...


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")


def task_id(env: str, prompt: str) -> str:
    return f"{env}-{hashlib.sha1(prompt.encode()).hexdigest()[:10]}"


def checked_score(env: Environment, task: Task, completion: str) -> tuple[Score, str | None]:
    """env.score, except that it never raises: (Score, fault), fault None unless the scorer failed.

    A scorer that raises or returns something other than a finite number in [0, 1] or a Score
    with one gives reward 0, with the reason (`fault`) in `error`. Details are made JSON-safe
    (anything else becomes its repr), so a Score always crosses a process boundary.
    """
    try:
        result = env.score(task, completion)
    except BaseException as exc:  # noqa: BLE001 - any failure of a scorer becomes reward 0
        return _fault(f"scorer raised {type(exc).__name__}: {exc}"[:500])
    if isinstance(result, Score):
        if not _valid_reward(result.reward):
            return _fault(f"scorer returned an invalid reward: {result.reward!r:.200}")
        error = None if result.error is None else str(result.error)
        return Score(float(result.reward), _plain(result.details), error), None
    if _valid_reward(result):
        return Score(float(result)), None
    return _fault(f"scorer returned an invalid score: {result!r:.200}")


def _valid_reward(reward: Any) -> bool:
    return isinstance(reward, numbers.Real) and not isinstance(reward, bool) and math.isfinite(reward) \
        and 0.0 <= reward <= 1.0


def _plain(details: Any) -> dict[str, Any]:
    try:
        plain = json.loads(json.dumps(details, default=repr))
    except (TypeError, ValueError):            # keys that are not strings, numbers or None; a cycle
        return {"details": repr(details)[:1000]}
    return plain if isinstance(plain, dict) else {"details": plain}


def _fault(reason: str) -> tuple[Score, str]:
    return Score(0.0, {}, reason), reason
