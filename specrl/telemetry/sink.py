"""Where finished segment records go. The engine only knows `RecordSink.emit`, which must
never block the decode path; the in-memory sink serves tests and benchmarks."""

from __future__ import annotations

from collections import deque
from typing import Protocol

from specrl.telemetry.record import SegmentRecord


class RecordSink(Protocol):
    def emit(self, record: SegmentRecord) -> None: ...


class MemorySink:
    """Keeps the last `capacity` records; counts what it had to drop."""

    def __init__(self, capacity: int = 100_000):
        self.records: deque[SegmentRecord] = deque(maxlen=capacity)
        self.emitted = 0

    def emit(self, record: SegmentRecord) -> None:
        self.records.append(record)
        self.emitted += 1

    @property
    def dropped(self) -> int:
        return self.emitted - len(self.records)
