"""Where finished segment records go. The engine only knows `RecordSink.emit`, which must
never block the decode path; the in-memory sink serves tests and benchmarks. Every sink counts
what it sent, dropped and still holds (`SinkCounters`), which /metrics exports."""

from __future__ import annotations

from collections import deque
from typing import Protocol

from specrl.telemetry.record import SegmentRecord


class RecordSink(Protocol):
    def emit(self, record: SegmentRecord) -> None: ...


class SinkCounters(Protocol):
    sent: int  # records delivered
    dropped: int  # records lost (queue full, failed sends, evicted from memory)
    queued: int  # records waiting to be sent


class MemorySink:
    """Keeps the last `capacity` records; counts what it had to drop."""

    queued = 0

    def __init__(self, capacity: int = 100_000):
        self.records: deque[SegmentRecord] = deque(maxlen=capacity)
        self.emitted = 0

    def emit(self, record: SegmentRecord) -> None:
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
