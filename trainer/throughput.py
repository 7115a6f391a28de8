"""Matching what the trainer consumes to what the servers produce.

`Throughput` measures both sides every INTERVAL_S, over the last WINDOW_S: production (records
and tokens arriving on the stream: the entries ever added, from XINFO GROUPS, and the tokens per
record the trainer reads) and consumption (records and positions trained), and the lag: records
waiting (not yet delivered to the group, plus read and queued here) and seconds (the age of the
oldest of them, on the Redis clock that stamps entry ids; for undelivered entries the age of the
last one delivered stands in: an upper bound).

`TrainQueue` is the rule that acts on it:
- every example read joins the queue (stream order); each optimizer step trains the freshest
  `take(n)` of them that are ready (features complete, or waited long enough), so when the
  trainer is behind it learns from the newest traffic first;
- an example older than `max_age_s` (its entry id against the Redis clock) when its turn comes,
  or pushed out of a full queue (`capacity`), is expired: not trained, acked, counted (the
  trainer keeps its context, so the request's later segments still fit);
- the examples trained last (at most `replay_capacity`) stay for replay: when nothing new
  arrives the trainer trains a random sample of them again rather than idle (counted).
"""

from __future__ import annotations

import bisect
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from specrl.trainer.contexts import Example


@dataclass
class Queued:
    arrived_ms: int  # the record's stream entry time (Redis clock, ms)
    entry_id: str
    example: Example


class TrainQueue:
    def __init__(self, capacity: int, max_age_s: float, replay_capacity: int, seed: int = 0):
        self.capacity, self.max_age_ms = capacity, int(max_age_s * 1000)
        self.items: list[Queued] = []  # oldest first
        self.replay: deque[Example] = deque(maxlen=max(0, replay_capacity))
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self.items)

    def oldest_ms(self) -> int | None:
        return self.items[0].arrived_ms if self.items else None

    def push(self, item: Queued) -> list[Queued]:
        """Queue an example (in arrival order) -> the ones pushed out of a full queue (expired)."""
        bisect.insort(self.items, item, key=lambda q: (q.arrived_ms, q.entry_id))
        out = self.items[: max(0, len(self.items) - self.capacity)]
        del self.items[: len(out)]
        return out

    def expire(self, now_ms: int) -> list[Queued]:
        """-> the examples older than the age bound, out of the queue."""
        cut = bisect.bisect_left([q.arrived_ms for q in self.items], now_ms - self.max_age_ms)
        out, self.items = self.items[:cut], self.items[cut:]
        return out

    def take(self, n: int, ready: Callable[[Queued], bool] = lambda q: True) -> list[Queued]:
        """-> the n freshest examples that are `ready`, out of the queue (the others stay)."""
        out: list[Queued] = []
        for i in range(len(self.items) - 1, -1, -1):
            if len(out) == n:
                break
            if ready(self.items[i]):
                out.append(self.items.pop(i))
        return out

    def trained(self, examples: list[Example]) -> None:
        """These were trained on: keep them for replay."""
        self.replay.extend(examples)

    def replay_batch(self, n: int) -> list[Example]:
        """-> up to n examples trained before, at random (empty when replay is off)."""
        pool = list(self.replay)
        return self._rng.sample(pool, min(n, len(pool)))


class Throughput:
    """Production, consumption and lag (see the module docstring). Read the fields from any thread."""

    INTERVAL_S = 2.0
    WINDOW_S = 30.0

    def __init__(self, reader):
        self.reader = reader
        self.clock_offset_ms = 0  # Redis clock - local wall clock
        self.produced_records_per_s = self.produced_tokens_per_s = 0.0
        self.consumed_records_per_s = self.consumed_tokens_per_s = 0.0
        self.lag_records, self.lag_s = 0, 0.0
        self._samples: deque[tuple[float, int, int, int]] = deque()  # (t, added, trained records, trained positions)
        self._next = 0.0

    def now_ms(self) -> int:
        """The Redis clock, estimated from the last measurement."""
        return int(time.time() * 1000) + self.clock_offset_ms

    def update(self, trained_records: int, trained_positions: int, tokens_per_record: float, queue: TrainQueue,
               force: bool = False) -> None:
        """At most every INTERVAL_S (or now with `force`): one round trip to Redis (RecordReader.flow)."""
        now = time.monotonic()
        if now < self._next and not force:
            return
        self._next = now + self.INTERVAL_S
        flow = self.reader.flow()
        self.clock_offset_ms = flow["now_ms"] - int(time.time() * 1000)
        self._samples.append((now, flow["added"], trained_records, trained_positions))
        while len(self._samples) > 2 and self._samples[0][0] < now - self.WINDOW_S:
            self._samples.popleft()
        t0, added0, records0, positions0 = self._samples[0]
        dt = now - t0
        if dt > 0:
            self.produced_records_per_s = (flow["added"] - added0) / dt
            self.produced_tokens_per_s = self.produced_records_per_s * tokens_per_record
            self.consumed_records_per_s = (trained_records - records0) / dt
            self.consumed_tokens_per_s = (trained_positions - positions0) / dt
        self.lag_records = flow["lag"] + len(queue)
        oldest = [ms for ms in (queue.oldest_ms(), flow["last_delivered_ms"] if flow["lag"] else None) if ms]
        self.lag_s = max(0.0, (flow["now_ms"] - min(oldest)) / 1000) if oldest else 0.0
