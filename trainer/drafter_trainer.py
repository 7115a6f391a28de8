"""The drafter trainer: consume reward events, learn, evaluate, publish, canary.

    read records (consumer group; own pending first, stale ones of dead consumers claimed)
      -> rebuild contexts (dedupe by request, segment) -> held-out slice or the train queue
      -> the freshest queued examples (older ones expire) -> their target features: shipped in the
         records, else recomputed with a frozen copy of the target at the record's version
      -> drafter loss (objective) -> optimizer step (nothing new: replay recent examples)
      -> every few steps: checkpoint the trainer's state, then ack the records it covers
      -> every N steps or T seconds: exact greedy acceptance of the candidate on the held-out slice
         (the serving drafter's is kept until the slice changes); publish and swap replicas when
         the candidate learned from new records and is at least as good (times 1 + margin): the
         lag from a record to a serving drafter that learned from it is about that cadence
      -> canary: published drafters that accept worse live are rolled back to the last good one.

Staleness rule: records name the policy version that produced them; a record whose version is
not the newest one seen is trained with weight 0.25 (the drafter must follow the current policy),
and one whose version cannot be loaded from the store is skipped and acked.
Throughput rule (trainer/throughput.py): the freshest examples train first; one older than
`trainer_max_age_s` when its turn comes, or pushed out of a full queue (4 x train_records), is
expired (acked, counted); with nothing new to read, a replay step trains recent examples again.
Acks come only after a checkpoint holding what became of the records (the optimizer step that
used them, or the queue still holding them): a killed trainer re-reads unacked records and
trains on them once (the dedupe set and the queue are in the checkpoint).
Features (trainer/features.py): shipped ones need only the target's head; a record without them
is recomputed (`trainer_recompute`), or skipped and counted; a trainer that cannot recompute
and finds no features in the stream stops with a message naming the setting.
"""

from __future__ import annotations

import copy
import logging
import time
import zlib
from collections import Counter, deque
from pathlib import Path

import torch

from specrl.config import Settings
from specrl.engine.start import DAY0, NO_DRAFTER, build_drafter, start_weights
from specrl.errors import InvalidRequestError, SpecrlError
from specrl.models.drafter import EagleDrafter
from specrl.redis_conn import REDIS_ERRORS
from specrl.speculation.simulate import heldout_acceptance
from specrl.telemetry.event_log import EventLog
from specrl.telemetry.reader import RecordReader
from specrl.telemetry.record import SegmentRecord
from specrl.telemetry.sink import record_tokens
from specrl.telemetry.token_use import TRAINER_USES
from specrl.trainer.canary import Canary
from specrl.trainer.checkpoint import save_checkpoint
from specrl.trainer.contexts import ContextBook, Example
from specrl.trainer.features import Features, TargetPool
from specrl.trainer.objectives import OBJECTIVES, example_loss
from specrl.trainer.publisher import Publisher
from specrl.trainer.throughput import Queued, Throughput, TrainQueue
from specrl.weights import WeightsStore

log = logging.getLogger("specrl.trainer")
STALE_WEIGHT = 0.25
QUEUE_BATCHES = 4  # the train queue holds this many optimizer steps of examples
GAP_WAIT_MS = 30_000  # an example whose first positions' features are still missing waits this long for them
# Evaluating is not training: the held-out check of a SmolLM2 drafter grows to ~6 s on 2 cores as the
# slice fills (32 requests), so the next one waits at least this many times as long as the last took.
EVAL_SPACING = 2.0  # -> at most a third of the trainer's time goes to evaluation


class DrafterTrainer:
    def __init__(self, settings: Settings, model_dir: Path, reader: RecordReader, *, store: WeightsStore,
                 publisher: Publisher | None, state_path: Path, events: EventLog | None = None,
                 day0_vocabulary: torch.Tensor | None = None):
        """day0_vocabulary: a day-0 drafter's draft vocabulary (token ids; None: the first ids, as settings say)."""
        if settings.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {settings.objective!r}")
        if settings.unroll_steps < 0:
            raise ValueError(f"unroll_steps must be >= 0, got {settings.unroll_steps}")
        self.settings, self.reader, self.store, self.publisher = settings, reader, store, publisher
        self.events = events or EventLog(None)
        self.targets = TargetPool(model_dir, settings.target_version, store, recompute=settings.trainer_recompute)
        self.target_version = settings.target_version
        base = self.targets.head(self.target_version)
        if base is None:
            raise SpecrlError(f"the target {model_dir} cannot be loaded (see the log)")
        start = start_weights(settings, model_dir, store)
        if start.drafter == NO_DRAFTER:
            raise InvalidRequestError("the drafter trainer needs a drafter to train: --drafter day0 or a directory")
        self.drafter = build_drafter(start.drafter, base, settings, day0_vocabulary)
        self.serving_version = start.drafter_version
        self.serving = copy.deepcopy(self.drafter)  # what replicas run: the bar a candidate must beat
        self.serving.retarget(base)
        self.optimizer = torch.optim.AdamW([p for p in self.drafter.parameters() if p.requires_grad], lr=settings.lr)
        self.book = ContextBook(hidden_size=base.cfg.hidden_size, features_max_bytes=settings.record_features_max_bytes)
        self.features = Features(self.targets, self.book)
        self.queue = TrainQueue(QUEUE_BATCHES * settings.train_records, settings.trainer_max_age_s,
                                settings.trainer_replay_records, seed=settings.seed)
        self.throughput = Throughput(reader)
        self.heldout: deque[tuple[Example, torch.Tensor]] = deque(maxlen=32)  # with target features, computed once
        self.canary = Canary(settings.canary_tokens, settings.canary_margin)
        self.state_path = state_path
        self.step = self.records = self.skipped = self.expired = self.replays = self.replayed_records = 0
        self.tokens: Counter[str] = Counter({use: 0 for use in TRAINER_USES})  # positions by use (token_use.py)
        self.read_records = self.read_tokens = 0
        self.with_features = self.without_features = 0  # records read
        self.unacked: list[str] = []
        self.history: list[dict] = []  # evaluations and publishes, for reports
        self._last_eval = time.monotonic()
        self._last_eval_step = 0
        self._eval_s = 0.0  # how long the last evaluation took
        self._published_records = 0  # self.records when the serving drafter was published
        self._heldout_added = 0  # examples ever held out: the slice's identity
        self._serving_tau: tuple[int, float | None] | None = None  # (slice, the serving drafter's tau on it)
        self._scaled = start.drafter != DAY0  # a trained drafter already carries its feature scale
        self.load_state()

    # ---- the loop ------------------------------------------------------------------------------
    def run(self, should_stop, *, block_ms: int = 1000, on_step=None) -> None:
        """Until should_stop(): Redis trouble (down, restarted without its data) is waited out
        with backoff; the group is recreated and reading resumes from the pending list."""
        backoff, need_group = 0.5, True
        while not should_stop():
            try:
                if need_group:
                    self.reader.ensure_group()
                    need_group = False
                self.run_once(block_ms)
                backoff = 0.5
                if on_step is not None:
                    on_step(self)
            except REDIS_ERRORS as exc:
                log.warning("event=redis_error error=%r retry_in_s=%.1f", exc, backoff)
                time.sleep(backoff)
                backoff, need_group = min(2 * backoff, 10.0), True

    def run_once(self, block_ms: int = 1000) -> int:
        """Read what fits the queue, train one step (the freshest examples, or a replay when nothing
        came), maybe checkpoint+ack, evaluate and publish. -> records read + examples trained fresh
        (0: nothing was left to do)."""
        room = max(self.settings.train_records, self.queue.capacity - len(self.queue))
        entries = self.reader.read(room, block_ms) or self.reader.claim_stale(self.settings.claim_idle_ms, room)
        for entry_id, record in entries:
            self._take_in(entry_id, record)
        if not self.targets.recompute and self.without_features and not self.with_features:
            raise SpecrlError(f"the records on {self.reader.stream} carry no target features and this trainer has no "
                              "target to recompute them (trainer_recompute off): serve with --record-features (not "
                              "with --no-telemetry-content or --backend vllm), or run the trainer with --trainer-recompute")
        now_ms = self.throughput.now_ms()
        self._expire(self.queue.expire(now_ms))
        batch = [q.example for q in self.queue.take(self.settings.train_records, lambda q: self._ready(q, now_ms))]
        replay = not batch and not entries
        if replay:
            batch = self.queue.replay_batch(self.settings.train_records)
        if batch:
            started = time.perf_counter()
            loss = self.train(batch, replay=replay)
            self.events.write("train", step=self.step, records=self.records, loss=loss, replay=replay,
                              step_s=round(time.perf_counter() - started, 3))
            if self.step % 10 == 0:
                log.info("event=train step=%d records=%d loss=%.4f step_s=%.2f replay=%s", self.step, self.records,
                         loss, time.perf_counter() - started, replay)
        if self.unacked and (replay or not batch or self.step % self.settings.checkpoint_every_steps == 0):
            self.save_state()
            self.reader.ack(self.unacked)
            self.unacked = []
        self.throughput.update(self.records, self.tokens["trained"], self.read_tokens / max(self.read_records, 1),
                               self.queue)
        self.maybe_publish()
        self.check_canary()
        return len(entries) + (0 if replay else len(batch))

    def _take_in(self, entry_id: str, record: SegmentRecord) -> None:
        """One record read: into the book, then held out, queued or skipped. Its entry is acked at
        the next checkpoint, whatever became of it."""
        self.unacked.append(entry_id)
        self.canary.observe(record)
        try:
            example = self.book.add(record)
        except ValueError as exc:
            self.reader.dead_letter(entry_id, record.to_msgpack(), f"cannot rebuild context: {exc}")
            return
        if example is None:
            return
        self.read_records += 1
        self.read_tokens += record_tokens(record)
        if record.features is not None:
            self.with_features += 1
        else:
            self.without_features += 1
        if self.targets.head(record.target_version) is None:
            self.skipped += 1
            self.tokens["unusable"] += len(example.positions)
            return
        if record.target_version != self.target_version:  # a newer policy? (reads the store: only on change)
            self.target_version = max(self.target_version, record.target_version, key=self._version_order)
        if zlib.crc32(record.request_id.encode()) % 1000 < self.settings.heldout_fraction * 1000:
            self._hold_out(example)
        else:
            self._expire(self.queue.push(Queued(int(entry_id.partition("-")[0]), entry_id, example)))

    def _ready(self, queued: Queued, now_ms: int) -> bool:
        """Train it now, unless its first positions' features may still come with another record
        (the server's prefix cache served them from a context the trainer has not read yet)."""
        example = queued.example
        return (example.features is None or example.complete or self.book.fill(example)
                or now_ms - queued.arrived_ms >= GAP_WAIT_MS)

    def _expire(self, items: list[Queued]) -> None:
        self.expired += len(items)
        self.tokens["expired"] += sum(len(q.example.positions) for q in items)

    def train(self, batch: list[Example], replay: bool = False) -> float:
        """One optimizer step on the examples' drafter positions (replay: examples trained before)."""
        self.drafter.train()
        losses, weights, used = [], [], []
        share = max(1, self.settings.train_positions // len(batch))  # every example gets its share of positions
        for example in batch:
            positions = list(example.positions)[-share:]
            loss = self._example_loss(example, positions, count=not replay) if positions else None
            if loss is None:
                self.tokens["unusable"] += 0 if replay else len(example.positions)
                continue
            losses.append(loss)
            weights.append(1.0 if example.target_version == self.target_version else STALE_WEIGHT)
            used.append(example)
            self.tokens["replayed" if replay else "trained"] += len(positions)
            self.tokens["truncated"] += 0 if replay else len(example.positions) - len(positions)
        if not losses:
            return float("nan")
        total = sum(w * l for w, l in zip(weights, losses)) / sum(weights)
        self.optimizer.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
        self.optimizer.step()
        self.step += 1
        if replay:
            self.replays += 1
            self.replayed_records += len(losses)
        else:
            self.records += len(losses)
            self.queue.trained(used)
        return float(total.detach())

    def _example_features(self, example: Example, count: bool = True) -> torch.Tensor | None:
        """-> [T-1, H] float32 (shipped or recomputed; kept on the example for replays), or None."""
        recomputed = self.features.recomputed_tokens
        hidden = example.features.float() if example.complete and not count else self.features.of(example)
        self.tokens["trainer_recomputed"] += self.features.recomputed_tokens - recomputed
        if hidden is not None and not example.complete:
            example.features, example.feature_start = hidden.half(), 0
        return hidden

    def _example_loss(self, example: Example, positions: list[int], count: bool = True) -> torch.Tensor | None:
        hidden = self._example_features(example, count)
        if hidden is None:
            return None
        # Standardise features once, from the first context seen: the target's hidden states have
        # outlier dimensions (RMS up to ~470 on SmolLM2, against ~1 for most).
        if not self._scaled:
            self.drafter.set_feature_scale(hidden.std(0).clamp(min=1e-2))
            self._scaled = True
        return example_loss(self.drafter, self.settings.objective, self.settings.unroll_steps, example, positions,
                            hidden, lambda h: self.targets.draft_logits(example.target_version, h, self.drafter))

    # ---- evaluate, publish, canary -------------------------------------------------------------
    def _hold_out(self, example: Example) -> None:
        if example.start < len(example.tokens) - 1:
            hidden = self._example_features(example)
            if hidden is not None:
                self.heldout.append((example, hidden))
                self._heldout_added += 1
                self.tokens["heldout"] += len(example.positions)

    def evaluate(self, drafter: EagleDrafter) -> float | None:
        """Mean tokens per verify step (exact greedy, k = eval_k) over the held-out examples."""
        drafter.eval()
        return heldout_acceptance(drafter, self.heldout, self.settings.eval_k)[0]

    def maybe_publish(self) -> str | None:
        due = (self.step - self._last_eval_step >= self.settings.publish_every_steps
               or time.monotonic() - self._last_eval >= self.settings.publish_every_s)
        if (not due or self.step == self._last_eval_step or not self.heldout
                or time.monotonic() - self._last_eval < EVAL_SPACING * self._eval_s):
            return None
        started = time.monotonic()
        candidate, serving = self.evaluate(self.drafter), self.serving_tau()
        self._last_eval, self._last_eval_step = time.monotonic(), self.step  # after: evaluation time is not training time
        self._eval_s = self._last_eval - started
        entry = self.events.write("evaluate", step=self.step, records=self.records, candidate_tau=candidate,
                                  serving_tau=serving, serving_version=self.serving_version,
                                  eval_s=round(self._eval_s, 3))
        self.history.append({**entry, "published": None})
        log.info("event=evaluate step=%d records=%d candidate_tau=%s serving_tau=%s", self.step, self.records,
                 candidate, serving)
        if (candidate is None or serving is None or candidate < serving * (1 + self.settings.publish_margin)
                or self.records == self._published_records):
            return None
        return self._publish(candidate, serving, self.history[-1])

    def serving_tau(self) -> float | None:
        """The serving drafter's held-out tau, evaluated once per held-out slice."""
        if self._serving_tau is None or self._serving_tau[0] != self._heldout_added:
            self._serving_tau = (self._heldout_added, self.evaluate(self.serving))
        return self._serving_tau[1]

    def _publish(self, candidate: float, serving: float, entry: dict) -> str | None:
        if self.publisher is None:
            return None
        if self.serving_version not in {m.version for m in self.store.versions("drafter")}:
            # The day-0 head serves from no store: store it first, so that a rollback can return to it.
            self.publisher.publish(self.serving, parent=None, target_version=self.target_version,
                                   metrics={"heldout_tau": serving}, version=self.serving_version)
        version = self.publisher.publish(self.drafter, parent=self.serving_version, target_version=self.target_version,
                                         metrics={"heldout_tau": candidate, "serving_tau": serving, "step": self.step,
                                                  "records": self.records})
        report = self.publisher.swap(version)
        entry.update(published=version, swapped=report.swapped, failed=report.failed, announced=report.announced)
        self.events.write("publish", version=version, parent=self.serving_version, tau=candidate, serving_tau=serving,
                          step=self.step, records=self.records, swapped=report.swapped, failed=list(report.failed),
                          announced=report.announced)
        log.info("event=publish version=%s parent=%s tau=%.3f serving_tau=%.3f swapped=%s failed=%s announced=%s",
                 version, self.serving_version, candidate, serving, report.swapped, list(report.failed),
                 report.announced)
        if report.serving:
            self.canary.watch(version, self.serving_version)
            self.serving, self.serving_version = copy.deepcopy(self.drafter), version
            self.serving.retarget(self.drafter.target)
            self._serving_tau, self._published_records = (self._heldout_added, candidate), self.records
        return version

    def check_canary(self) -> None:
        rollback = self.canary.verdict()
        if rollback is None or self.publisher is None:
            return
        bad, good, reason = self.serving_version, rollback.to, rollback.reason
        if good not in {m.version for m in self.store.versions("drafter")}:
            log.warning("event=rollback_impossible version=%s to=%s reason=%r (not in the store)", bad, good, reason)
            return
        report = self.publisher.swap(good)
        log.warning("event=rollback version=%s to=%s reason=%r swapped=%s", bad, good, reason, report.swapped)
        entry = self.events.write("rollback", step=self.step, version=bad, to=good, reason=reason,
                                  swapped=report.swapped)
        self.history.append({**entry, "rollback": bad})
        self.serving = EagleDrafter.load(self.store.verify("drafter", good), self.drafter.target)
        self.serving_version, self._serving_tau = good, None

    # ---- state ------------------------------------------------------------------------------------
    def save_state(self) -> None:
        state = {"drafter": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                 "records": self.records, "serving_version": self.serving_version, "book": self.book.state(),
                 "history": self.history, "queue": self.queue.items,
                 "counters": {"tokens": dict(self.tokens), "expired": self.expired, "replays": self.replays,
                              "replayed_records": self.replayed_records, "skipped": self.skipped}}
        save_checkpoint(state, self.state_path)

    def load_state(self) -> None:
        if not self.state_path.is_file():
            return
        state = torch.load(self.state_path, weights_only=False)
        try:
            self.drafter.load_state_dict(state["drafter"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError) as exc:
            raise SpecrlError(f"the trainer state {self.state_path} does not fit this drafter ({str(exc).splitlines()[0]}"
                              f"...): move it away, or use another --deployment or --consumer") from None
        self.step, self.records, self.history = state["step"], state["records"], state["history"]
        self.book.load_state(state["book"])
        self.queue.items = list(state.get("queue", []))  # read before the checkpoint, not yet trained
        counters = state.get("counters", {})
        self.tokens.update(counters.get("tokens", {}))
        self.expired, self.replays = counters.get("expired", 0), counters.get("replays", 0)
        self.replayed_records, self.skipped = counters.get("replayed_records", 0), counters.get("skipped", 0)
        self._last_eval_step, self._scaled = self.step, True
        log.info("event=resume step=%d records=%d serving_version=%s", self.step, self.records, self.serving_version)

    def _version_order(self, version: str) -> tuple:
        manifests = {m.version: i for i, m in enumerate(self.store.versions("policy"))}
        return (version != self.settings.target_version, manifests.get(version, -1))
