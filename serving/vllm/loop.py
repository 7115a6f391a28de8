"""vLLM's AsyncLLM behind the interface the HTTP app uses (`specrl.serving.loop.ServingLoop`).

Requests go to vLLM as token ids with `RequestOutputKind.DELTA`; each delta becomes a
`StepOutput`. Weights are labelled in vLLM itself (`update_weight_version`, "target;drafter"),
so every finished output carries exact version spans; a swap pauses scheduling, reloads
through the worker extension (`specrl.serving.vllm.worker`), relabels and resumes:

- drafter, and policy "interrupt": pause with running requests kept; they go on with the new
  weights. Without prefix caching vLLM keeps their KV cache (computed by the old policy): unlike
  the native engine, an interrupting policy swap does not recompute it; with prefix caching the
  reset of the prefix index preempts them, so they recompute it.
- policy "drain": pause new admissions until the running requests have finished on the old
  weights, then swap; new requests wait meanwhile (vLLM holds one set of weights).

vLLM's own prefix caching is on unless `prefix_cache` is off (`build.engine_args`); a policy swap
resets it, so nothing the old weights computed is reused (a drafter swap does not: stale drafter
KV only costs acceptance, verification keeps the output exact). The `vllm:prefix_cache_*`
counters come from each request's `num_cached_tokens`.

Engine death (the engine-core process exits): `alive` turns false, every open request fails
with EngineUnavailableError, and `on_death` runs (the server exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from specrl.engine.outputs import EngineStats, StepOutput
from specrl.engine.swap import SwapResult, check_swap
from specrl.engine.validation import check_request
from specrl.errors import EngineUnavailableError, InvalidRequestError, QueueFullError, SwapError
from specrl.serving.engine_loop import read_outputs
from specrl.serving.loop import NO_DRAFTER
from specrl.speculation.quantities import SpecCounts
from specrl.speculation.sampling import SamplingParams

log = logging.getLogger("specrl.engine")
TELEMETRY_TAIL_S = 5.0  # telemetry counters refresh every second while busy and this long after
TELEMETRY_IDLE_S = 30.0  # and this often when idle


@dataclass
class VllmRequest:
    """One request's spec-decode stats and version runs (filled when it finishes)."""

    request_id: str
    spec: SpecCounts = field(default_factory=SpecCounts)
    version_runs: list[list] = field(default_factory=list)


@dataclass
class Telemetry:
    """The worker's sink counters (`SinkCounters`), refreshed in the background (read by /metrics);
    the worker's sink closes with the engine."""

    sent: int = 0
    dropped: int = 0
    dropped_tokens: int = 0
    queued: int = 0


class VllmLoop:
    def __init__(self, engine_args, tokenizer, settings, *, worker_options: dict, has_drafter: bool,
                 vocab_size: int, info: dict[str, str] | None = None, no_drafter_reason: str = NO_DRAFTER):
        self.engine_args, self.tokenizer, self.settings = engine_args, tokenizer, settings
        self.worker_options, self.has_drafter, self.vocab_size = worker_options, has_drafter, vocab_size
        self.no_drafter_reason = no_drafter_reason
        self.info = info or {"backend": "vllm"}
        self.target_version = settings.target_version
        self.drafter_version = settings.drafter_version if has_drafter else "none"
        self.stats = EngineStats()
        # None without a sink (no Redis URL), as on the native backend: /metrics then shows no
        # telemetry counters, and the watchdog never wakes the worker to read them
        self.telemetry = Telemetry() if worker_options.get("redis_url") else None
        self.engine = None
        self.error: BaseException | None = None
        self.on_death: Callable[[], None] | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._requests: dict[str, VllmRequest] = {}
        self._admitting = True
        self._watch: asyncio.Task | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Engine processes start inside the event loop (`ready`)."""

    async def ready(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.perf_counter()
        self.engine = AsyncLLM.from_engine_args(self.engine_args)
        [reply] = await self.engine.collective_rpc("specrl_setup", args=(self.worker_options,))
        if not reply.get("ok"):
            raise RuntimeError(f"the vLLM worker extension failed to set up: {reply.get('error')}")
        await self.engine.update_weight_version(self._label())
        self._watch = asyncio.create_task(self._watchdog())
        log.info("vllm engine ready seconds=%.1f drafter=%s cpu_fix=%s", time.perf_counter() - started,
                 self.has_drafter, reply.get("cpu_fix"))

    @property
    def alive(self) -> bool:
        return self.error is None and (self.engine is None or not self.engine.errored)

    @property
    def num_running(self) -> int:
        return len(self._tasks)

    num_waiting = 0  # vLLM's own queue is not visible here; `num_running` counts every open request

    def stop(self, timeout: float) -> None:
        """Stop admitting, wait for open requests up to `timeout`, then shut the engine down (any thread)."""
        self._admitting = False
        deadline = time.monotonic() + timeout
        while self._tasks and self.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.engine is not None:
            self.engine.shutdown()

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> VllmRequest:
        if not self.alive or not self._admitting:
            raise EngineUnavailableError("the vLLM engine is not running")
        check_request(prompt_ids, params, self.vocab_size, self.settings.max_seq_len)
        if self.has_drafter:
            _check_speculative(params)
        if len(self._tasks) >= self.settings.max_batch + self.settings.max_waiting:
            raise QueueFullError(f"{len(self._tasks)} requests are open; retry shortly")
        request = VllmRequest(request_id)
        self._requests[request_id] = request
        self._queues[request_id] = asyncio.Queue()
        self._tasks[request_id] = asyncio.create_task(self._run(request, prompt_ids, params))
        self.stats.prompt_tokens += len(prompt_ids)
        return request

    def outputs(self, request_id: str) -> AsyncIterator[StepOutput]:
        return read_outputs(self._queues[request_id], lambda: self.abort(request_id),
                            lambda: self._queues.pop(request_id, None))

    def abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()  # cancelling vLLM's generate() aborts the request in the engine

    async def _run(self, request: VllmRequest, prompt_ids: list[int], params: SamplingParams) -> None:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        queue = self._queues[request.request_id]
        first = True
        try:
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)),
                                                  _vllm_params(params), request.request_id):
                if first:  # vLLM's prefix cache served num_cached_tokens of the prompt (known from the first output)
                    self.stats.prefix_cache_queries += len(prompt_ids)
                    self.stats.prefix_cache_hits += out.num_cached_tokens or 0
                    first = False
                queue.put_nowait(self._step_output(request, out.outputs[0], params))
        except asyncio.CancelledError:
            pass
        except VLLMClientError as exc:  # vLLM's own validation refused it: the caller's error (400), not the engine's
            queue.put_nowait(InvalidRequestError(f"vLLM refused the request: {exc}",
                                                 param=getattr(exc, "parameter", None)))
        except Exception as exc:  # engine death and the like: fail this request now, never hang
            queue.put_nowait(EngineUnavailableError(f"the vLLM engine failed: {type(exc).__name__}: {exc}"))
        finally:
            self._tasks.pop(request.request_id, None)
            self._requests.pop(request.request_id, None)

    def _step_output(self, request: VllmRequest, out, params: SamplingParams) -> StepOutput:
        tokens = list(out.token_ids)
        logprobs = None
        if params.logprobs is not None and out.logprobs:
            logprobs = [(entry[tok].logprob, sorted(((i, lp.logprob) for i, lp in entry.items()
                                                     if lp.rank is not None and lp.rank <= params.logprobs),
                                                    key=lambda x: -x[1])[: params.logprobs])
                        for tok, entry in zip(tokens, out.logprobs)]
        self.stats.generated_tokens += len(tokens)
        finished = out.finish_reason is not None
        if finished:
            self._finish(request, out)
        reason = {"abort": "abort"}.get(out.finish_reason, out.finish_reason)
        target, drafter = (request.version_runs[-1][1:] if finished and request.version_runs
                           else (self.target_version, self.drafter_version))
        return StepOutput(request.request_id, tokens, finished, reason, target, drafter, logprobs)

    def _finish(self, request: VllmRequest, out) -> None:
        m = out.spec_decode_metrics  # histogram[j]: drafting steps that accepted j drafts
        spec = request.spec
        if m is not None:
            spec.num_drafts = sum(m.histogram)
            spec.num_draft_tokens = m.num_draft_tokens
            spec.num_accepted_tokens = sum(j * n for j, n in enumerate(m.histogram))
            spec.num_accepted_tokens_per_pos = [sum(m.histogram[j + 1:]) for j in range(len(m.histogram) - 1)]
        spec.num_steps = spec.num_drafts + 1  # the prefill's token is a step without a draft
        self.stats.spec.add(spec)
        request.version_runs = [[span.start, *_unlabel(span.version)] for span in out.weight_versions or []
                                if span.end > span.start]

    # ---- swaps -------------------------------------------------------------------------------
    async def swap(self, role: str, version: str, mode: str, directory) -> SwapResult:
        requested = time.perf_counter()
        check_swap(role, mode)
        if not self.alive:
            raise EngineUnavailableError("the vLLM engine is not running")
        await self.engine.pause_generation(mode="wait" if role == "policy" and mode == "drain" else "keep",
                                           clear_cache=False)
        try:
            [reply] = await self.engine.collective_rpc("specrl_swap", args=(role, str(directory), version))
            if not reply.get("ok"):
                raise SwapError(f"{role} {version}: {reply.get('error')}")
            if role == "drafter":
                self.drafter_version = version
            else:
                self.target_version = version
                await self._reset_prefix_cache(mode)
            await self.engine.update_weight_version(self._label())
        finally:
            await self.engine.resume_generation()
        return SwapResult(role, version, mode, reply.get("load_ms", 0.0), (time.perf_counter() - requested) * 1000)

    async def _reset_prefix_cache(self, mode: str) -> None:
        """After a policy swap nothing the old weights computed may be reused. vLLM resets its index
        only when no running request holds blocks: always so after a "drain"; under "interrupt",
        with prefix caching on, its running requests are preempted (they recompute their KV on the
        new weights, as the native engine's do)."""
        interrupt = mode == "interrupt" and self.settings.prefix_cache
        if not await self.engine.reset_prefix_cache(reset_running_requests=interrupt):
            log.warning("vllm prefix cache reset failed after a policy swap mode=%s target=%s", mode,
                        self.target_version)

    def _label(self) -> str:
        return f"{self.target_version};{self.drafter_version}"

    # ---- health ------------------------------------------------------------------------------
    async def _watchdog(self) -> None:
        """Check engine health every second; on death fail everything fast. Refresh the worker's
        telemetry counters every second while requests are open and for TELEMETRY_TAIL_S after,
        else every TELEMETRY_IDLE_S: each collective_rpc wakes vLLM's worker into a 1 s busy-poll
        of its message queue, so polling every second kept an idle server's worker spinning (measured
        over 30 s idle: 99% of a core before, 5% now)."""
        refreshed = active = 0.0
        while self.alive:
            now = time.monotonic()
            if self._tasks:
                active = now
            if self.telemetry is not None and (now - active < TELEMETRY_TAIL_S or now - refreshed > TELEMETRY_IDLE_S):
                refreshed = now
                try:
                    [reply] = await asyncio.wait_for(self.engine.collective_rpc("specrl_telemetry"), timeout=30)
                    if reply.get("ok"):
                        self.telemetry.sent, self.telemetry.dropped = reply["sent"], reply["dropped"]
                        self.telemetry.queued, self.telemetry.dropped_tokens = reply["queued"], reply["dropped_tokens"]
                except Exception:  # noqa: BLE001 - a dead engine shows in `alive` below
                    pass
            await asyncio.sleep(1.0)
        self.error = self.error or RuntimeError("the vLLM engine core died")
        log.error("vllm engine died; failing %d open requests", len(self._tasks))
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(EngineUnavailableError("the vLLM engine died"))
        if self.on_death is not None:
            self.on_death()


def _unlabel(label: str) -> list[str]:
    target, _, drafter = label.partition(";")
    return [target, drafter or "none"]


def _check_speculative(params: SamplingParams) -> None:
    """vLLM 0.32 refuses min_p and logit_bias under speculative decoding (its rejection sampler does
    not apply them): a 400 naming the parameter at submit, before any response starts."""
    for name, used in (("min_p", params.min_p > 0), ("logit_bias", bool(params.logit_bias))):
        if used:
            raise InvalidRequestError(f"{name} is not supported by the vLLM backend with a drafter (vLLM 0.32 refuses "
                                      f"it under speculative decoding); serve with --drafter none or the native "
                                      f"backend", param=name)


def _vllm_params(params: SamplingParams):
    from vllm import SamplingParams as VP
    from vllm.sampling_params import RequestOutputKind

    return VP(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
              max_tokens=params.max_tokens, min_tokens=params.min_tokens, seed=params.seed,
              stop=list(params.stop) or None, stop_token_ids=list(params.stop_token_ids) or None,
              ignore_eos=params.ignore_eos, logprobs=params.logprobs,
              repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
              frequency_penalty=params.frequency_penalty, logit_bias=dict(params.logit_bias) or None,
              include_stop_str_in_output=params.include_stop_str_in_output,
              skip_special_tokens=params.skip_special_tokens,
              spaces_between_special_tokens=params.spaces_between_special_tokens,
              output_kind=RequestOutputKind.DELTA)
