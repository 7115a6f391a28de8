"""Environments for the policy RL loop: seeded task sources with scorers (installed as `specrl.trainer.envs`).

    env = make_env("arithmetic")                       # or "code", "format"
    task = next(env.tasks("train", seed=0))            # Task(id, prompt, split, data); task.messages for chat
    score = safe_score(env, task, completion, timeout_s=10.0)    # Score(reward in [0, 1], details, error)

See `base` for the interface, and each module for its tasks, splits and scoring rule.
"""

from __future__ import annotations

from typing import Any

from specrl.trainer.envs.arithmetic import ArithmeticEnv
from specrl.trainer.envs.base import Environment, Score, Task, safe_score
from specrl.trainer.envs.code import CodeEnv
from specrl.trainer.envs.format import FormatEnv

ENVIRONMENTS: dict[str, type] = {"arithmetic": ArithmeticEnv, "code": CodeEnv, "format": FormatEnv}


def make_env(name: str, **options: Any) -> Environment:
    """The environment called `name`, built with `options` (e.g. `limits=` for code).

    Raises ValueError for an unknown name, naming the valid ones.
    """
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; choose one of: {', '.join(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](**options)


__all__ = ["ENVIRONMENTS", "ArithmeticEnv", "CodeEnv", "Environment", "FormatEnv", "Score", "Task", "make_env",
           "safe_score"]
