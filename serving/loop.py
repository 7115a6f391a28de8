"""The serving loop: what the HTTP app needs from a backend, declared once.

Two implementations: `EngineLoop` (the native engine on its own thread) and `VllmLoop` (vLLM's
AsyncLLM). Both hand out the engine's `StepOutput`s per request, count with `EngineStats`, and
own their telemetry sink, which they close when they stop.
"""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator, Callable, Protocol

from specrl.engine.outputs import EngineStats, StepOutput
from specrl.engine.swap import SwapResult
from specrl.speculation.sampling import SamplingParams
from specrl.telemetry.sink import SinkCounters

NO_DRAFTER = "this server runs without a drafter (--drafter none)"


class ServingLoop(Protocol):
    tokenizer: object
    vocab_size: int  # the target's vocabulary (token ids are in [0, vocab_size))
    target_version: str
    drafter_version: str
    has_drafter: bool
    no_drafter_reason: str  # why has_drafter is False: what a refused drafter swap answers
    stats: EngineStats
    telemetry: SinkCounters | None  # counters of the records this backend writes (None: it writes none)
    error: BaseException | None
    on_death: Callable[[], None] | None  # runs once if the engine dies (the server then exits non-zero)
    info: dict[str, str]  # what runs: backend, dtype (and why), replica name, exported as an info gauge

    @property
    def alive(self) -> bool: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def start(self) -> None:
        """Start what runs outside the event loop (before the server starts)."""

    async def ready(self) -> None:
        """Start what runs inside the event loop (the server's startup)."""

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> object:
        """Queue a request; raises the engine's validation and saturation errors at once. -> an
        object with the request's `spec` (SpecCounts) and `version_runs`, filled as it runs."""

    def outputs(self, request_id: str) -> AsyncIterator[StepOutput]:
        """The request's step outputs until it finishes; aborts it if the reader goes away."""

    def abort(self, request_id: str) -> None: ...

    def stop(self, timeout: float) -> None:
        """Stop admitting, let running requests finish within `timeout`, stop, close the telemetry sink."""

    async def swap(self, role: str, version: str, mode: str, directory: Path) -> SwapResult:
        """Load and check `directory` off the decode path, apply at a step boundary; SwapError changes nothing."""
