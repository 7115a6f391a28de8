"""Runs the native engine on its own thread and bridges it to asyncio (a `ServingLoop`).

The HTTP handlers live on the event loop; `Engine.step()` runs here, one step after another,
never on the event loop. Each request gets an asyncio.Queue; after every step the engine
thread hands each output to its request's queue with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import AsyncIterator, Callable

from specrl.engine.engine import Engine
from specrl.engine.outputs import StepOutput
from specrl.engine.sequence import Sequence
from specrl.engine.swap import SwapRequest, SwapResult, load_swap
from specrl.errors import EngineUnavailableError
from specrl.models.compute_threads import release_compute_threads
from specrl.serving.loop import NO_DRAFTER
from specrl.speculation.sampling import SamplingParams
from specrl.telemetry.fleet import FleetFeed
from specrl.telemetry.redis_sink import RedisSink
from specrl.telemetry.sink import MemorySink

log = logging.getLogger("specrl.engine")


async def read_outputs(queue: asyncio.Queue, abort: Callable[[], None], forget: Callable[[], None]
                       ) -> AsyncIterator[StepOutput]:
    """A request's step outputs from its queue until the finished one (an exception put on the
    queue is raised here). Both serving loops hand this generator out as `outputs()`. If the reader
    stops first (client gone, task cancelled, generator closed), `abort()` runs at once, inside the
    generator, so the engine stops working for nobody; `forget()` drops the queue either way."""
    finished = False
    try:
        while not finished:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:
            abort()
        forget()


class EngineLoop:
    def __init__(self, engine: Engine, telemetry: MemorySink | RedisSink | None = None,
                 fleet: FleetFeed | None = None):
        """fleet: the feed of other replicas' requests into the engine's suffix index (started by
        `start`, stopped by `stop`)."""
        self.engine, self.telemetry, self.fleet = engine, telemetry, fleet
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specrl-engine", daemon=True)
        self.error: BaseException | None = None
        self.on_death: Callable[[], None] | None = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def start(self) -> None:
        """Start the engine thread, from the thread that built the engine: that thread's OpenMP
        workers exit first (`specrl.models.compute_threads`: they would slow every decode step)."""
        release_compute_threads()
        self._thread.start()
        if self.fleet is not None:
            self.fleet.start()

    async def ready(self) -> None:
        """Nothing to wait for: the engine was built before the loop started."""

    # what the app reads
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.target.cfg.vocab_size

    @property
    def target_version(self) -> str:
        return self.engine.target_version

    @property
    def drafter_version(self) -> str:
        return self.engine.drafter_version

    @property
    def info(self) -> dict[str, str]:
        plan = self.engine.plan
        return {"backend": "native", "dtype": str(plan.weight_dtype).removeprefix("torch.") if plan else "float32",
                "dtype_reason": plan.note if plan else "plain float32 models", "replica": self.engine.settings.replica}

    @property
    def has_drafter(self) -> bool:
        return self.engine.drafter is not None

    no_drafter_reason = NO_DRAFTER

    @property
    def stats(self):
        return self.engine.stats

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    async def swap(self, role: str, version: str, mode: str, directory) -> SwapResult:
        """Load and check off the decode path, apply at the next step boundary."""
        request = await asyncio.to_thread(_load_swap_and_release, role, version, mode, directory, self.engine)
        self.engine.request_swap(request)
        self._wake.set()
        return await asyncio.wrap_future(request.done)

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> Sequence:
        """Queue a request (event-loop side). Raises the engine's validation errors at once."""
        if not self.alive:
            raise EngineUnavailableError("the engine is not running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        try:
            seq = self.engine.submit(prompt_ids, params, request_id)
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        self._wake.set()
        return seq

    def outputs(self, request_id: str) -> AsyncIterator[StepOutput]:
        """Yield the request's step outputs until it finishes; abort it if the consumer goes away."""
        _, queue = self._queues[request_id]
        return read_outputs(queue, lambda: self.abort(request_id), lambda: self._queues.pop(request_id, None))

    def abort(self, request_id: str) -> None:
        """Stop a request nobody will read (any thread)."""
        self._queues.pop(request_id, None)
        self.engine.abort(request_id)
        self._wake.set()

    def stop(self, timeout: float) -> None:
        """Stop admitting, let running requests finish within `timeout`, abort the rest, stop."""
        self.engine.scheduler.admitting = False
        deadline = time.monotonic() + timeout
        while self.engine.has_work() and self.alive and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.02)
        for seq in list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting):
            self.engine.abort(seq.request_id)
        self._wake.set()
        time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        if self.fleet is not None:
            self.fleet.stop()
        if self.telemetry is not None:
            self.telemetry.close(5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_work():
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except BaseException as exc:  # a bug: fail every waiting request, report unhealthy
                log.exception("engine step failed")
                self.error = exc
                for loop, queue in list(self._queues.values()):
                    loop.call_soon_threadsafe(queue.put_nowait, EngineUnavailableError(f"the engine failed: {exc!r}"))
                if self.on_death is not None:
                    self.on_death()
                return
            for out in outputs:
                target = self._queues.get(out.request_id)
                if target is not None:
                    target[0].call_soon_threadsafe(target[1].put_nowait, out)


def _load_swap_and_release(role: str, version: str, mode: str, directory, engine: Engine) -> SwapRequest:
    """`load_swap` on a worker thread, whose OpenMP workers then exit (`specrl.models.compute_threads`)."""
    try:
        return load_swap(role, version, mode, directory, engine.target, engine.plan)
    finally:
        release_compute_threads()
