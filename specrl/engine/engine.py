"""The native engine: one step at a time, schedule -> propose -> verify -> commit -> emit.

The engine owns the target, the drafter, both KV caches, the scheduler and the speculation
controller. It is synchronous and single-threaded on purpose: whoever drives it (a test, a
benchmark, the server's engine thread) calls `step()` in a loop; `submit` and `abort` may be
called from other threads.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specrl.config import Settings
from specrl.errors import InvalidRequestError, SwapInProgressError
from specrl.kernels import rejection_sample
from specrl.models.drafter import EagleDrafter
from specrl.models.llama import Llama, load_llama
from specrl.serving.scheduler import Scheduler
from specrl.serving.sequence import Sequence, Status
from specrl.serving.swap import SwapRequest, SwapResult
from specrl.spec.controller import CostModel, SpeculationController
from specrl.spec.propose import Draft, catch_up, propose
from specrl.spec.sampling import RowSampler, SamplingParams
from specrl.telemetry.record import SEGMENT_STEPS, SegmentRecord, StepRecord
from specrl.telemetry.sink import RecordSink


@dataclass
class StepOutput:
    """What one step produced for one request: tokens to stream and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    target_version: str
    drafter_version: str
    # per new token, when requested: (log-prob of the token, [(id, log-prob) of the top n])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class EngineStats:
    """Counters since start, read by /metrics (vLLM's spec-decode names) and benchmarks."""

    steps: int = 0  # verify steps summed over sequences
    drafts: int = 0  # verify steps that drafted (k > 0)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    generated_tokens: int = 0
    prompt_tokens: int = 0

    def count(self, k: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.generated_tokens += emitted
        if k > 0:
            self.drafts += 1
            self.draft_tokens += k
            self.accepted_tokens += accepted
            if len(self.accepted_per_position) < k:
                self.accepted_per_position += [0] * (k - len(self.accepted_per_position))
            for i in range(accepted):
                self.accepted_per_position[i] += 1


@dataclass
class Completion:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    steps: int  # verify steps (the prefill's first token counts as one)
    drafted: int
    accepted: int
    target_version: str
    drafter_version: str
    version_runs: list[list]  # [first output index, target version, drafter version]

    @property
    def acceptance_length(self) -> float:
        """Tokens per verify step, bonus included (1.0 = no speculation gain)."""
        return (self.accepted + self.steps) / max(self.steps, 1)


class Engine:
    def __init__(self, target: Llama, tokenizer, settings: Settings, *, drafter: EagleDrafter | None = None,
                 sink: RecordSink | None = None, calibrate: bool = True):
        self.drafter, self.tokenizer, self.settings, self.sink = drafter, tokenizer, settings, sink
        # Every target version some running sequence still uses (more than one only while a
        # "drain" policy swap lets old requests finish); new requests start on `target_version`.
        self.targets: dict[str, Llama] = {settings.target_version: target}
        self.cache = target.new_cache(settings.max_batch, settings.max_seq_len)
        self.draft_cache = drafter.new_cache(settings.max_batch, settings.max_seq_len) if drafter else None
        self.scheduler = Scheduler(settings.max_batch, settings.prefill_chunk, settings.max_waiting)
        self.target_version, self.drafter_version = settings.target_version, settings.drafter_version
        eos = set(target.cfg.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.eos_ids = frozenset(eos)
        self._seed_rng = torch.Generator().manual_seed(settings.seed)
        self._ids = itertools.count()
        self._sequences: dict[str, Sequence] = {}
        self._swap_lock = threading.Lock()
        self._pending_swap: SwapRequest | None = None
        self.swaps_done = 0
        self.stats = EngineStats()
        costs = self.calibrate() if calibrate and drafter is not None and settings.fixed_draft_tokens < 0 else CostModel()
        fixed = settings.fixed_draft_tokens if settings.fixed_draft_tokens >= 0 else None
        self.controller = SpeculationController(settings.max_draft_tokens if drafter else 0, costs, fixed_k=fixed)

    @property
    def target(self) -> Llama:
        """The newest target: new requests start on it."""
        return self.targets[self.target_version]

    @classmethod
    def from_settings(cls, settings: Settings, sink: RecordSink | None = None, *, progress: bool = True) -> "Engine":
        from transformers import AutoTokenizer

        from specrl.assets import resolve_model

        model_dir = resolve_model(settings.model, settings.home, progress=progress)
        target = load_llama(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return cls(target, tokenizer, settings, drafter=cls.drafter_from_setting(settings, target), sink=sink)

    @staticmethod
    def drafter_from_setting(settings: Settings, target: Llama) -> EagleDrafter | None:
        """settings.drafter: "day0" (untrained head), "none", or a drafter directory."""
        if settings.drafter == "none":
            return None
        if settings.drafter == "day0":
            return EagleDrafter.day0(target, seed=settings.seed, draft_vocab_size=settings.draft_vocab_size)
        return EagleDrafter.load(Path(settings.drafter), target)

    # ---- requests --------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Validate and queue a request; raises InvalidRequestError / QueueFullError before any work."""
        check_request(prompt_ids, params, self.target.cfg.vocab_size, self.settings.max_seq_len)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_rng))
        request_id = request_id or f"req-{next(self._ids)}"
        seq = Sequence(request_id, list(prompt_ids), params, torch.Generator().manual_seed(seed))
        self.scheduler.add(seq)
        self.stats.prompt_tokens += len(prompt_ids)
        self._sequences[request_id] = seq
        return seq

    def abort(self, request_id: str) -> None:
        seq = self._sequences.get(request_id)
        if seq is not None:
            seq.aborted = True

    def has_work(self) -> bool:
        """Requests to run, or a swap waiting for a step boundary."""
        return self.scheduler.has_work() or self._pending_swap is not None

    # ---- the step --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        outputs = [out for seq, start, end in batch.prefill if (out := self._prefill(seq, start, end))]
        for version in list(self.targets):  # one group per target version (two only while draining)
            running = [s for s in batch.decode if s.target_version == version and not s.aborted]
            if running:
                outputs += self._decode(running, self.targets[version])
        outputs += self._abort_flagged()
        self._apply_swap()
        return outputs

    def _decode(self, running: list[Sequence], target: Llama) -> list[StepOutput]:
        """propose -> verify -> commit for sequences on one target version."""
        started = time.perf_counter()
        sampler = RowSampler.of([s.params for s in running], [s.generator for s in running])
        room = min(s.remaining_tokens for s in running) - 1
        k = self.controller.choose(len(running), room) if self.drafter is not None else 0
        draft = self._propose(running, k, sampler) if k > 0 else Draft.empty(len(running))
        accepted, emitted, hidden, logits = self._verify(running, draft, sampler, target)
        outputs = []
        for b, seq in enumerate(running):
            a = int(accepted[b])
            seq.num_computed += a + 1  # the pending token and the accepted drafts now have KV
            outputs.append(self._commit(seq, draft.tokens[b].tolist(), draft.logprobs[b].tolist(), a,
                                        emitted[b, : a + 1].tolist(), hidden[b, : a + 1], logits[b, : a + 1]))
        self.controller.observe(len(running), k, time.perf_counter() - started, accepted.tolist())
        return outputs

    def _abort_flagged(self) -> list[StepOutput]:
        outputs = []
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            if seq.aborted and seq.status is not Status.FINISHED:
                self._finish(seq, "abort")
                outputs.append(self._output(seq, [], None))
        return outputs

    def _prefill(self, seq: Sequence, start: int, end: int) -> StepOutput | None:
        """Run one chunk of the prompt (or of a KV recompute); at the prompt's end, sample the first token."""
        if start == 0:
            seq.target_version = self.target_version
        target = self.targets[seq.target_version]
        tokens = torch.tensor(seq.context_ids(start, end))[None]
        hidden = target(tokens, torch.tensor([seq.slot]), torch.tensor([start]), self.cache)
        seq.num_computed = end
        recompute = bool(seq.output_ids)
        if self.drafter is not None:
            seq.draft_pending_features.append(hidden[0])
            seq.draft_pending_tokens.extend(seq.context_ids(start + 1, end + 1 if recompute else min(end + 1, seq.prompt_len)))
        if end < seq.prefill_end or recompute:
            if end == seq.prefill_end:
                seq.status = Status.DECODE  # recomputed: the pending token is still the next input
            self._drafter_catch_up(seq)
            return None
        seq.status = Status.DECODE
        sampler = RowSampler.of([seq.params], [seq.generator])
        logits = target.logits(hidden[:, -1:])
        _, emitted = rejection_sample(torch.zeros(1, 0, dtype=torch.long), None, sampler.probs(logits),
                                      sampler.uniforms(1), sampler.greedy, check_values=False)
        out = self._commit(seq, [], [], 0, emitted[0].tolist(), hidden[0, :0], logits[0])
        self._drafter_catch_up(seq)
        return out

    def _propose(self, running: list[Sequence], k: int, sampler: RowSampler) -> Draft:
        lengths = torch.tensor([len(s.draft_pending_tokens) for s in running])
        width = int(lengths.max())
        features = torch.zeros(len(running), width, self.target.cfg.hidden_size)
        tokens = torch.zeros(len(running), width, dtype=torch.long)
        for b, seq in enumerate(running):
            features[b, : lengths[b]] = torch.cat(seq.draft_pending_features)
            tokens[b, : lengths[b]] = torch.tensor(seq.draft_pending_tokens)
        slots = torch.tensor([s.slot for s in running])
        start = torch.tensor([s.draft_start for s in running])
        draft = propose(self.drafter, self.draft_cache, slots, start, features, tokens, lengths, k, sampler)
        for seq, n in zip(running, lengths.tolist()):
            seq.draft_start += n
            seq.draft_pending_features.clear()
            seq.draft_pending_tokens.clear()
        return draft

    def _verify(self, running: list[Sequence], draft: Draft, sampler: RowSampler, target: Llama):
        """One target forward over [pending token, d_1..d_k] per sequence, then rejection sampling.
        -> accepted [B], emitted [B, K+1], target hidden [B, K+1, H], target logits [B, K+1, V]."""
        tokens = torch.cat([torch.tensor([[s.pending_token] for s in running]), draft.tokens], dim=1)
        slots = torch.tensor([s.slot for s in running])
        start = torch.tensor([s.num_computed for s in running])
        hidden = target(tokens, slots, start, self.cache)
        logits = target.logits(hidden)
        k = draft.tokens.shape[1]
        # The engine made these distributions with softmax from finite weights (checked at load and
        # swap): the per-step value scan (sum to 1, no NaN) would cost about as much as the sampling.
        accepted, emitted = rejection_sample(draft.tokens, draft.probs, sampler.probs(logits), sampler.uniforms(k + 1),
                                             sampler.greedy, check_values=False)
        return accepted, emitted, hidden, logits

    def _drafter_catch_up(self, seq: Sequence) -> None:
        """Let the drafter consume a prefilled prompt now (one sequence, no padding), keeping the
        last entry pending so that the next propose always has a position to start from."""
        n = len(seq.draft_pending_tokens) - 1
        if self.drafter is None or n < 1:
            return
        features = torch.cat(seq.draft_pending_features)
        catch_up(self.drafter, self.draft_cache, torch.tensor([seq.slot]), torch.tensor([seq.draft_start]),
                 features[None, :n], torch.tensor(seq.draft_pending_tokens[:n])[None])
        seq.draft_pending_features[:] = [features[n:]]
        del seq.draft_pending_tokens[:n]
        seq.draft_start += n

    # ---- commit and emit -------------------------------------------------------------------
    def _commit(self, seq: Sequence, draft_tokens: list[int], draft_logprobs: list[float], accepted: int,
                emitted: list[int], features: torch.Tensor, logits: torch.Tensor) -> StepOutput:
        """Append one verify step's tokens (accepted drafts + recovered/bonus) and record it.
        features [a+1, H]: target hidden at the positions consumed; logits [a+1, V]: the target's
        logits that chose each emitted token."""
        position = seq.prompt_len + len(seq.output_ids)
        self._record(seq, StepRecord(position, len(draft_tokens), draft_tokens, draft_logprobs, accepted, emitted[-1]),
                     emitted)
        seq.pending_token = emitted[-1]
        seq.steps, seq.drafted, seq.accepted = seq.steps + 1, seq.drafted + len(draft_tokens), seq.accepted + accepted
        seq.drafts += bool(draft_tokens)
        if self.drafter is not None:
            seq.draft_pending_features.append(features.clone())
            seq.draft_pending_tokens.extend(emitted)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        visible, reason = self._stop_check(seq, emitted)
        self.stats.count(len(draft_tokens), accepted, len(visible))
        versions = [seq.target_version, self.drafter_version]
        if visible and (not seq.version_runs or seq.version_runs[-1][1:] != versions):
            seq.version_runs.append([len(seq.output_ids), *versions])
        seq.output_ids.extend(visible)
        if reason is None and seq.params.stop and self._stop_string_hit(seq):
            reason = "stop"
        if reason is not None:
            self._finish(seq, reason)
        logprobs = _logprobs(logits[: len(visible)], visible, seq.params.logprobs) if seq.params.logprobs is not None else None
        return self._output(seq, visible, logprobs)

    def _stop_check(self, seq: Sequence, emitted: list[int]) -> tuple[list[int], str | None]:
        """-> the tokens the client sees, and a finish reason if this step ends the request.
        EOS and stop token ids end it and are not shown; max_tokens cuts the rest."""
        stops = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else self.eos_ids)
        visible = []
        for token in emitted:
            if token in stops:
                return visible, "stop"
            visible.append(token)
            if len(seq.output_ids) + len(visible) >= seq.params.max_tokens:
                return visible, "length"
        return visible, None

    def _stop_string_hit(self, seq: Sequence) -> bool:
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        return any(s in text for s in seq.params.stop)

    def _record(self, seq: Sequence, step: StepRecord, emitted: list[int]) -> None:
        # A full segment is sent at the next step, not at once: were the step that fills it also
        # the request's last, `_finish` must still find it to stamp the finish reason.
        if seq.segment is not None and len(seq.segment.steps) >= SEGMENT_STEPS:
            self._flush_segment(seq)
        if seq.segment is None:
            seq.segment = SegmentRecord(seq.request_id, seq.segment_index, seq.target_version, self.drafter_version,
                                        prompt_ids=list(seq.prompt_ids) if seq.segment_index == 0 else None)
        seq.segment.steps.append(step)
        seq.segment.tokens.extend(emitted)

    def _flush_segment(self, seq: Sequence) -> None:
        if seq.segment is not None:
            seq.segment.finish_reason = seq.finish_reason
            if self.sink is not None:
                self.sink.emit(seq.segment)
            seq.segment, seq.segment_index = None, seq.segment_index + 1

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self._flush_segment(seq)
        self.scheduler.retire(seq)
        self._sequences.pop(seq.request_id, None)

    def _output(self, seq: Sequence, tokens: list[int], logprobs) -> StepOutput:
        return StepOutput(seq.request_id, tokens, seq.finish_reason is not None, seq.finish_reason,
                          seq.target_version, self.drafter_version, logprobs)

    # ---- weight swaps ----------------------------------------------------------------------
    def request_swap(self, swap: SwapRequest) -> None:
        """Queue a loaded, checked swap for the next step boundary (any thread)."""
        with self._swap_lock:
            if self._pending_swap is not None:
                raise SwapInProgressError(f"a {self._pending_swap.role} swap to {self._pending_swap.version} is in progress")
            self._pending_swap = swap

    def _apply_swap(self) -> None:
        """At a step boundary: swap references, then drop target versions nobody runs on."""
        with self._swap_lock:
            swap, self._pending_swap = self._pending_swap, None
        if swap is not None:
            running = list(self.scheduler.running)
            for seq in running:  # segments carry one version pair: close them at the switch
                self._flush_segment(seq)
            if swap.role == "drafter":
                self.drafter, self.drafter_version = swap.model, swap.version
                self.controller.reset()
            else:
                self.targets[swap.version] = swap.model
                self.target_version = swap.version
                if self.drafter is not None:
                    self.drafter.retarget(swap.model)
                if swap.mode == "interrupt":
                    for seq in running:
                        self._restart_on(seq, swap.version)
            self.swaps_done += 1
            swap.done.set_result(SwapResult(swap.role, swap.version, swap.mode, swap.load_ms,
                                            (time.perf_counter() - swap.requested_at) * 1000))
        in_use = {s.target_version for s in self.scheduler.running} | {self.target_version}
        for version in [v for v in self.targets if v not in in_use]:
            del self.targets[version]

    def _restart_on(self, seq: Sequence, version: str) -> None:
        """Move a running sequence to new target weights: recompute its KV from its tokens."""
        seq.target_version = version
        if seq.status is Status.DECODE or seq.num_computed > 0:
            seq.prefill_end = seq.prompt_len + len(seq.output_ids) - 1 if seq.output_ids else seq.prompt_len
            seq.num_computed, seq.status = 0, Status.PREFILL
            seq.draft_start = 0
            seq.draft_pending_features.clear()
            seq.draft_pending_tokens.clear()

    # ---- helpers ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run prompts to completion (tests, benchmarks, CLI). Submits as the queue allows."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        queue = list(zip(prompts, params_list))
        seqs: list[Sequence] = []
        while queue or self.has_work():
            while queue and len(self.scheduler.waiting) < self.settings.max_waiting:
                prompt, p = queue.pop(0)
                seqs.append(self.submit(prompt, p))
            self.step()
        return [self.completion(s) for s in seqs]

    def completion(self, seq: Sequence) -> Completion:
        return Completion(seq.request_id, seq.prompt_ids, seq.output_ids,
                          self.tokenizer.decode(seq.output_ids, skip_special_tokens=True), seq.finish_reason or "",
                          seq.steps, seq.drafted, seq.accepted, seq.target_version, self.drafter_version,
                          seq.version_runs)

    @torch.inference_mode()
    def calibrate(self, repeats: int = 2) -> CostModel:
        """Time target forwards (B, T = 1..K+1) and drafter passes on idle slots: the cost prior."""
        costs = CostModel()
        for bsz in sorted({1, self.settings.max_batch}):
            slots, start = torch.arange(bsz), torch.zeros(bsz, dtype=torch.long)
            for t in range(1, self.settings.max_draft_tokens + 2):
                tokens = torch.zeros(bsz, t, dtype=torch.long)
                costs.target[(bsz, t)] = _best_time(lambda: self.target.logits(self.target(tokens, slots, start, self.cache)), repeats)
            one = torch.zeros(bsz, 1, dtype=torch.long)
            feats = torch.zeros(bsz, 1, self.target.cfg.hidden_size)
            costs.draft[bsz] = _best_time(lambda: self.drafter.logits(self.drafter(feats, one, slots, start, self.draft_cache)), repeats)
        return costs


def check_request(prompt_ids: list[int], params: SamplingParams, vocab: int, limit: int) -> None:
    """Raise InvalidRequestError naming the first problem of a request (both backends)."""
    params.check()
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
    if len(prompt_ids) >= limit:
        raise InvalidRequestError(f"the prompt has {len(prompt_ids)} tokens; the context is {limit}", param="prompt")
    if len(prompt_ids) + params.max_tokens > limit:
        raise InvalidRequestError(
            f"max_tokens={params.max_tokens} plus the prompt's {len(prompt_ids)} tokens exceeds the context of {limit}",
            param="max_tokens")


def _logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """logits [T, V] that chose `tokens` -> per token (its log-prob, the top `top` (id, log-prob))."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    values, ids = logp.topk(top, dim=-1) if top > 0 else (logp[:, :0], logp[:, :0].long())
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
