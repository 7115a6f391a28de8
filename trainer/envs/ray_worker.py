"""A scoring worker as a Ray actor: `ScorePool`'s lanes feed it as they feed a local worker process.

    pool = ScorePool("humaneval", workers=4, timeout_s=30.0, start_worker=RayScoreWorker)

The actor builds the environment from its spec once, then scores one completion at a time (`checked_score`: a
raise or a non-number is reward 0), wherever Ray places it in the cluster. The lane waits up to `timeout_s` for
each score; a scorer that runs past it is cut the way a local one is: the actor is killed (`ray.kill`, its process
with it), the sample scores 0 ("scorer timeout"), and the lane starts a fresh actor. An actor that dies (a crash,
os._exit in the scorer, its node lost) scores 0 and is replaced the same way, so the pool, not Ray, restarts its
workers (`max_restarts=0`): one restart path for both kinds. Needs the `[ray]` extra.
"""

from __future__ import annotations

from pathlib import Path

from specrl.trainer.envs.base import Score, Task, checked_score
from specrl.trainer.envs.pool import START_TIMEOUT_S, StartFailed


class ScoreWorkerActor:
    def __init__(self, spec: str, cache_dir: Path | None):
        from specrl.trainer.envs.registry import make_env

        try:
            self.env, self.error = make_env(spec, cache_dir=cache_dir), None
        except Exception as exc:  # noqa: BLE001 - reported to the pool, which scores 0 with it
            self.env, self.error = None, f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"

    def ready(self) -> str | None:
        """-> None, or why the environment could not be built."""
        return self.error

    def score(self, task: Task, completion: str) -> tuple[Score, str | None]:
        return checked_score(self.env, task, completion)


class RayScoreWorker:
    """Our end of one ScoreWorkerActor, with the local worker's interface (`pool._Worker`): only its lane calls
    `score`; any thread may `terminate` it."""

    def __init__(self, spec: str, cache_dir: Path | None, num_cpus: float = 0.5):
        import ray

        self.actor, self._alive = None, False
        # Never start Ray here: creating an actor without it would ray.init() a new cluster from this lane's thread
        # (after the pool's Ray ended, say), whose processes die with the thread and take the caller's Ray with them.
        if ray.is_initialized():
            remote = ray.remote(max_restarts=0, num_cpus=num_cpus)(ScoreWorkerActor)
            self.actor, self._alive = remote.remote(spec, cache_dir), True

    def wait_ready(self) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        if self.actor is None:
            raise StartFailed("Ray is not running")
        try:
            error = ray.get(self.actor.ready.remote(), timeout=START_TIMEOUT_S)
        except GetTimeoutError:
            self.close()
            raise StartFailed(f"no answer within {START_TIMEOUT_S:g}s") from None
        except RayError as exc:
            self.close()
            raise StartFailed(f"the actor died: {type(exc).__name__}") from None
        if error is not None:
            self.close()
            raise StartFailed(error)

    @property
    def alive(self) -> bool:
        return self._alive

    def score(self, task: Task, completion: str, timeout_s: float) -> tuple[Score, str | None]:
        """(Score, fault): fault None, "raised" or "invalid" (the scorer's own), "timeout", "died" or "send"."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayError

        try:
            ref = self.actor.score.remote(task, completion)
        except Exception as exc:  # noqa: BLE001 - serializing the task failed: nothing was sent
            return Score(0.0, {}, f"the task cannot be sent to a scoring worker: {type(exc).__name__}: {exc}"), "send"
        try:
            score, fault = ray.get(ref, timeout=timeout_s)
        except GetTimeoutError:
            self.close()
            return Score(0.0, {}, f"scorer timeout: no score after {timeout_s:g}s (its worker was killed)"), "timeout"
        except (RayActorError, RayError) as exc:
            self.close()
            return Score(0.0, {}, f"the scoring worker died ({type(exc).__name__})"), "died"
        return score, fault and ("invalid" if "invalid" in fault else "raised")

    def terminate(self) -> None:
        import ray

        if self._alive:
            self._alive = False
            ray.kill(self.actor, no_restart=True)

    def close(self) -> None:
        self.terminate()
