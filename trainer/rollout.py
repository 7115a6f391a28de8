"""Rollouts through the live server: n samples per task with log-probs and token ids, scored by
the environment. Talks to the server over its OpenAI-compatible API only."""

from __future__ import annotations

import json
import math
import time
import urllib.request

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

    def sample(self, env, task, group: int, score) -> list[Rollout]:
        """n samples at TEMPERATURE, each scored."""
        data = self.complete(task_messages(task), n=self.n, temperature=TEMPERATURE)
        rollouts = []
        for choice, versions in zip(data["choices"], data["specrl"]["versions"]):
            text = choice["message"]["content"]
            logprobs = [entry["logprob"] for entry in (choice["logprobs"] or {}).get("content", [])]
            result = score(env, task, text)
            rollouts.append(Rollout(group, choice["prompt_token_ids"], choice["token_ids"], logprobs, versions,
                                    result.reward, text, result.error))
        return rollouts


def mean_and_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of a normal-approximation 95% confidence interval."""
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, 1.96 * math.sqrt(var / len(values))
