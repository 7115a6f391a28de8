"""The native engine: one step at a time, schedule -> propose -> verify -> commit -> record -> swap.

The engine owns the target, the drafter, both KV caches, the scheduler and the speculation
controller. It is synchronous and single-threaded on purpose: whoever drives it (a test, a
benchmark, the server's engine thread) calls `step()` in a loop; `submit`, `abort` and
`request_swap` may be called from other threads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import threading
import time
from pathlib import Path

import torch

from specrl.config import Settings
from specrl.engine.commit import commit_tokens, token_logprobs
from specrl.engine.outputs import Completion, EngineStats, StepOutput
from specrl.engine.prefix_cache import PrefixCache
from specrl.engine.scheduler import Scheduler
from specrl.engine.sequence import Sequence, Status
from specrl.engine.start import DAY0, build_drafter, start_weights
from specrl.engine.swap import SwapRequest, SwapResult
from specrl.engine.validation import check_request
from specrl.errors import SwapInProgressError
from specrl.models.calibration import Calibration
from specrl.models.drafter import EagleDrafter
from specrl.models.llama import Llama, load_llama
from specrl.speculation.controller import HEAD, CostModel, RowOffer, SpeculationController, StepPlan
from specrl.speculation.propose import Draft, assemble, catch_up, propose
from specrl.speculation.sampling import RowSampler, SamplingParams, position_uniforms
from specrl.speculation.suffix_index import SuffixDraft, SuffixIndex
from specrl.speculation.verify import Verification, sample_first, verify
from specrl.telemetry.record import StepRecord
from specrl.telemetry.segments import SegmentWriter
from specrl.telemetry.sink import RecordSink

log = logging.getLogger("specrl.engine")
CALIBRATED_POSITIONS = (1, 2, 3, 4, 5, 9, 17)  # verify widths timed at start-up (others interpolated)
# A drafter pass costs ~0.13 ms plus ~0.015 ms a position (SmolLM2's head, AVX-512 EPYC, 2 threads): past
# ~8 entries a row's backlog is cheaper caught up in a call of its own than padded across a batch of 4.
CATCH_UP_ALONE = 8


class Engine:
    def __init__(self, target: Llama, tokenizer, settings: Settings, *, drafter: EagleDrafter | None = None,
                 sink: RecordSink | None = None, calibrate: bool = True, plan: Calibration | None = None):
        """plan: the matmul calibration the models were prepared with (None: plain models); swaps
        prepare new weights with it."""
        self.drafter, self.tokenizer, self.settings, self.sink, self.plan = drafter, tokenizer, settings, sink, plan
        # Every target version some running sequence still uses (more than one only while a
        # "drain" policy swap lets old requests finish); new requests start on `target_version`.
        self.targets: dict[str, Llama] = {settings.target_version: target}
        self.cache = target.new_cache(settings.max_batch, settings.max_seq_len)
        self.draft_cache = drafter.new_cache(settings.max_batch, settings.max_seq_len) if drafter else None
        self.stats = EngineStats()
        # Finished and running sequences' KV serves prompts that start the same way (None: off).
        self.prefix = (PrefixCache([c for c in (self.cache, self.draft_cache) if c is not None], self.stats,
                                   drafter=drafter is not None) if settings.prefix_cache else None)
        self.scheduler = Scheduler(settings.max_batch, settings.prefill_chunk, settings.max_waiting, self.prefix)
        self.target_version, self.drafter_version = settings.target_version, settings.drafter_version
        eos = set(target.cfg.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.eos_ids = frozenset(eos)
        self._seed_rng = torch.Generator().manual_seed(settings.seed)
        self._ids = itertools.count()
        self._sequences: dict[str, Sequence] = {}
        self._swap_lock = threading.Lock()
        self._pending_swap: SwapRequest | None = None
        # What traffic already said: finished requests here (and, through the event stream, on
        # other replicas) and each request's own prompt and output.
        self.suffix = SuffixIndex(settings.suffix_capacity) if settings.suffix_capacity > 0 else None
        if self.suffix is None:
            log.info("suffix proposer off (suffix_capacity=0)")
        self.index_finished = True  # finished requests join the index (False: a benchmark measuring engines apart)
        speculates = drafter is not None or self.suffix is not None
        costs = self.cost_prior() if calibrate and speculates and settings.fixed_draft_tokens < 0 else CostModel()
        fixed = settings.fixed_draft_tokens if settings.fixed_draft_tokens >= 0 else None
        self.controller = SpeculationController(settings.max_draft_tokens if drafter else 0, costs, fixed_k=fixed,
                                                max_suffix=settings.suffix_max_tokens,
                                                initial_accept_rate=prior_accept_rate(self.drafter_version))

    @property
    def target(self) -> Llama:
        """The newest target: new requests start on it."""
        return self.targets[self.target_version]

    @classmethod
    def from_settings(cls, settings: Settings, sink: RecordSink | None = None, *, store=None,
                      progress: bool = True) -> "Engine":
        """The model and drafter the settings name, or the store's current versions when `store` is
        given, in settings.dtype, each linear packed as the machine's calibration found fastest
        (measured once per machine, torch version and thread count; cached under <home>/calibration)."""
        from specrl.assets import load_tokenizer, resolve_model

        model_dir = resolve_model(settings.model, settings.home, progress=progress)
        start = start_weights(settings, model_dir, store)
        plan = Calibration.open(settings.home / "calibration", settings.dtype, progress=progress)
        log.info("engine %s", plan.note)
        target = load_llama(start.policy_dir, plan=plan)
        settings = settings.replace(target_version=start.policy_version, drafter_version=start.drafter_version)
        drafter = build_drafter(start.drafter, target, settings)
        if drafter is not None:
            drafter.prepare_inference(plan)
        return cls(target, load_tokenizer(model_dir), settings, drafter=drafter, sink=sink, plan=plan)

    # ---- requests --------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Validate and queue a request; raises InvalidRequestError / QueueFullError before any work."""
        check_request(prompt_ids, params, self.target.cfg.vocab_size, self.settings.max_seq_len)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_rng))
        request_id = request_id or f"req-{next(self._ids)}"
        segments = SegmentWriter(self.sink, request_id, list(prompt_ids), deployment=self.settings.deployment,
                                 replica=self.settings.replica)
        seq = Sequence(request_id, list(prompt_ids), params, torch.Generator().manual_seed(seed), segments)
        if params.seed is not None:  # reproducible whatever speculation does: uniforms by position
            # (past its last position too: a row shorter than the step's width still reads a column per position)
            widest = max(self.settings.suffix_max_tokens, self.settings.max_draft_tokens)
            seq.stream = position_uniforms(params.seed, len(prompt_ids) + params.max_tokens + widest + 2)
        if self.suffix is not None:
            seq.suffix = self.suffix.new_request(prompt_ids)
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
        """plan -> propose -> verify -> commit (and record) for sequences on one target version."""
        started = time.perf_counter()
        sampler = _sampler(running)
        peers = _peers(running)
        suffix = [self._suffix_draft(s, peers.get(s.prompt_key, ()), sampler, b) for b, s in enumerate(running)]
        plan = self.controller.plan([RowOffer(s.remaining_tokens - 1, d) for s, d in zip(running, suffix)],
                                    head=self.drafter is not None)
        draft = self._draft(running, plan, suffix, sampler)
        result = verify(target, self.cache, torch.tensor([s.pending_token for s in running]),
                        torch.tensor([s.slot for s in running]), torch.tensor([s.num_computed for s in running]),
                        draft, sampler)
        outputs = []
        accepted_rows, emitted_rows = result.rows()
        for row, (seq, drafted, accepted, emitted) in enumerate(zip(running, draft.rows(), accepted_rows, emitted_rows)):
            seq.num_computed += accepted + 1  # the pending token and the accepted drafts have KV now
            outputs.append(self._commit(seq, drafted, accepted, emitted, result, row, plan.proposers[row]))
        seconds = time.perf_counter() - started
        self.controller.observe_plan(plan, seconds, accepted_rows, suffix)
        self.stats.decode_seconds += seconds
        self.stats.plain_equivalent_seconds += self.controller.plain_seconds(plan, seconds,
                                                                           len(running) + sum(accepted_rows))
        return outputs

    def _suffix_draft(self, seq: Sequence, peers, sampler: RowSampler, row: int) -> SuffixDraft | None:
        """The suffix index's draft after `seq`'s tokens (row `row` of the step), its peers' text
        counting as its own, drawn from the votes for a row that samples (None: no index, or no
        room to draft)."""
        room = min(seq.remaining_tokens - 1, self.settings.suffix_max_tokens)
        if self.suffix is None or self.controller.fixed_k is not None or room <= 0:  # a fixed k drafts with the head only
            return None
        return self.suffix.propose(seq.suffix, room, self.settings.suffix_min_confidence, peers,
                                   sampler.draft_uniforms(row, room))

    def _draft(self, running: list[Sequence], plan: StepPlan, suffix: list[SuffixDraft | None],
               sampler: RowSampler) -> Draft:
        """The step's drafts as the plan says: the head's for its rows (drafted together), the
        suffix index's for the others."""
        if plan.width == 0:
            return Draft.empty(len(running))
        head_rows = plan.rows_of(HEAD)
        head = (self._propose([running[b] for b in head_rows], plan.head_k, sampler.select(head_rows))
                if head_rows else None)
        return assemble(plan.width, plan.lengths, head_rows, head, suffix, self.target.cfg.vocab_size,
                        with_probs=not sampler.all_greedy)

    def _propose(self, running: list[Sequence], k: int, sampler: RowSampler) -> Draft:
        """The drafter consumes these sequences' pending (feature, token) entries, then drafts k tokens.
        The batch's catch-up pass is padded to its longest backlog, so a row that waited longer than
        CATCH_UP_ALONE entries (the suffix index drafted it meanwhile) catches up alone first: at B=4,
        backlogs of 30, 2, 2, 2 entries took 3.1 ms padded against 1.0 ms for 2, 2, 2, 2."""
        if len(running) > 1:
            for seq in running:
                if len(seq.draft_pending_tokens) > CATCH_UP_ALONE:
                    self._drafter_catch_up(seq)
        lengths = torch.tensor([len(s.draft_pending_tokens) for s in running])
        width = int(lengths.max())
        features = torch.zeros(len(running), width, self.target.cfg.hidden_size)
        tokens = torch.zeros(len(running), width, dtype=torch.long)
        for b, seq in enumerate(running):
            features[b, : lengths[b]] = torch.cat(seq.draft_pending_features)
            tokens[b, : lengths[b]] = torch.tensor(seq.draft_pending_tokens)
        slots = torch.tensor([s.slot for s in running])
        start = torch.tensor([s.draft_start for s in running])
        draft = propose(self.drafter, self.draft_cache, slots, start, features, tokens, lengths, k, sampler,
                        torch.tensor([s.num_computed + 1 for s in running]))
        for seq, n in zip(running, lengths.tolist()):
            seq.draft_start += n
            seq.draft_pending_features.clear()
            seq.draft_pending_tokens.clear()
        return draft

    def _commit(self, seq: Sequence, drafted: tuple[list[int], list[float]], accepted: int, emitted: list[int],
                result: Verification, row: int, proposer: str) -> StepOutput:
        """Row `row` of a verify step joins its sequence: record the step, feed the drafter the
        verified positions, append the visible tokens, stop checks. drafted: the row's draft tokens
        and their log q (`Draft.rows`); accepted, emitted: the row's (`Verification.rows`)."""
        draft_tokens, draft_logprobs = drafted
        position = seq.prompt_len + len(seq.output_ids)
        seq.segments.add(StepRecord(position, len(draft_tokens), draft_tokens, draft_logprobs, accepted, emitted[-1],
                                    proposer), emitted, seq.target_version, self.drafter_version,
                         features=result.hidden[row, : accepted + 1])  # positions position-1.., if the sink takes them
        seq.pending_token = emitted[-1]
        seq.spec.count(len(draft_tokens), accepted)
        self.stats.count(proposer, len(draft_tokens), accepted)
        if self.drafter is not None:  # target features at the positions this step consumed
            seq.draft_pending_features.append(result.hidden[row, : accepted + 1].clone())
            seq.draft_pending_tokens.extend(emitted)
        visible, reason = commit_tokens(seq, emitted, self.eos_ids, self.tokenizer, self.drafter_version)
        if seq.suffix is not None:
            seq.suffix.extend(visible)
        self.stats.generated_tokens += len(visible)
        if reason is not None:
            self._finish(seq, reason)
        free = None if result.log_normaliser is None else result.log_normaliser[row, : len(visible)]
        logprobs = (token_logprobs(result.logits[row, : len(visible)], visible, seq.params.logprobs, free)
                    if seq.params.logprobs is not None else None)
        return self._output(seq, visible, logprobs)

    def _prefill(self, seq: Sequence, start: int, end: int) -> StepOutput | None:
        """Run one chunk of the prompt (or of a KV recompute); at the prompt's end, sample the first token.
        The first chunk starts after the positions the prefix cache provided (Sequence.num_cached_tokens)."""
        if not seq.target_version:  # its first chunk: it runs on the newest weights (the prefix cache's epoch)
            seq.target_version = self.target_version
        target = self.targets[seq.target_version]
        tokens = torch.tensor(seq.context_ids(start, end))[None]
        hidden = target(tokens, torch.tensor([seq.slot]), torch.tensor([start]), self.cache)
        seq.num_computed = end
        recompute = bool(seq.output_ids)
        self.stats.count_prefill(seq.prompt_ids, start, end, recompute)  # computed twice? (the token-use ledger)
        seq.segments.add_features(start, hidden[0])  # the record keeps these features if its sink takes them
        if not recompute:
            self.stats.prompt_tokens_computed += end - start
        if self.drafter is not None:
            seq.draft_pending_features.append(hidden[0])
            seq.draft_pending_tokens.extend(seq.context_ids(start + 1, end + 1 if recompute else min(end + 1, seq.prompt_len)))
        if end < seq.prefill_end or recompute:
            if end == seq.prefill_end:
                seq.status = Status.DECODE  # recomputed: the pending token is still the next input
            self._drafter_catch_up(seq)
            return None
        seq.status = Status.DECODE
        result = sample_first(target, hidden[:, -1], seq.prompt_len, _sampler([seq]))
        (accepted,), (emitted,) = result.rows()
        out = self._commit(seq, ([], []), accepted, emitted, result, 0, "")
        self._drafter_catch_up(seq)
        return out

    def _drafter_catch_up(self, seq: Sequence) -> None:
        """Let the drafter consume a sequence's pending entries now (a prefilled prompt, or a long
        backlog before a batched propose; one sequence, no padding), keeping the last entry pending
        so that the next propose always has a position to start from."""
        n = len(seq.draft_pending_tokens) - 1
        if self.drafter is None or n < 1:
            return
        features = torch.cat(seq.draft_pending_features)
        catch_up(self.drafter, self.draft_cache, torch.tensor([seq.slot]), torch.tensor([seq.draft_start]),
                 features[None, :n], torch.tensor(seq.draft_pending_tokens[:n])[None])
        seq.draft_pending_features[:] = [features[n:]]
        del seq.draft_pending_tokens[:n]
        seq.draft_start += n

    def _abort_flagged(self) -> list[StepOutput]:
        outputs = []
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            if seq.aborted and seq.status is not Status.FINISHED:
                self._finish(seq, "abort")
                outputs.append(self._output(seq, [], None))
        return outputs

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.segments.close(reason)
        if self.suffix is not None and self.index_finished:  # this replica's traffic drafts for the next request at once
            self.suffix.add(seq.request_id, seq.prompt_ids + seq.output_ids)
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
                seq.segments.close()
            if swap.role == "drafter":
                self.drafter, self.drafter_version = swap.model, swap.version
                self.controller.reset(prior_accept_rate(swap.version))
            else:
                self.targets[swap.version] = swap.model
                self.target_version = swap.version
                if self.drafter is not None:
                    self.drafter.retarget(swap.model)
                if swap.mode == "interrupt":
                    for seq in running:
                        self._restart_on(seq, swap.version)
            if self.prefix is not None:  # KV of the old weights (either model's) is never reused by the new ones
                self.prefix.new_epoch()
            swap.done.set_result(SwapResult(swap.role, swap.version, swap.mode, swap.load_ms,
                                            (time.perf_counter() - swap.requested_at) * 1000))
        in_use = {s.target_version for s in self.scheduler.running} | {self.target_version}
        for version in [v for v in self.targets if v not in in_use]:
            del self.targets[version]

    def _restart_on(self, seq: Sequence, version: str) -> None:
        """Move a running sequence to new target weights: recompute its KV from its tokens (its first
        chunk is placed again: the prefix cache may serve it what another restarted sequence recomputed)."""
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
                          seq.spec, seq.target_version, self.drafter_version, seq.version_runs)

    def cost_prior(self) -> CostModel:
        """`calibrate`'s prior, timed once per matmul calibration (machine, torch, threads, dtype), model shape,
        drafter shape, batch and widths, then read from a file beside that calibration: a restarted replica skips
        the timing (~2 s on two cores, more while other replicas load them). Without a calibration (plain models),
        timed every time."""
        path = self.cost_prior_path()
        if path is None:
            return self.calibrate()
        try:
            costs = CostModel.prior_from_dict(json.loads(path.read_text()))
            log.info("event=cost_prior source=%s", path)
            return costs
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not measured yet here (or unreadable): measure
        costs = self.calibrate()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = path.with_name(f".{path.name}.{os.getpid()}")
            staging.write_text(json.dumps(costs.prior_to_dict()))
            staging.replace(path)  # whole or absent, with replicas starting side by side
        except OSError as exc:
            log.warning("event=cost_prior_not_saved path=%s error=%r", path, exc)
        return costs

    def cost_prior_path(self) -> Path | None:
        """Where `cost_prior` keeps this engine's prior (None without a calibration)."""
        if self.plan is None:
            return None
        drafter = self.drafter.cfg if self.drafter is not None else None
        key = {"plan": self.plan.key, "target": dataclasses.asdict(self.target.cfg), "max_batch": self.settings.max_batch,
               "drafter": dataclasses.asdict(drafter) if drafter is not None else None, "widest": self._widest()}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return self.plan.path.with_name(f"cost-prior-{digest}.json")

    def _widest(self) -> int:
        """The widest draft any proposer may ask for."""
        return max(self.settings.max_draft_tokens if self.drafter is not None else 0,
                   self.settings.suffix_max_tokens if self.suffix is not None else 0)

    @torch.inference_mode()
    def calibrate(self, rounds: int = 3) -> CostModel:
        """Time target forwards (B, T) for the verify widths the proposers can ask for, and drafter
        passes, on idle slots: the cost prior (logged, one line). B = 1 and max_batch only, the
        sizes between interpolated at equal T, which overprices their drafts (a forward's cost
        follows B * T: interpolated from 1 and 8, a B=4 verify of T = 2-5 read 1.28-2.09x a plain
        step against 1.07-1.87x measured). Timing B = 2 and 4 as well fixed that and made B=4
        slower (index alone, 4 requests at a time, max_batch 8, in-process A/B: 0.96x): the
        planner drafted more (0.57 -> 0.70 tokens a row-step) for no more tokens (1.27 -> 1.28 a
        step), so what it trades against the price (a packed verify's cost per position, the
        index's acceptance of its marginal tokens) is off by as much."""
        widest = self._widest()
        positions = sorted({t for t in CALIBRATED_POSITIONS if t <= widest + 1} | {widest + 1})
        costs = CostModel.measure(self.target, self.drafter, sorted({1, self.settings.max_batch}), positions, rounds)
        log.info("event=cost_prior target_ms=%s draft_ms=%s",
                 ",".join(f"B{b}T{t}:{c * 1e3:.2f}" for (b, t), c in sorted(costs.target.items())),
                 ",".join(f"B{b}:{c * 1e3:.2f}" for b, c in sorted(costs.draft.items())) or "-")
        return costs


def prior_accept_rate(drafter_version: str) -> float:
    """What the controller assumes of a drafter before it has seen it draft: the day-0 head accepts
    ~0.05 per token (measured on SmolLM2), a trained one on this traffic ~0.3 (measured after 20
    minutes of `bench adapt`); probes correct both within a few steps."""
    return 0.05 if drafter_version == DAY0 else 0.3


def _peers(running: list[Sequence]) -> dict[int, list]:
    """prompt_key -> the suffix contexts of the running sequences with that prompt, where two or
    more share it (the n samples of one request, a GRPO group: each other's best evidence)."""
    groups: dict[int, list] = {}
    for seq in running:
        if seq.suffix is not None:
            groups.setdefault(seq.prompt_key, []).append(seq.suffix)
    return {key: contexts for key, contexts in groups.items() if len(contexts) > 1}


def _sampler(running: list[Sequence]) -> RowSampler:
    """The rows' sampling rules; penalties and min_tokens read each row's prompt and output so far."""
    return RowSampler.of([s.params for s in running], [s.generator for s in running], [s.stream for s in running],
                         [(s.prompt_ids, s.output_ids) for s in running])


