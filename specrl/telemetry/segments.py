"""One request's segment records, built step by step and handed to a sink: both backends use it.

A segment holds up to `SEGMENT_STEPS` verify steps under one version pair. A full segment is
sent when the next step arrives, not at once: were the step that fills it also the request's
last, `close(reason)` must still find it to stamp the finish reason. A weight swap closes every
open segment (`close()` without a reason) so the next step opens one under the new versions.

Features (native engine): the target's hidden states of the positions the engine computed
(`add_features` at prefill, `add(..., features=)` at every verify step) go into the next record
the writer sends, as float16, when the sink takes them (its `features_max_bytes` > 0; the vLLM
backend and content-off sinks do not). Rows must be consecutive; a segment whose rows would pass
the budget, or leave a gap, ships none (the trainer recomputes or skips what is missing).
"""

from __future__ import annotations

import torch

from specrl.telemetry.record import SEGMENT_STEPS, SegmentRecord, StepRecord
from specrl.telemetry.sink import RecordSink


class SegmentWriter:
    def __init__(self, sink: RecordSink | None, request_id: str, prompt_ids: list[int], *,
                 deployment: str, replica: str):
        self.sink, self.request_id, self.prompt_ids = sink, request_id, prompt_ids
        self.deployment, self.replica = deployment, replica
        self.segment: SegmentRecord | None = None
        self.index = 0
        self.features_max_bytes = sink.features_max_bytes if sink is not None else 0
        self._rows: list[torch.Tensor] = []  # float16 [n_i, H] at consecutive positions from _rows_start
        self._rows_start = self._rows_end = self._rows_bytes = 0
        self._rows_lost = False  # over the budget or not consecutive: the open segment ships none

    def add(self, step: StepRecord, tokens: list[int], target_version: str, drafter_version: str,
            features: torch.Tensor | None = None) -> None:
        """One verify step and the tokens it committed (accepted drafts + the target's token);
        features [n, H]: the target's hidden states it computed, at positions step.position - 1 ..."""
        if self.segment is not None and len(self.segment.steps) >= SEGMENT_STEPS:
            self.close()
        if self.segment is None:
            self.segment = SegmentRecord(self.request_id, self.index, target_version, drafter_version,
                                         deployment=self.deployment, replica=self.replica,
                                         prompt_ids=list(self.prompt_ids) if self.index == 0 else None)
        self.segment.steps.append(step)
        self.segment.tokens.extend(tokens)
        if features is not None:
            self.add_features(step.position - 1, features)

    def add_features(self, position: int, hidden: torch.Tensor) -> None:
        """hidden [n, H] float32: the target's last hidden states at positions position .. position+n-1,
        kept (as float16) for the next record sent. Rows already kept are skipped."""
        if self.features_max_bytes <= 0 or self._rows_lost or len(hidden) == 0:
            return
        if self._rows:
            if position > self._rows_end:  # a gap: the segment's rows would not be consecutive
                self._lose_rows()
                return
            hidden, position = hidden[self._rows_end - position:], self._rows_end
            if len(hidden) == 0:
                return
        else:
            self._rows_start = position
        nbytes = 2 * hidden.numel()
        if self._rows_bytes + nbytes > self.features_max_bytes:
            self._lose_rows()
            return
        self._rows.append(hidden.to(torch.float16, copy=True))
        self._rows_end, self._rows_bytes = position + len(hidden), self._rows_bytes + nbytes

    def _lose_rows(self) -> None:
        self._rows, self._rows_bytes, self._rows_lost = [], 0, True

    def close(self, finish_reason: str | None = None) -> None:
        """Send the open segment (if any), stamped with the request's finish reason when it ended."""
        if self.segment is None:
            return
        self.segment.finish_reason = finish_reason
        if self._rows:
            self.segment.set_features(self._rows_start, torch.cat(self._rows))
        self._rows, self._rows_bytes, self._rows_lost = [], 0, False
        if self.sink is not None:
            self.sink.emit(self.segment)
        self.segment, self.index = None, self.index + 1
