"""The drafter trainer as a Ray actor (`specrl up --ray`).

The same loop as `specrl train-drafter` (`run_trainer`), in a process Ray restarts when it dies (`max_restarts`,
and the `run` call is retried there): the trainer then resumes from its checkpoint and re-reads its pending
records, so nothing acked is lost and nothing is trained twice (acks follow checkpoints). `stop` asks the loop to
finish (checkpoint, ack) and `run` returns the trainer's counters. Needs the `[ray]` extra.
"""

from __future__ import annotations

import os
import threading

from specrl.config import Settings
from specrl.trainer.main import run_trainer


class DrafterTrainerActor:
    def __init__(self, settings: Settings):
        self.settings = settings
        self._stop = threading.Event()

    def run(self) -> dict:
        trainer = run_trainer(self.settings, self._stop.is_set)
        return {"steps": trainer.step, "records": trainer.records, "serving_drafter": trainer.serving_version}

    def stop(self) -> None:
        self._stop.set()

    def process(self) -> dict:
        """-> this incarnation's pid and whether Ray restarted the actor to get it."""
        import ray

        return {"pid": os.getpid(), "restarted": ray.get_runtime_context().was_current_actor_reconstructed}


def start_trainer_actor(settings: Settings, max_restarts: int = -1):
    """-> (the actor, the ref of its running `run`). max_restarts -1: restarted whenever it dies. Threaded (two
    calls at once) so that `stop` and `process` answer while `run` loops; one CPU per torch thread."""
    import ray

    actor_class = ray.remote(max_restarts=max_restarts, max_task_retries=-1, max_concurrency=2,
                             num_cpus=max(1, settings.threads))(DrafterTrainerActor)
    actor = actor_class.remote(settings)
    return actor, actor.run.remote()
