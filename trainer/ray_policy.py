"""The policy trainer (GRPO) as a Ray actor (`specrl rl --ray`).

The actor holds a `GRPOTrainer` (the policy, its reference, the optimizer) in a process of its own that Ray places
and restarts when it dies (`max_restarts`): a restarted trainer resumes from its checkpoint, written at every
publish (and from a version it published after it, `GRPOTrainer._resume`), so steps since the last publish are
lost and the step call in flight is run again on the resumed state (`max_task_retries`). `RemotePolicyTrainer`
gives the RL loop the trainer's interface (`step`, `publish`, `version`, `steps`, `published`) on that
actor; the batch goes to it by Ray's object store. Needs the `[ray]` extra.
"""

from __future__ import annotations

from pathlib import Path

from specrl.errors import SpecrlError
from specrl.trainer.grpo import GRPOConfig, GRPOTrainer, Rollout, StepStats
from specrl.weights import WeightsStore
from specrl.weights.object_store import DurableStore, share

START_TIMEOUT_S = 300.0  # placement, the process's start and the model's load


class PolicyTrainerActor:
    def __init__(self, model_dir: Path, config: GRPOConfig, state_path: Path, store_root: Path, threads: int,
                 deployment: str, durable_store: str = ""):
        import torch

        torch.set_num_threads(threads)
        self.store, self.deployment = WeightsStore(store_root), deployment
        self.durable = DurableStore(durable_store) if durable_store else None
        self.trainer = GRPOTrainer(model_dir, config, state_path=state_path, store=self.store)

    def state(self) -> dict:
        return {"steps": self.trainer.steps, "published": list(self.trainer.published)}

    def step(self, rollouts: list[Rollout]) -> tuple[StepStats, dict]:
        return self.trainer.step(rollouts), self.state()

    def publish(self, metrics: dict) -> tuple[str, dict]:
        """-> (the version published, the state): into the store, then the durable store (`--durable-store`, when
        that is another place) and the object store, where the replicas pull it from. FloatingPointError
        (non-finite weights) reaches the caller."""
        version = self.trainer.publish(self.store, metrics)
        share(self.deployment, self.store, "policy", version, self.durable)
        return version, self.state()


class RemotePolicyTrainer:
    """The RL loop's view of a PolicyTrainerActor: GRPOTrainer's interface, each call waited for."""

    def __init__(self, model_dir: Path, config: GRPOConfig, state_path: Path, store: WeightsStore, threads: int,
                 deployment: str, durable_store: str = ""):
        import ray

        remote = ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=threads)(PolicyTrainerActor)
        self.store = store
        self.actor = remote.remote(model_dir, config, state_path, store.root, threads, deployment, durable_store)
        try:
            self._state = ray.get(self.actor.state.remote(), timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.kill(self.actor)
            raise SpecrlError(f"the policy trainer actor did not start within {START_TIMEOUT_S:g}s: does the Ray "
                              f"cluster have {threads} CPU(s) free?") from None

    @property
    def steps(self) -> int:
        return self._state["steps"]

    @property
    def published(self) -> list[str]:
        return self._state["published"]

    @property
    def version(self) -> str:
        return self.published[-1]

    def step(self, rollouts: list[Rollout]) -> StepStats:
        import ray

        stats, self._state = ray.get(self.actor.step.remote(rollouts))
        return stats

    def publish(self, store: WeightsStore, metrics: dict) -> str:
        import ray

        if store.root != self.store.root:
            raise ValueError(f"the policy trainer actor publishes into {self.store.root}, not {store.root}")
        version, self._state = ray.get(self.actor.publish.remote(metrics))
        return version

    def close(self) -> None:
        import ray

        ray.kill(self.actor)
