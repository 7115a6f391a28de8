"""Continuous batching: admit, chunk prefills, decode everyone, retire.

The KV budget is the number of cache slots: a sequence holds one slot (room for
`max_seq_len` positions) from admission to its end. Admission is FIFO, so nobody waits
behind later arrivals; every admitted sequence decodes in every step, so a long request
cannot starve the others; prompts are prefilled at most `prefill_chunk` tokens per step,
so a long prompt delays running sequences by one bounded chunk per step, not by its length.
Beyond `max_waiting` queued requests, `add` refuses with QueueFullError.

With a prefix cache (specrl/engine/prefix_cache.py), admission picks the free slot whose kept KV
the prompt reuses, and a sequence's first chunk starts after the positions it reuses (or waits a
step for a sequence prefilling the same prefix); reused positions take no prefill budget.
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from dataclasses import dataclass, field

from specrl.errors import QueueFullError
from specrl.engine.prefix_cache import PrefixCache
from specrl.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    prefill: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (seq, start, end) prompt chunks
    decode: list[Sequence] = field(default_factory=list)  # ordered by slot


class Scheduler:
    def __init__(self, num_slots: int, prefill_chunk: int, max_waiting: int, prefix: PrefixCache | None = None):
        self.prefill_chunk, self.max_waiting, self.prefix = prefill_chunk, max_waiting, prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(num_slots))  # a heap: lowest slot first keeps batches consecutive
        self._lock = threading.Lock()  # add/abort come from other threads
        self.admitting = True  # False while nothing new may start (shutdown)

    def add(self, seq: Sequence) -> None:
        with self._lock:
            if len(self.waiting) >= self.max_waiting:
                raise QueueFullError(f"the engine is saturated: {len(self.waiting)} requests are waiting; retry later")
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        with self._lock:
            while self.admitting and self.waiting and self._free_slots:
                seq = self.waiting.popleft()
                if seq.aborted:
                    continue
                seq.slot, seq.status = self._take_slot(seq), Status.PREFILL
                self.running.append(seq)
        batch, budget = ScheduledBatch(), self.prefill_chunk
        for seq in self.running:
            if seq.status is Status.PREFILL and budget > 0:
                if self.prefix is not None and seq.num_computed == 0 and not self.prefix.place(seq, self.running):
                    continue  # another sequence is prefilling its prefix: reuse that instead
                n = min(seq.prefill_end - seq.num_computed, budget)
                batch.prefill.append((seq, seq.num_computed, seq.num_computed + n))
                budget -= n
        batch.decode = sorted((s for s in self.running if s.status is Status.DECODE), key=lambda s: s.slot)
        return batch

    def retire(self, seq: Sequence) -> None:
        """Free a finished (or aborted) sequence's slot."""
        with self._lock:
            seq.status = Status.FINISHED
            if seq in self.running:
                self.running.remove(seq)
                if self.prefix is not None:  # the slot keeps its KV until it is needed
                    self.prefix.release(seq)
                heapq.heappush(self._free_slots, seq.slot)
            elif seq in self.waiting:
                self.waiting.remove(seq)

    def _take_slot(self, seq: Sequence) -> int:
        """The free slot `seq` is admitted into: the lowest, or the prefix cache's choice."""
        if self.prefix is None:
            return heapq.heappop(self._free_slots)
        slot = self.prefix.choose_slot(seq, self._free_slots, self.running)
        self._free_slots.remove(slot)
        heapq.heapify(self._free_slots)
        return slot
