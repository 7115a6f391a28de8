"""A bounded pool of scoring worker processes: the Environment stage of the RL loop.

    pool = ScorePool("humaneval", workers=4, timeout_s=30.0)
    future = pool.submit(task, completions, done)   # returns at once; done(scores, busy_s) when all are scored
    scores = pool.score(task, completions)          # the same, waited for
    pool.close()

Each worker is a process (multiprocessing "spawn": a fresh interpreter that inherits none of the
supervisor's threads) that builds the environment from its spec once (`registry.make_env`) and
then scores one completion at a time (`base.checked_score`: a raise or a non-number is reward 0).
A lane thread per worker feeds it: it sends one completion and waits up to `timeout_s` for its
score. A scorer that runs past that is cut: its worker is SIGKILLed and reaped, the sample scores
0 ("scorer timeout"), and the lane starts a fresh worker. A worker that dies (a crash, os._exit in
the scorer) scores 0 with its exit code and is replaced the same way. So a hung or crashing
scorer costs one worker restart: no thread or process is left behind and the loop goes on. (A
grandchild the scorer started in a session of its own, such as a sandbox run, is not killed with
its worker: keep an environment's sandbox limit below its timeout, as the built-in ones do.)

The completions of one group are scored in parallel on whichever lanes are free; `done` runs on
the lane that finishes the group's last one (so a `done` that blocks holds that lane: backpressure).
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specrl.errors import InvalidRequestError
from specrl.trainer.envs.base import Score, Task, checked_score
from specrl.trainer.envs.sandbox import die_with_parent

log = logging.getLogger("specrl.trainer.envs")

START_TIMEOUT_S = 120.0          # a worker's interpreter start and environment build (not a score)
_CONTEXT = multiprocessing.get_context("spawn")


@dataclass
class _Group:
    task: Task
    scores: list
    left: int
    done: Callable[[list[Score], float], None] | None
    future: Future = field(default_factory=Future)
    busy_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


class ScorePool:
    def __init__(self, spec: str, *, workers: int = 4, timeout_s: float, cache_dir: Path | None = None,
                 start_worker: Callable[[str, Path | None], "_Worker"] | None = None):
        """`spec`: what `make_env` takes (checked by the caller first: a worker that cannot build it
        scores every completion 0 with the reason); `timeout_s`: the most one score may take;
        `start_worker(spec, cache_dir)`: a worker with `_Worker`'s interface (default: a local process;
        `envs.ray_worker.RayScoreWorker`: a Ray actor)."""
        if workers < 1 or not timeout_s > 0:
            raise InvalidRequestError(f"the scoring pool needs workers >= 1 and timeout_s > 0, got {workers} and "
                                      f"{timeout_s}")
        self.spec, self.cache_dir, self.workers, self.timeout_s = spec, cache_dir, workers, float(timeout_s)
        self._start_worker = start_worker or _Worker
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._counts = {"scores": 0, "busy_s": 0.0, "idle_s": 0.0, "timeouts": 0, "deaths": 0, "faults": 0,
                        "restarts": 0}
        self._waiting: dict[int, float] = {}     # lane -> since when it waits for a job
        self._workers: dict[int, _Worker] = {}   # lane -> its worker, for close()
        self._closed = threading.Event()
        self._lanes = [threading.Thread(target=self._lane, args=(i,), name=f"score-lane-{i}", daemon=True)
                       for i in range(workers)]
        for lane in self._lanes:
            lane.start()

    def submit(self, task: Task, completions: list[str],
               done: Callable[[list[Score], float], None] | None = None) -> Future:
        """Queue the completions of one task; the future's result is their scores, in order.
        `done(scores, busy_s)` (the worker-seconds spent on them) runs first, on a lane thread."""
        group = _Group(task, [None] * len(completions), len(completions), done)
        if self._closed.is_set() or not completions:
            group.scores = [_closed() for _ in completions]
            self._complete(group)
            return group.future
        for i, text in enumerate(completions):
            self._jobs.put((group, i, text))
        return group.future

    def score(self, task: Task, completions: list[str]) -> list[Score]:
        return self.submit(task, completions).result()

    def score_each(self, tasks: list[Task], completions: list[str]) -> list[Score]:
        """One completion per task, all in flight at once."""
        futures = [self.submit(t, [c]) for t, c in zip(tasks, completions)]
        return [f.result()[0] for f in futures]

    def stats(self) -> dict:
        """Scores made, worker-seconds busy and idle (waiting for work), timeouts, worker deaths,
        scorer faults and worker restarts so far."""
        now = time.monotonic()
        with self._lock:
            counts = dict(self._counts)
            counts["idle_s"] += sum(now - since for since in self._waiting.values())
        return {"workers": self.workers, "timeout_s": self.timeout_s, **counts}

    def close(self) -> None:
        """Kill the workers and end the lanes; scores still queued or running come back as 0 ("closed")."""
        self._closed.set()
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._finish(item[0], item[1], _closed(), 0.0)
        for _ in self._lanes:
            self._jobs.put(None)
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.terminate()
        for lane in self._lanes:
            lane.join(timeout=10.0)

    def __enter__(self) -> ScorePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- lanes: each owns one worker at a time --------------------------------------------------

    def _lane(self, lane: int) -> None:
        worker, error = self._start(lane)
        try:
            while True:
                with self._lock:
                    self._waiting[lane] = time.monotonic()
                item = self._jobs.get()
                with self._lock:
                    self._counts["idle_s"] += time.monotonic() - self._waiting.pop(lane)
                if item is None:
                    return
                group, index, text = item
                started = time.monotonic()
                if worker is None:
                    with self._lock:
                        self._counts["restarts"] += 1
                    worker, error = self._start(lane)
                if worker is None:
                    score, fault = Score(0.0, {}, f"the scoring worker could not start: {error}"), "start"
                else:
                    score, fault = worker.score(group.task, text, self.timeout_s)
                    if not worker.alive:
                        worker.close()
                        worker = None
                if self._closed.is_set():
                    score, fault = _closed(), None
                elapsed = time.monotonic() - started
                self._count(fault, elapsed)
                if fault:
                    log.warning("event=score_failed env=%s task=%s error=%r", self.spec, group.task.id, score.error)
                self._finish(group, index, score, elapsed)
                if fault == "start":
                    time.sleep(1.0)            # no tight loop of failing starts
        finally:
            if worker is not None:
                worker.close()

    def _start(self, lane: int) -> tuple[_Worker | None, str | None]:
        if self._closed.is_set():
            return None, "the scoring pool is closed"
        worker = self._start_worker(self.spec, self.cache_dir)
        with self._lock:
            self._workers[lane] = worker
        try:
            worker.wait_ready()
        except StartFailed as exc:
            worker.close()
            if not self._closed.is_set():
                log.error("event=score_worker_failed env=%s error=%r", self.spec, str(exc))
            return None, str(exc)
        return worker, None

    def _count(self, fault: str | None, elapsed: float) -> None:
        with self._lock:
            self._counts["scores"] += 1
            self._counts["busy_s"] += elapsed
            if fault:
                self._counts["faults"] += 1
                self._counts["timeouts"] += fault == "timeout"
                self._counts["deaths"] += fault == "died"

    def _finish(self, group: _Group, index: int, score: Score, elapsed: float) -> None:
        with group.lock:
            group.scores[index] = score
            group.left -= 1
            group.busy_s += elapsed
            last = group.left == 0
        if last:
            self._complete(group)

    def _complete(self, group: _Group) -> None:
        if group.done is not None:
            try:
                group.done(group.scores, group.busy_s)
            except Exception:  # noqa: BLE001 - the caller's callback must not take a lane down
                log.exception("event=score_callback_failed task=%s", group.task.id)
        group.future.set_result(group.scores)


def _closed() -> Score:
    return Score(0.0, {}, "the scoring pool is closed")


class StartFailed(Exception):
    pass


class _Worker:
    """One scoring process and our end of its pipe. Only its lane uses the pipe; any thread may
    `terminate` it (the lane then sees the pipe close)."""

    def __init__(self, spec: str, cache_dir: Path | None):
        self.conn, child = _CONTEXT.Pipe()
        self.process = _CONTEXT.Process(target=_serve, args=(child, spec, cache_dir), name="specrl-scorer",
                                        daemon=True)
        self.process.start()
        child.close()

    def wait_ready(self) -> None:
        try:
            if not self.conn.poll(START_TIMEOUT_S):
                raise StartFailed(f"no answer within {START_TIMEOUT_S:g}s")
            kind, message = self.conn.recv()
        except (EOFError, OSError):
            self.close()
            raise StartFailed(f"it exited with status {self.process.exitcode}") from None
        if kind != "ready":
            raise StartFailed(message)

    @property
    def alive(self) -> bool:
        return self.process.exitcode is None and not self.conn.closed

    def score(self, task: Task, completion: str, timeout_s: float) -> tuple[Score, str | None]:
        """(Score, fault): fault None, "raised" or "invalid" (the scorer's own), "timeout", "died" or "send"."""
        try:
            self.conn.send((task, completion))
        except OSError:
            return self._dead()
        except Exception as exc:  # noqa: BLE001 - pickling the task failed: nothing was sent
            return Score(0.0, {}, f"the task cannot be sent to a scoring worker: {type(exc).__name__}: {exc}"), "send"
        try:
            if not self.conn.poll(timeout_s):
                self.close()
                return (Score(0.0, {}, f"scorer timeout: no score after {timeout_s:g}s (its worker was killed)"),
                        "timeout")
            score, fault = self.conn.recv()
        except (EOFError, OSError):
            return self._dead()
        return score, fault and ("invalid" if "invalid" in fault else "raised")

    def _dead(self) -> tuple[Score, str]:
        self.close()
        return Score(0.0, {}, f"the scoring worker died (exit status {self.process.exitcode})"), "died"

    def terminate(self) -> None:
        """SIGKILL the process (any thread); its sandbox children die with it (PR_SET_PDEATHSIG)."""
        if self.process.exitcode is None:
            self.process.kill()

    def close(self) -> None:
        """Kill, reap and close the pipe: the lane's, once."""
        self.terminate()
        self.process.join()
        if not self.conn.closed:
            self.conn.close()


def _serve(conn, spec: str, cache_dir: Path | None) -> None:
    """A worker process: build the environment, then score each (task, completion) sent until None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the supervisor's; it stops us
    die_with_parent()             # killed with its lane, even by SIGKILL of the supervisor
    from specrl.trainer.envs.registry import make_env

    try:
        env = make_env(spec, cache_dir=cache_dir)
    except BaseException as exc:  # noqa: BLE001 - reported to the pool, which scores 0 with it
        conn.send(("failed", f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        conn.send(checked_score(env, *job))

