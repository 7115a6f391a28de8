"""Environments for the policy RL loop: seeded task sources with scorers (installed as `specrl.trainer.envs`).

    env = make_env("humaneval")                        # or "arithmetic", "code", "format", "ifeval", "pkg.mod:Class"
    task = next(env.tasks("train", seed=0))            # Task(id, prompt, split, data); task.messages for chat
    with ScorePool("humaneval", workers=4, timeout_s=30.0) as pool:   # worker processes, each score time-bounded
        [score] = pool.score(task, [completion])       # Score(reward in [0, 1], details, error)

See `base` for the interface a user's environment implements, `registry` for how a spec resolves,
`pool` for the scoring workers, `sandbox` and `solution` for running a code answer, and each
environment's module for its tasks, splits and scoring rule.
"""

from __future__ import annotations

from specrl.trainer.envs.arithmetic import ArithmeticEnv
from specrl.trainer.envs.base import Environment, Score, Task, checked_score
from specrl.trainer.envs.code import CodeEnv
from specrl.trainer.envs.format import FormatEnv
from specrl.trainer.envs.humaneval import HumanEvalEnv
from specrl.trainer.envs.ifeval import IFEvalEnv
from specrl.trainer.envs.pool import ScorePool
from specrl.trainer.envs.registry import ENV_HELP, ENVIRONMENTS, env_max_tokens, env_timeout_s, make_env, take_tasks

__all__ = ["ENVIRONMENTS", "ENV_HELP", "ArithmeticEnv", "CodeEnv", "Environment", "FormatEnv", "HumanEvalEnv",
           "IFEvalEnv",
           "Score", "ScorePool", "Task", "checked_score", "env_max_tokens", "env_timeout_s", "make_env",
           "take_tasks"]
