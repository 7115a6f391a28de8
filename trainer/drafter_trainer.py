"""The drafter trainer: consume reward events, learn, evaluate, publish, canary.

    read records (consumer group; own pending first, stale ones of dead consumers claimed)
      -> rebuild contexts (dedupe by request, segment) -> held-out slice or training batch
      -> target features with a frozen copy of the target at the record's version
      -> drafter loss (objective) -> optimizer step
      -> every few steps: checkpoint the trainer's state, then ack the records it covers
      -> every N steps or T seconds: exact greedy acceptance of candidate vs serving drafter on
         the held-out slice; publish and swap replicas if the candidate wins by a margin
      -> canary: a published drafter that accepts worse live is rolled back.

Staleness rule: records name the policy version that produced them; a record whose version is
not the newest one seen is trained with weight 0.25 (the drafter must follow the current policy),
and one whose version cannot be loaded from the store is skipped and acked.
Acks come only after a checkpoint holding the optimizer step that used the records: a killed
trainer re-reads unacked records and trains on them once (the dedupe set is in the checkpoint).
"""

from __future__ import annotations

import copy
import logging
import time
import zlib
from collections import deque
from pathlib import Path

import redis
import torch

from specrl.config import Settings
from specrl.engine.start import DAY0, NO_DRAFTER, build_drafter, start_weights
from specrl.errors import InvalidRequestError, SpecrlError
from specrl.models.drafter import EagleDrafter
from specrl.models.llama import Llama, load_llama
from specrl.spec.simulate import simulate_greedy
from specrl.telemetry.event_log import EventLog
from specrl.telemetry.reader import RecordReader
from specrl.trainer.canary import Canary
from specrl.trainer.checkpoint import save_checkpoint
from specrl.trainer.contexts import ContextBook, Example
from specrl.trainer.objectives import OBJECTIVES, drafter_loss
from specrl.trainer.publisher import Publisher
from specrl.weights import WeightsStore

log = logging.getLogger("specrl.trainer")
STALE_WEIGHT = 0.25
EMPTY = torch.zeros(0, dtype=torch.long)


class TargetPool:
    """Frozen target copies by policy version ("base" is the model directory)."""

    def __init__(self, base_dir: Path, base_version: str, store: WeightsStore):
        self.base_dir, self.base_version, self.store = base_dir, base_version, store
        self._models: dict[str, Llama] = {}
        self._head_rows: tuple[str | None, torch.Tensor | None] = (None, None)

    def get(self, version: str) -> Llama | None:
        if version not in self._models:
            try:
                directory = self.base_dir if version == self.base_version else self.store.verify("policy", version)
                self._models = {version: load_llama(directory), **dict(list(self._models.items())[-1:])}
            except Exception as exc:  # noqa: BLE001 - any unloadable version is skipped, with the reason logged
                log.warning("event=target_unavailable version=%s error=%s", version, exc)
                return None
        return self._models[version]

    @torch.no_grad()
    def draft_logits(self, version: str, hidden: torch.Tensor, drafter: EagleDrafter) -> torch.Tensor:
        """hidden [N, H] of the target at `version` -> its logits over the drafter's vocabulary
        [N, V_d]: a reduced draft vocabulary needs only those rows of the head."""
        target = self._models[version]
        if self._head_rows[0] != version:  # the rows are copied once per target version
            self._head_rows = (version, drafter.head_rows(target.lm_head))
        return target.logits(hidden, self._head_rows[1])

    @torch.no_grad()
    def features(self, version: str, tokens: list[int]) -> torch.Tensor | None:
        """-> hidden [T, H] of the target at `version` over `tokens`. No logits: the caller takes
        them (`draft_logits`) only at the positions it trains, the head being the largest matmul."""
        target = self.get(version)
        return None if target is None else target(torch.tensor(tokens)[None])[0]


class DrafterTrainer:
    def __init__(self, settings: Settings, model_dir: Path, reader: RecordReader, *, store: WeightsStore,
                 publisher: Publisher | None, state_path: Path, events: EventLog | None = None):
        if settings.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {settings.objective!r}")
        if settings.unroll_steps < 0:
            raise ValueError(f"unroll_steps must be >= 0, got {settings.unroll_steps}")
        self.settings, self.reader, self.store, self.publisher = settings, reader, store, publisher
        self.events = events or EventLog(None)
        self.targets = TargetPool(model_dir, settings.target_version, store)
        self.target_version = settings.target_version
        base = self.targets.get(self.target_version)
        start = start_weights(settings, model_dir, store)
        if start.drafter == NO_DRAFTER:
            raise InvalidRequestError("the drafter trainer needs a drafter to train: --drafter day0 or a directory")
        self.drafter = build_drafter(start.drafter, base, settings)
        self.serving_version = start.drafter_version
        self.serving = copy.deepcopy(self.drafter)  # what replicas run: the bar a candidate must beat
        self.serving.retarget(base)
        self.optimizer = torch.optim.AdamW([p for p in self.drafter.parameters() if p.requires_grad], lr=settings.lr)
        self.book = ContextBook()
        self.heldout: deque[tuple[Example, torch.Tensor]] = deque(maxlen=32)  # with target features, computed once
        self.canary = Canary(settings.canary_tokens, settings.canary_margin)
        self.state_path = state_path
        self.step = self.records = self.skipped = 0
        self.unacked: list[str] = []
        self.history: list[dict] = []  # evaluations and publishes, for reports
        self._last_eval = time.monotonic()
        self._last_eval_step = 0
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
            except redis.RedisError as exc:
                log.warning("event=redis_error error=%r retry_in_s=%.1f", exc, backoff)
                time.sleep(backoff)
                backoff, need_group = min(2 * backoff, 10.0), True

    def run_once(self, block_ms: int = 1000) -> int:
        """Read one batch, train on it, maybe checkpoint+ack, evaluate and publish. -> records read."""
        entries = self.reader.read(self.settings.train_records, block_ms) or \
            self.reader.claim_stale(self.settings.claim_idle_ms, self.settings.train_records)
        batch = []
        for entry_id, record in entries:
            self.unacked.append(entry_id)
            self.canary.observe(record)
            try:
                example = self.book.add(record)
            except ValueError as exc:
                self.reader.dead_letter(entry_id, record.to_msgpack(), f"cannot rebuild context: {exc}")
                self.unacked.remove(entry_id)
                continue
            if example is None:
                continue
            if self.targets.get(record.target_version) is None:
                self.skipped += 1
                continue
            if record.target_version != self.target_version:  # a newer policy? (reads the store: only on change)
                self.target_version = max(self.target_version, record.target_version, key=self._version_order)
            if zlib.crc32(record.request_id.encode()) % 1000 < self.settings.heldout_fraction * 1000:
                self._hold_out(example)
            else:
                batch.append(example)
        if batch:
            started = time.perf_counter()
            loss = self.train(batch)
            self.events.write("train", step=self.step, records=self.records, loss=loss,
                              step_s=round(time.perf_counter() - started, 3))
            if self.step % 10 == 0:
                log.info("event=train step=%d records=%d loss=%.4f step_s=%.2f", self.step, self.records, loss,
                         time.perf_counter() - started)
        if self.unacked and (not batch or self.step % self.settings.checkpoint_every_steps == 0):
            self.save_state()
            self.reader.ack(self.unacked)
            self.unacked = []
        self.maybe_publish()
        self.check_canary()
        return len(entries)

    def train(self, batch: list[Example]) -> float:
        """One optimizer step on the examples' drafter positions."""
        self.drafter.train()
        losses, weights = [], []
        share = max(1, self.settings.train_positions // len(batch))  # every example gets its share of positions
        for example in batch:
            positions = list(example.positions)[-share:]
            loss = self._example_loss(example, positions) if positions else None
            if loss is not None:
                losses.append(loss)
                weights.append(1.0 if example.target_version == self.target_version else STALE_WEIGHT)
        if not losses:
            return float("nan")
        total = sum(w * l for w, l in zip(weights, losses)) / sum(weights)
        self.optimizer.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
        self.optimizer.step()
        self.step += 1
        self.records += len(losses)
        return float(total.detach())

    def _example_loss(self, example: Example, positions: list[int]) -> torch.Tensor | None:
        hidden = self.targets.features(example.target_version, example.tokens)
        if hidden is None:
            return None
        # Standardise features once, from the first context seen: the target's hidden states have
        # outlier dimensions (RMS up to ~470 on SmolLM2, against ~1 for most).
        if not self._scaled:
            self.drafter.set_feature_scale(hidden.std(0).clamp(min=1e-2))
            self._scaled = True
        tokens = torch.tensor(example.tokens)
        out = self.drafter(hidden[None, :-1], tokens[None, 1:])[0]  # [T-1, H]: index j predicts x_{j+2}
        index = torch.tensor(positions)
        # Both distributions over the draft vocabulary: with a reduced one, the target's is
        # renormalised over it (the drafter cannot propose anything else). The target at j+1
        # predicts x_{j+2}.
        target_logits = self.targets.draft_logits(example.target_version, hidden[index + 1], self.drafter)
        head = self.drafter.head_weight()
        row_of = {p: i for i, p in enumerate(positions)}
        rejected_rows, rejected_tokens = self._in_draft_vocab(
            [(row_of[p], t) for p, t in example.rejected if p in row_of], width=2)
        step_rows, step_tokens, step_returns = self._in_draft_vocab(
            [(row_of[pos - 2], d[0], a) for pos, d, a in example.steps if d and pos - 2 in row_of], width=3)
        loss = drafter_loss(self.settings.objective, self.drafter.head_input(out[index]), head, target_logits,
                            rejected_rows=rejected_rows, rejected_tokens=rejected_tokens,
                            step_rows=step_rows, step_tokens=step_tokens, step_returns=step_returns)
        for _ in range(self.settings.unroll_steps):
            # Training-time test: index j reads out[j-1], the drafter's own prediction of h_j, as a
            # later draft does when serving (approximation: earlier positions are unrolled too,
            # where serving attends to a prefix built from real features). Measured on SmolLM2:
            # second-draft acceptance 0.044 vs 0.010 of steps after the same 50 optimizer steps.
            out = self.drafter(torch.cat([hidden[:1], out.detach()[:-1]])[None], tokens[None, 1:])[0]
            loss = loss + drafter_loss("kl", self.drafter.head_input(out[index]), head, target_logits,
                                       rejected_rows=EMPTY, rejected_tokens=EMPTY, step_rows=EMPTY,
                                       step_tokens=EMPTY, step_returns=EMPTY)
        return loss / (1 + self.settings.unroll_steps)

    def _in_draft_vocab(self, rows: list[tuple[int, ...]], width: int) -> tuple[torch.Tensor, ...]:
        """(row, target token id, ...) tuples -> one int64 tensor per column, keeping the tuples
        whose token is in the draft vocabulary, the token as its draft id."""
        columns = torch.tensor(rows, dtype=torch.long).reshape(-1, width).T
        ids = self.drafter.to_draft_ids(columns[1])
        kept = ids >= 0
        return (columns[0][kept], ids[kept], *(c[kept] for c in columns[2:]))

    # ---- evaluate, publish, canary -------------------------------------------------------------
    def _hold_out(self, example: Example) -> None:
        if example.start < len(example.tokens) - 1:
            hidden = self.targets.features(example.target_version, example.tokens)
            if hidden is not None:
                self.heldout.append((example, hidden))

    def evaluate(self, drafter: EagleDrafter) -> float | None:
        """Mean tokens per verify step (exact greedy, k = eval_k) over the held-out examples."""
        drafter.eval()
        taus = [simulate_greedy(drafter, features, torch.tensor(example.tokens), example.start, self.settings.eval_k).tau
                for example, features in self.heldout]
        return sum(taus) / len(taus) if taus else None

    def maybe_publish(self) -> str | None:
        due = (self.step - self._last_eval_step >= self.settings.publish_every_steps
               or time.monotonic() - self._last_eval >= self.settings.publish_every_s)
        if not due or self.step == self._last_eval_step or not self.heldout:
            return None
        candidate, serving = self.evaluate(self.drafter), self.evaluate(self.serving)
        self._last_eval, self._last_eval_step = time.monotonic(), self.step  # after: evaluation time is not training time
        entry = self.events.write("evaluate", step=self.step, records=self.records, candidate_tau=candidate,
                                  serving_tau=serving, serving_version=self.serving_version)
        self.history.append({**entry, "published": None})
        log.info("event=evaluate step=%d records=%d candidate_tau=%s serving_tau=%s", self.step, self.records,
                 candidate, serving)
        if candidate is None or serving is None or candidate <= serving * (1 + self.settings.publish_margin):
            return None
        return self._publish(candidate, serving, self.history[-1])

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
        entry.update(published=version, swapped=report.swapped, failed=report.failed)
        self.events.write("publish", version=version, parent=self.serving_version, tau=candidate, serving_tau=serving,
                          step=self.step, records=self.records, swapped=report.swapped, failed=list(report.failed))
        log.info("event=publish version=%s parent=%s tau=%.3f serving_tau=%.3f swapped=%s failed=%s", version,
                 self.serving_version, candidate, serving, report.swapped, list(report.failed))
        if report.swapped:
            self.canary.watch(version, self.serving_version)
            self.serving, self.serving_version = copy.deepcopy(self.drafter), version
            self.serving.retarget(self.drafter.target)
        return version

    def check_canary(self) -> None:
        reason = self.canary.verdict()
        if reason is None or self.publisher is None:
            return
        bad, parent = self.serving_version, self.store.parent("drafter", self.serving_version)
        if parent is None or parent not in {m.version for m in self.store.versions("drafter")}:
            log.warning("event=rollback_impossible version=%s parent=%s reason=%r (the parent is not in the store)",
                        bad, parent, reason)
            return
        report = self.publisher.swap(parent)
        log.warning("event=rollback version=%s to=%s reason=%r swapped=%s", bad, parent, reason, report.swapped)
        entry = self.events.write("rollback", step=self.step, version=bad, to=parent, reason=reason,
                                  swapped=report.swapped)
        self.history.append({**entry, "rollback": bad})
        self.serving = EagleDrafter.load(self.store.verify("drafter", parent), self.drafter.target)
        self.serving_version = parent

    # ---- state ------------------------------------------------------------------------------------
    def save_state(self) -> None:
        state = {"drafter": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                 "records": self.records, "serving_version": self.serving_version, "book": self.book.state(),
                 "history": self.history}
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
        self._last_eval_step, self._scaled = self.step, True
        log.info("event=resume step=%d records=%d serving_version=%s", self.step, self.records, self.serving_version)

    def _version_order(self, version: str) -> tuple:
        manifests = {m.version: i for i, m in enumerate(self.store.versions("policy"))}
        return (version != self.settings.target_version, manifests.get(version, -1))
