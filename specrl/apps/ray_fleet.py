"""The loop's processes placed on Ray (`specrl up --ray`, `specrl rl --ray`).

- the serving replicas: one Ray Serve deployment behind its proxy and a front that routes by prefix
  (`specrl.serving.ray_replicas`);
- the drafter trainer: a Ray actor that Ray restarts when its process dies (`specrl.trainer.ray_actor`);
- with `specrl rl`: the policy trainer (GRPO, `specrl.trainer.ray_policy`), a rollout worker
  (`specrl.trainer.ray_rollout`) and the scoring workers (`specrl.trainer.envs.ray_worker`), each a Ray actor.
The process that runs the command stays the single controller (as verl's driver): it starts the roles, moves
batches between them and stops them; Ray places them on the cluster (a local one, or `--ray ADDRESS`) and
restarts the ones that die.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from specrl.apps.launch import shared_threads
from specrl.config import Settings
from specrl.errors import InvalidRequestError


@dataclass
class Fleet:
    address: str | None  # None: a local Ray cluster
    replicas: int
    max_replicas: int
    router: str = "prefix"
    scale_down_s: float | None = None  # autoscaled: seconds the load must want fewer replicas before one goes (None:
    # serving.ray_replicas.SCALE_DOWN_S)
    trainers: int = 1  # processes beside the replicas that compute with torch: the drafter trainer (+ GRPO in rl)
    trainer: object = None  # the drafter trainer actor, and the ref of its running loop
    trainer_run: object = None

    @classmethod
    def check(cls, ray: str, replicas: int, max_replicas: int, router: str = "prefix", trainers: int = 1,
              scale_down_s: float | None = None) -> "Fleet":
        import importlib.util

        if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
            raise InvalidRequestError("--ray needs Ray Serve: pip install 'specrl[ray]' (`make install` does)")
        if replicas < 1 or (max_replicas and max_replicas < replicas):
            raise InvalidRequestError(f"--replicas must be >= 1 and --max-replicas 0 or >= --replicas (got {replicas}, "
                                      f"{max_replicas})")
        if scale_down_s is not None and not scale_down_s >= 0:
            raise InvalidRequestError(f"--scale-down-after must be >= 0 seconds (got {scale_down_s})")
        if scale_down_s is not None and not max_replicas > replicas:
            raise InvalidRequestError("--scale-down-after needs --max-replicas above --replicas (a fixed fleet never "
                                      "scales down)")
        if ray not in ("local", "auto"):
            _check_answers(ray)
        return cls(None if ray == "local" else ray, replicas, max_replicas, router, scale_down_s, trainers)

    def threads(self, settings: Settings) -> int:
        """Torch threads of each replica and trainer: the cores shared among them."""
        return shared_threads(settings.threads, self.replicas + self.trainers)

    def cpus(self, settings: Settings) -> float:
        """Ray CPUs a local cluster needs: a CPU per thread of each replica (up to max_replicas) and trainer, and
        one shared by the scoring workers (the rollout worker takes none: it waits on HTTP). Ray's CPUs are for
        placement: the torch threads share the machine's cores (`threads`)."""
        return ((self.max_replicas or self.replicas) + self.trainers) * self.threads(settings) + 1

    def start(self, settings: Settings) -> str:
        """Deploy the replicas (each with its share of the cores), wait until Serve runs them all -> the proxy's URL."""
        from specrl.serving.ray_replicas import run_replicas

        durable = settings.durable_store or str(settings.store_path)  # the trainers' store: the fallback
        return run_replicas(settings.replace(threads=self.threads(settings), durable_store=durable), self.replicas,
                            self.max_replicas or None, self.address, self.router, cpus=self.cpus(settings),
                            scale_down_s=self.scale_down_s)

    def start_trainer(self, settings: Settings) -> None:
        from specrl.trainer.ray_actor import start_trainer_actor

        self.trainer, self.trainer_run = start_trainer_actor(settings.replace(threads=self.threads(settings)))

    def trainer_ended(self) -> bool:
        """Its loop returned or failed for good (a dead process is restarted, and its loop with it)."""
        import ray

        return self.trainer_run is not None and bool(ray.wait([self.trainer_run], timeout=0)[0])

    def stop_trainer(self) -> None:
        import ray

        if self.trainer is not None:
            self.trainer.stop.remote()
            ray.wait([self.trainer_run], timeout=60)  # it checkpoints and acks
            self.trainer = None

    def stop(self) -> None:
        from specrl.serving.ray_replicas import stop_replicas

        self.stop_trainer()
        stop_replicas()

    # ---- the RL roles (`specrl rl --ray`)

    def policy_trainer(self, settings: Settings, model_dir: Path, config, state_path: Path, store):
        from specrl.trainer.ray_policy import RemotePolicyTrainer

        return RemotePolicyTrainer(model_dir, config, state_path, store, self.threads(settings), settings.deployment,
                                   settings.durable_store)

    def rollout_client(self, url: str, model: str, *, n: int, max_tokens: int):
        from specrl.trainer.ray_rollout import RemoteRolloutClient

        return RemoteRolloutClient(url, model, n=n, max_tokens=max_tokens)

    def score_pool(self, env_name: str, *, workers: int, timeout_s: float, cache_dir: Path):
        from specrl.trainer.envs import ScorePool
        from specrl.trainer.envs.ray_worker import RayScoreWorker

        return ScorePool(env_name, workers=workers, timeout_s=timeout_s, cache_dir=cache_dir,
                         start_worker=functools.partial(RayScoreWorker, num_cpus=1 / workers))  # one CPU in all


def _check_answers(address: str, timeout_s: float = 3.0) -> None:
    """A Ray address (host:port, or ray://host:port) that nothing answers is one line now, not Ray's minutes of
    retries."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise InvalidRequestError(f"--ray {address}: give HOST:PORT of a Ray cluster's head (or ray://HOST:PORT)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise InvalidRequestError(f"--ray {address}: no Ray cluster answers there ({exc.strerror or exc}); start one "
                                  "with `ray start --head`, or leave ADDRESS out for a local cluster") from None
