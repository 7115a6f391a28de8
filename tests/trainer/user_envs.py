"""Environments a user might write, good and bad, for the tests (`make_env("user_envs:Name")`, with this
folder on sys.path). Each scores by what the completion says, so one test can ask for each behaviour."""

from __future__ import annotations

import itertools
import os
import time

from specrl.trainer.envs import Score, Task
from specrl.trainer.envs.sandbox import Limits, run_python


def _numbered(name, ask, split, seed):
    """Endless tasks "<name>-<split>-<seed>-<i>" asking "<ask> (<i>).", i = 1, 2, ..."""
    for i in itertools.count(1):
        yield Task(f"{name}-{split}-{seed}-{i}", f"{ask} ({i}).", split, {"i": i})


class Echo:
    """Scores what the completion asks for: "0.5" -> 0.5, "sleep" hangs, "raise" raises, "junk"
    returns a string, "nan"/"2"/"true" invalid numbers, "die" kills its own process,
    "sandbox-sleep <marker>" waits in a sandbox child far past the timeout."""

    name = "echo"
    timeout_s = 1.0

    def tasks(self, split, seed):
        return _numbered("echo", "Say a number", split, seed)

    def score(self, task, completion):
        if completion == "sleep":
            time.sleep(3600)
        if completion == "raise":
            raise KeyError("answer")
        if completion == "junk":
            return "one"
        if completion == "die":
            os._exit(3)
        if completion.startswith("sandbox-sleep"):
            run_python(f"import time\n{completion.split()[1]} = 1\ntime.sleep(3600)", limits=Limits(wall_s=3600,
                                                                                                    cpu_s=3600))
        if completion == "details":
            return Score(0.25, {"object": object(), 3: "three"})
        if completion == "true":
            return True
        return float(completion)


class Slow:
    """Reward 1 for an even-length completion, after `delay_s` seconds (a slow scorer)."""

    name = "slow"
    delay_s = 0.3

    def tasks(self, split, seed):
        return _numbered("slow", "Say something", split, seed)

    def score(self, task, completion):
        time.sleep(self.delay_s)
        return 1.0 if len(completion) % 2 == 0 else 0.0


class EvenLength:
    """Reward 1 for a completion of even length: random text solves it about half the time."""

    name = "even-length"

    def tasks(self, split, seed):
        words = ["alpha", "beta", "gamma", "delta"] if split == "train" else ["omega", "sigma", "kappa"]
        i = 0
        while True:
            word = words[i % len(words)]
            yield Task(f"even-{split}-{word}", f"Write anything about {word}.", split)
            i += 1

    def score(self, task, completion):
        return 1.0 if len(completion) % 2 == 0 else 0.0


class NoScore:
    def tasks(self, split, seed):
        yield Task("x", "?", split)


class BadSignature:
    def tasks(self):
        yield Task("x", "?", "train")

    def score(self, task, completion):
        return 0.0


class YieldsStrings:
    def tasks(self, split, seed):
        while True:
            yield "What is 2 + 2?"

    def score(self, task, completion):
        return 0.0


class NeedsArguments:
    def __init__(self, path):
        self.path = path

    def tasks(self, split, seed):
        yield Task("x", "?", split)

    def score(self, task, completion):
        return 0.0
