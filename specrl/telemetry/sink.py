"""Where finished segment records go. The engine only knows `RecordSink.emit`, which must
never block the decode path; the in-memory sink serves tests and benchmarks. Every sink counts
what it sent, dropped and still holds (`SinkCounters`), which /metrics exports.

A sink also says whether it takes the target's features (`features_max_bytes`: the per-record
budget, 0 = none): the segment writer records them only then."""

from __future__ import annotations

from collections import deque
from typing import Protocol

from specrl.telemetry.record import SegmentRecord


class RecordSink(Protocol):
    features_max_bytes: int  # the per-record budget of target features it takes (0: none)

    def emit(self, record: SegmentRecord) -> None: ...


class SinkCounters(Protocol):
    sent: int  # records delivered
    dropped: int  # records lost (queue full, failed sends, evicted from memory)
    dropped_tokens: int  # the prompt and committed tokens of the records lost
    queued: int  # records waiting to be sent


def record_tokens(record: SegmentRecord) -> int:
    """The tokens a record carries: its prompt (segment 0) and the tokens it committed (0 for
    something that is not a record: counting never raises)."""
    try:
        return len(record.prompt_ids or ()) + len(record.tokens)
    except (AttributeError, TypeError):
        return 0


class MemorySink:
    """Keeps the last `capacity` records; counts what it had to drop."""

    queued = 0

    def __init__(self, capacity: int = 100_000, features_max_bytes: int = 0):
        self.records: deque[SegmentRecord] = deque(maxlen=capacity)
        self.emitted = 0
        self.dropped_tokens = 0
        self.features_max_bytes = features_max_bytes

    def emit(self, record: SegmentRecord) -> None:
        if len(self.records) == self.records.maxlen:
            self.dropped_tokens += record_tokens(self.records[0])
        self.records.append(record)
        self.emitted += 1

    @property
    def sent(self) -> int:
        return self.emitted

    @property
    def dropped(self) -> int:
        return self.emitted - len(self.records)

    def close(self, timeout: float = 5.0) -> None:
        """Nothing to flush: the records stay readable."""
