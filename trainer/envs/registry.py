"""Environments by name: the built-in ones, or a user's class as `package.module:ClassName`.

    make_env("humaneval")                        # a built-in (ENVIRONMENTS)
    make_env("my_envs.words:ReverseWord")       # a user class implementing `base.Environment`

A spec that does not resolve (no such module, no such class, a class lacking `tasks` or `score`,
a constructor that fails) raises InvalidRequestError with one line naming what is missing: the
CLI checks the spec this way before it starts any process.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path
from typing import Any

from specrl.errors import InvalidRequestError, SpecrlError
from specrl.trainer.envs.arithmetic import ArithmeticEnv
from specrl.trainer.envs.base import DEFAULT_MAX_TOKENS, DEFAULT_TIMEOUT_S, Environment, Task
from specrl.trainer.envs.code import CodeEnv
from specrl.trainer.envs.format import FormatEnv
from specrl.trainer.envs.humaneval import HumanEvalEnv
from specrl.trainer.envs.ifeval import IFEvalEnv

ENVIRONMENTS: dict[str, type] = {"arithmetic": ArithmeticEnv, "code": CodeEnv, "format": FormatEnv,
                                 "humaneval": HumanEvalEnv, "ifeval": IFEvalEnv}
ENV_HELP = f"{', '.join(ENVIRONMENTS)}, or package.module:ClassName (a class implementing " \
           "specrl.trainer.envs.base.Environment)"
_INTERFACE = {"tasks": ("split", "seed"), "score": ("task", "completion")}


def make_env(spec: str, *, cache_dir: Path | None = None, **options: Any) -> Environment:
    """The environment `spec` names, built with `options` (e.g. `limits=` for code).

    `cache_dir` goes to a constructor that has a `cache_dir` parameter (where it keeps what it
    prepares once); the apps pass `<home>/cache`. Raises InvalidRequestError for a spec that does
    not resolve, naming the valid built-in names or what the class lacks.
    """
    cls = ENVIRONMENTS.get(spec) or _user_class(spec)
    if cache_dir is not None and "cache_dir" in _parameters(cls):
        options["cache_dir"] = cache_dir
    try:
        env = cls(**options)
    except Exception as exc:  # noqa: BLE001 - a user's constructor: one line, whatever it raised
        raise InvalidRequestError(f"environment {spec}: {cls.__name__}() failed: {type(exc).__name__}: {exc}",
                                  param="env") from None
    for method, arguments in _INTERFACE.items():
        if not callable(getattr(env, method, None)):
            raise InvalidRequestError(f"environment {spec}: {cls.__name__} has no method {method}"
                                      f"({', '.join(arguments)}) (see specrl.trainer.envs.base.Environment)",
                                      param="env")
        try:
            inspect.signature(getattr(env, method)).bind(*arguments)
        except TypeError:
            raise InvalidRequestError(f"environment {spec}: {cls.__name__}.{method} cannot be called as "
                                      f"{method}({', '.join(arguments)})", param="env") from None
        except ValueError:                     # no signature to inspect (a builtin): call it and see
            pass
    return env


def take_tasks(env: Environment, spec: str, split: str, seed: int, n: int) -> list[Task]:
    """The first `n` distinct tasks (by id) of a split's stream, each checked to be a Task.

    A repeated id is skipped, and after max(n, 64) repeats in a row the split is taken as
    exhausted: a finite split (HumanEval's held-out problems) gives all it has, each once.
    Raises InvalidRequestError, naming the environment, for a stream that raises, yields
    something else than a Task, or yields nothing.
    """
    tasks: list[Task] = []
    seen, repeats = set(), 0
    try:
        for task in env.tasks(split, seed):
            if not isinstance(task, Task):
                raise InvalidRequestError(f"environment {spec}: tasks({split!r}, {seed}) yielded a "
                                          f"{type(task).__name__}, not a specrl.trainer.envs.Task", param="env")
            if task.id in seen:
                repeats += 1
                if repeats > max(n, 64):
                    break
                continue
            seen.add(task.id)
            tasks.append(task)
            repeats = 0
            if len(tasks) >= n:
                break
    except SpecrlError:
        raise
    except Exception as exc:  # noqa: BLE001 - a user's task stream: one line, whatever it raised
        raise InvalidRequestError(f"environment {spec}: tasks({split!r}, {seed}) failed: {type(exc).__name__}: "
                                  f"{exc}", param="env") from None
    if not tasks:
        raise InvalidRequestError(f"environment {spec}: tasks({split!r}, {seed}) yielded no tasks", param="env")
    return tasks


def env_timeout_s(env: Environment) -> float:
    return float(getattr(env, "timeout_s", DEFAULT_TIMEOUT_S))


def env_max_tokens(env: Environment) -> int:
    return int(getattr(env, "max_tokens", DEFAULT_MAX_TOKENS))


def _user_class(spec: str) -> type:
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise InvalidRequestError(f"unknown environment {spec!r}: use one of {ENV_HELP}", param="env")
    try:
        module = _import(module_name)
    except ImportError as exc:
        raise InvalidRequestError(f"environment {spec}: cannot import module {module_name!r} ({exc}); is its "
                                  "folder the current directory or on PYTHONPATH?", param="env") from None
    except Exception as exc:  # noqa: BLE001 - the module itself failed while importing
        raise InvalidRequestError(f"environment {spec}: importing {module_name} failed: {type(exc).__name__}: "
                                  f"{exc}", param="env") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise InvalidRequestError(f"environment {spec}: module {module_name} has no class {class_name!r}",
                                  param="env")
    return cls


def _import(module_name: str):
    """import_module, with the current directory on sys.path (last) as `python -m` would have it:
    a console script's sys.path lacks it."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        if exc.name != top or os.getcwd() in sys.path:
            raise
        sys.path.append(os.getcwd())
        return importlib.import_module(module_name)


def _parameters(cls: type) -> set[str]:
    try:
        return set(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return set()
