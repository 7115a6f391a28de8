"""Rollouts through the live server (n samples per task with log-probs and token ids; it talks to the
server over its OpenAI-compatible API only), and the pipeline that takes them from the Generator
through the Environment's scoring pool to the Trainer."""

from __future__ import annotations

import json
import math
import queue
import threading
import time
import urllib.request

from specrl.trainer.envs import ScorePool
from specrl.trainer.grpo import Rollout

TEMPERATURE = 1.0  # rollouts sample the policy itself, so recorded log-probs are the policy's own


def task_messages(task) -> list[dict]:
    messages = getattr(task, "messages", None)
    return list(messages) if messages else [{"role": "user", "content": task.prompt}]


class RolloutClient:
    def __init__(self, server: str, model: str, *, n: int, max_tokens: int, timeout_s: float = 600):
        self.url = server.rstrip("/") + "/v1/chat/completions"
        self.model, self.n, self.max_tokens, self.timeout_s = model, n, max_tokens, timeout_s
        self.tokens = 0
        self.seconds = 0.0

    def complete(self, messages: list[dict], *, n: int, temperature: float, seed: int | None = None) -> dict:
        body = {"model": self.model, "messages": messages, "n": n, "max_tokens": self.max_tokens,
                "temperature": temperature, "logprobs": True, "top_logprobs": 0, "return_token_ids": True}
        if seed is not None:
            body["seed"] = seed
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
            data = json.loads(resp.read())
        self.seconds += time.perf_counter() - started
        self.tokens += data["usage"]["completion_tokens"]
        return data

    def sample(self, task, group: int) -> list[Rollout]:
        """n samples at TEMPERATURE, not scored yet (reward 0 until the environment sets it)."""
        data = self.complete(task_messages(task), n=self.n, temperature=TEMPERATURE)
        return [Rollout(group, choice["prompt_token_ids"], choice["token_ids"],
                        [entry["logprob"] for entry in (choice["logprobs"] or {}).get("content", [])], versions,
                        0.0, choice["message"]["content"])
                for choice, versions in zip(data["choices"], data["specrl"]["versions"])]


class RolloutPipeline:
    """Generator -> Environment -> Trainer, the three stages running at once, so a slow scorer never
    idles the server and a slow trainer step never idles the scorers.

    generator    the rollout thread: `hand_off(task, rollouts)` gives a sampled group to the scoring
                 pool and returns at once to sampling. It waits only while `max_scoring` groups are
                 being scored (waited for the environment), or while `max_scoring + max_scored`
                 groups are past it and not yet taken by the trainer (waited for the trainer)
    environment  the pool's workers score a group's completions in parallel and queue the scored
                 group; a worker with nothing to score waits (waited for the generator). Workers
                 never wait for the trainer, so anything else scored in the same pool (the loop's
                 evaluations) goes through while training pauses
    trainer      the main thread: `take(groups)` returns the next scored groups, waiting while there
                 are none (waited for the environment); `trained(seconds)` counts its step time

    `stats()`: per stage its count, its rate over the wall time since `start()`, its busy seconds and
    the seconds it waited for each other stage. The environment's seconds are per worker (summed over
    the workers, divided by their number), so the three stages read on one clock.
    """

    def __init__(self, pool: ScorePool, *, max_scoring: int, max_scored: int):
        self.pool = pool
        self._scoring = threading.BoundedSemaphore(max_scoring)             # released when a group is scored
        self._room = threading.BoundedSemaphore(max_scoring + max_scored)   # released when the trainer takes it
        self._scored: queue.Queue = queue.Queue()                            # bounded by _room
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._c: dict[str, float] = {}
        self._held = {"held_scoring": 0, "held_scored": 0}                    # rollouts in each stage now
        self.start()

    def start(self) -> None:
        """Count from now (e.g. after a first evaluation the stages took no part in). Rollouts already
        in the pipeline count as generated (and scored, when they are), so that the counts stay
        ordered: generated >= scored >= taken."""
        with self._lock:
            self._started, self._pool_at_start = time.monotonic(), self.pool.stats()
            self._c = dict.fromkeys(("generated", "generator_busy_s", "generator_paused_s",
                                     "generator_waited_environment_s", "generator_waited_trainer_s", "scored",
                                     "environment_busy_s", "taken", "trainer_busy_s", "trainer_waited_environment_s"),
                                    0)
            self._c["generated"] = self._held["held_scoring"] + self._held["held_scored"]
            self._c["scored"] = self._held["held_scored"]

    def stop(self) -> None:
        """Release whoever waits in hand_off or take."""
        self._stop.set()

    def hand_off(self, task, rollouts: list[Rollout], *, busy_s: float = 0.0, paused_s: float = 0.0) -> bool:
        """The generator's side: hand a sampled group to the environment (`busy_s`: the request time
        it took, `paused_s`: time the generator was held back). False when the pipeline stopped."""
        waited = time.monotonic()
        if not self._acquire(self._room):
            return False
        room = time.monotonic()
        if not self._acquire(self._scoring):
            self._room.release()
            return False
        self._add(generated=len(rollouts), held_scoring=len(rollouts), generator_busy_s=busy_s,
                  generator_paused_s=paused_s, generator_waited_trainer_s=room - waited,
                  generator_waited_environment_s=time.monotonic() - room)
        self.pool.submit(task, [r.text for r in rollouts], lambda scores, busy: self._done(rollouts, scores, busy))
        return True

    def take(self, groups: int, deadline: float | None = None) -> list[Rollout] | None:
        """The trainer's side: the rollouts of the next `groups` scored groups; None when the
        pipeline stops or `deadline` (time.monotonic) passes first."""
        batch, waited = [], time.monotonic()
        while len(batch) < groups:
            if self._stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                for group in batch:             # back in line for a later take
                    self._scored.put(group)
                self._add(trainer_waited_environment_s=time.monotonic() - waited)
                return None
            try:
                batch.append(self._scored.get(timeout=0.1))
            except queue.Empty:
                continue
        for _ in batch:
            self._room.release()
        rollouts = [r for group in batch for r in group]
        self._add(taken=len(rollouts), held_scored=-len(rollouts),
                  trainer_waited_environment_s=time.monotonic() - waited)
        return rollouts

    def trained(self, seconds: float) -> None:
        """The trainer's busy time (a GRPO step and its publish)."""
        self._add(trainer_busy_s=seconds)

    def stats(self) -> dict:
        with self._lock:
            c, started, before = dict(self._c), self._started, self._pool_at_start
        pool = self.pool.stats()
        seconds, workers = time.monotonic() - started, pool["workers"]

        def rate(n: float) -> float | None:
            return n / seconds if seconds > 0 else None

        return {"seconds": round(seconds, 1), "stages": {
            "generator": {"rollouts": c["generated"], "rollouts_per_s": rate(c["generated"]),
                          "busy_s": c["generator_busy_s"], "paused_s": c["generator_paused_s"],
                          "waited_s": {"environment": c["generator_waited_environment_s"],
                                       "trainer": c["generator_waited_trainer_s"]}},
            "environment": {"scores": c["scored"], "scores_per_s": rate(c["scored"]), "workers": workers,
                            "busy_s": c["environment_busy_s"] / workers,
                            "waited_s": {"generator": (pool["idle_s"] - before["idle_s"]) / workers},
                            **{k: pool[k] - before[k] for k in ("timeouts", "deaths", "faults", "restarts")}},
            "trainer": {"samples": c["taken"], "samples_per_s": rate(c["taken"]), "busy_s": c["trainer_busy_s"],
                        "waited_s": {"environment": c["trainer_waited_environment_s"]}}}}

    def _acquire(self, slots: threading.BoundedSemaphore) -> bool:
        while not slots.acquire(timeout=0.1):
            if self._stop.is_set():
                return False
        if self._stop.is_set():
            slots.release()
            return False
        return True

    def _done(self, rollouts: list[Rollout], scores: list, busy_s: float) -> None:
        """On the lane that scored the group's last completion: record it, queue it for the trainer."""
        for rollout, score in zip(rollouts, scores):
            rollout.reward, rollout.score_error = score.reward, score.error
        self._add(scored=len(rollouts), held_scoring=-len(rollouts), held_scored=len(rollouts),
                  environment_busy_s=busy_s)
        self._scoring.release()
        self._scored.put(rollouts)

    def _add(self, **amounts: float) -> None:
        with self._lock:
            for key, amount in amounts.items():
                counts = self._held if key in self._held else self._c   # _held: in the pipeline now
                counts[key] += amount


def mean_and_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of a normal-approximation 95% confidence interval."""
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, 1.96 * math.sqrt(var / len(values))


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator of Chen et al. (2021) from n samples of which c passed:
    1 - C(n - c, k) / C(n, k), the chance that k of the n drawn without replacement hold a pass
    (computed as a product, which stays exact in floating point for large n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail
