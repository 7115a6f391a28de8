"""The event record (versioned schema) and where records go (sinks)."""

from specrl.telemetry.record import SCHEMA_VERSION, SegmentRecord, StepRecord
from specrl.telemetry.sink import MemorySink, RecordSink

__all__ = ["SCHEMA_VERSION", "SegmentRecord", "StepRecord", "MemorySink", "RecordSink"]
