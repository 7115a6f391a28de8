"""One interface for every environment: a seeded task source and a scorer.

    env.tasks(split, seed) -> Task, Task, ...        deterministic, endless
    env.score(task, completion) -> Score            reward in [0, 1], details, error
    safe_score(env, task, completion, timeout_s)    the same, but never raises and never hangs

`Score.error` says why a completion earned nothing because it could not be evaluated at all (no
number in it, no code, a sandbox timeout, a scorer fault); it is None for a completion that was
evaluated, right or wrong. The reward is still the reward: a sample with an error is a valid
sample with reward 0, and the loop trains on it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Protocol, runtime_checkable

from specrl.data.prompts import SPLITS

log = logging.getLogger("specrl.trainer.envs")


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
    name: str

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        """An endless stream of tasks of one split; the same (split, seed) gives the same stream."""
        ...

    def score(self, task: Task, completion: str) -> Score:
        """The reward of one completion for one task of this environment."""
        ...


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")


def task_id(env: str, prompt: str) -> str:
    return f"{env}-{hashlib.sha1(prompt.encode()).hexdigest()[:10]}"


def safe_score(env: Environment, task: Task, completion: str, timeout_s: float = 10.0) -> Score:
    """env.score, except that it never raises and returns within about timeout_s.

    A scorer that raises, runs past timeout_s or returns something other than a Score with a
    finite reward in [0, 1] gives reward 0 with the reason in `error`, logged as one WARNING line.
    A scorer that runs past the timeout is left running in its daemon thread (Python cannot stop a
    thread); its result is dropped. The code environment bounds its own runs in a subprocess, so
    this is the backstop, not the limit that usually fires.
    """
    box: list[Score | BaseException] = []

    def run() -> None:
        try:
            box.append(env.score(task, completion))
        except BaseException as exc:  # noqa: BLE001 - any failure of a scorer becomes reward 0
            box.append(exc)

    worker = threading.Thread(target=run, name=f"score-{task.id}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not box:
        return _failed(env, task, f"scorer timeout: no score after {timeout_s:g}s")
    result = box[0]
    if isinstance(result, BaseException):
        return _failed(env, task, f"scorer raised {type(result).__name__}: {result}")
    if not isinstance(result, Score) or not _valid_reward(result.reward):
        return _failed(env, task, f"scorer returned an invalid score: {result!r:.200}")
    return result


def _valid_reward(reward: Any) -> bool:
    return isinstance(reward, (int, float)) and not isinstance(reward, bool) and math.isfinite(reward) \
        and 0.0 <= reward <= 1.0


def _failed(env: Environment, task: Task, reason: str) -> Score:
    name = getattr(env, "name", type(env).__name__)
    log.warning("event=score_failed env=%s task=%s error=%r", name, task.id, reason)
    return Score(0.0, {}, reason)
