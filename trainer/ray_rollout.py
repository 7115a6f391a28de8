"""A rollout worker as a Ray actor (`specrl rl --ray`): it asks the serving replicas for samples.

The actor holds a `RolloutClient` (n samples per task with log-probs, token ids and the versions of every token)
in a process Ray places and restarts when it dies (`max_restarts`); a sample call in flight then runs again on the
new process (`max_task_retries`): the group is sampled anew, never half-delivered. `RemoteRolloutClient` gives the
RL loop the client's interface (`sample`, `complete`, `tokens`, `seconds`) on that actor. Needs the `[ray]` extra.
"""

from __future__ import annotations

from specrl.trainer.grpo import Rollout
from specrl.trainer.rollout import RolloutClient


class RolloutWorkerActor:
    def __init__(self, server: str, model: str, n: int, max_tokens: int):
        self.client = RolloutClient(server, model, n=n, max_tokens=max_tokens)

    def sample(self, task, group: int) -> tuple[list[Rollout], int, float]:
        """-> (the group's rollouts, this call's completion tokens, its seconds)."""
        tokens, seconds = self.client.tokens, self.client.seconds
        rollouts = self.client.sample(task, group)
        return rollouts, self.client.tokens - tokens, self.client.seconds - seconds

    def complete(self, messages: list[dict], n: int, temperature: float, seed: int | None) -> tuple[dict, int, float]:
        tokens, seconds = self.client.tokens, self.client.seconds
        data = self.client.complete(messages, n=n, temperature=temperature, seed=seed)
        return data, self.client.tokens - tokens, self.client.seconds - seconds


class RemoteRolloutClient:
    """The RL loop's view of a RolloutWorkerActor: RolloutClient's interface; `tokens` and `seconds` count the
    calls made through this object (a restarted actor's own counters start over)."""

    def __init__(self, server: str, model: str, *, n: int, max_tokens: int):
        import ray

        remote = ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=0)(RolloutWorkerActor)
        self.actor = remote.remote(server, model, n, max_tokens)
        self.n, self.max_tokens = n, max_tokens
        self.tokens, self.seconds = 0, 0.0

    def sample(self, task, group: int) -> list[Rollout]:
        import ray

        rollouts, tokens, seconds = ray.get(self.actor.sample.remote(task, group))
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        return rollouts

    def complete(self, messages: list[dict], *, n: int, temperature: float, seed: int | None = None) -> dict:
        import ray

        data, tokens, seconds = ray.get(self.actor.complete.remote(messages, n, temperature, seed))
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        return data

    def close(self) -> None:
        import ray

        ray.kill(self.actor)
