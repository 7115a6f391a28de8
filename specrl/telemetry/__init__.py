"""The event record (versioned schema) and where records go (sinks) and come from (reader)."""

from specrl.telemetry.reader import RecordReader
from specrl.telemetry.record import SCHEMA_VERSION, SegmentRecord, StepRecord
from specrl.telemetry.redis_sink import RECORD_FIELD, RedisSink, events_stream, strip_content
from specrl.telemetry.sink import MemorySink, RecordSink

__all__ = ["SCHEMA_VERSION", "SegmentRecord", "StepRecord", "MemorySink", "RecordSink", "RedisSink", "RecordReader",
           "RECORD_FIELD", "events_stream", "strip_content"]
