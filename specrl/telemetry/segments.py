"""One request's segment records, built step by step and handed to a sink: both backends use it.

A segment holds up to `SEGMENT_STEPS` verify steps under one version pair. A full segment is
sent when the next step arrives, not at once: were the step that fills it also the request's
last, `close(reason)` must still find it to stamp the finish reason. A weight swap closes every
open segment (`close()` without a reason) so the next step opens one under the new versions.
"""

from __future__ import annotations

from specrl.telemetry.record import SEGMENT_STEPS, SegmentRecord, StepRecord
from specrl.telemetry.sink import RecordSink


class SegmentWriter:
    def __init__(self, sink: RecordSink | None, request_id: str, prompt_ids: list[int], *,
                 deployment: str, replica: str):
        self.sink, self.request_id, self.prompt_ids = sink, request_id, prompt_ids
        self.deployment, self.replica = deployment, replica
        self.segment: SegmentRecord | None = None
        self.index = 0

    def add(self, step: StepRecord, tokens: list[int], target_version: str, drafter_version: str) -> None:
        """One verify step and the tokens it committed (accepted drafts + the target's token)."""
        if self.segment is not None and len(self.segment.steps) >= SEGMENT_STEPS:
            self.close()
        if self.segment is None:
            self.segment = SegmentRecord(self.request_id, self.index, target_version, drafter_version,
                                         deployment=self.deployment, replica=self.replica,
                                         prompt_ids=list(self.prompt_ids) if self.index == 0 else None)
        self.segment.steps.append(step)
        self.segment.tokens.extend(tokens)

    def close(self, finish_reason: str | None = None) -> None:
        """Send the open segment (if any), stamped with the request's finish reason when it ended."""
        if self.segment is None:
            return
        self.segment.finish_reason = finish_reason
        if self.sink is not None:
            self.sink.emit(self.segment)
        self.segment, self.index = None, self.index + 1
