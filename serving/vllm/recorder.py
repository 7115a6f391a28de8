"""Per-step, per-request event records from inside vLLM's model runner, in specrl's schema.

The worker extension calls `Recorder.step(scheduler_output, runner_output)` after every
sampling step: the draft tokens verified in the step are the scheduler's
`scheduled_spec_decode_tokens`, the tokens committed are the runner's `sampled_token_ids`
(accepted drafts + the target's token). The records are built by the `SegmentWriter` the native
engine uses too (one record per segment of up to `SEGMENT_STEPS` steps), into the sink
(`RedisSink`: bounded queue, drop-and-count). vLLM does not expose draft log-probs: `draft_logprobs`
stays empty.

A request's last segment is sent when the runner sees it end (max_tokens, EOS or a stop token
id), or when the scheduler reports it finished (stop strings, aborts) at the next step.
`step` never raises: a bug here must not kill the engine; it is counted in `errors`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from specrl.telemetry.record import StepRecord
from specrl.telemetry.segments import SegmentWriter

log = logging.getLogger("specrl.vllm.recorder")


def external_id(internal: str) -> str:
    """vLLM appends '-<8 random chars>' to the caller's request id; the records carry the caller's."""
    head, sep, tail = internal.rpartition("-")
    return head if sep and len(tail) == 8 else internal


@dataclass
class _Request:
    segments: SegmentWriter
    max_tokens: int
    stop_ids: frozenset[int]
    length: int  # prompt + committed tokens
    generated: int = 0
    done: bool = False


@dataclass
class Recorder:
    sink: object  # RecordSink or None (counters only)
    deployment: str = "default"
    replica: str = "0"
    target_version: str = "base"
    drafter_version: str = "none"
    requests: dict[str, _Request] = field(default_factory=dict)
    steps: int = 0
    errors: int = 0

    def step(self, scheduler_output, runner_output) -> None:
        try:
            self._step(scheduler_output, runner_output)
        except Exception:  # never into the engine
            self.errors += 1
            if self.errors <= 3:
                log.exception("event recording failed (counted; serving goes on)")

    def flush_all(self) -> None:
        """Close every open segment (at a weight swap: a segment carries one version pair)."""
        for req in self.requests.values():
            req.segments.close()

    def _step(self, sched, out) -> None:
        for new in getattr(sched, "scheduled_new_reqs", None) or []:
            sp = new.sampling_params
            prompt = list(new.prompt_token_ids or [])
            stops = set(getattr(sp, "stop_token_ids", None) or [])
            if not getattr(sp, "ignore_eos", False):
                stops |= set(getattr(sp, "all_stop_token_ids", None) or [])
            segments = SegmentWriter(self.sink, external_id(new.req_id), prompt, deployment=self.deployment,
                                     replica=self.replica)
            self.requests[new.req_id] = _Request(segments, sp.max_tokens or 1 << 30, frozenset(stops), len(prompt))
        for rid in getattr(sched, "finished_req_ids", None) or ():
            req = self.requests.pop(rid, None)
            if req is not None and not req.done:
                req.segments.close("stop")
        if out is None or not getattr(out, "req_ids", None):
            return
        drafts = getattr(sched, "scheduled_spec_decode_tokens", None) or {}
        for rid, index in out.req_id_to_index.items():
            req = self.requests.get(rid)
            tokens = list(out.sampled_token_ids[index]) if index < len(out.sampled_token_ids) else []
            if req is None or req.done or not tokens:
                continue  # unknown, already ended, or a prefill chunk that sampled nothing
            draft = [int(t) for t in drafts.get(rid, ()) if t >= 0]
            self._commit(req, draft, tokens)
        self.steps += 1

    def _commit(self, req: _Request, draft: list[int], tokens: list[int]) -> None:
        accepted = len(tokens) - 1 if draft else 0
        req.segments.add(StepRecord(req.length, len(draft), draft, [], accepted, tokens[-1]), tokens,
                         self.target_version, self.drafter_version)
        req.length += len(tokens)
        req.generated += len(tokens)
        reason = ("stop" if any(t in req.stop_ids for t in tokens) else
                  "length" if req.generated >= req.max_tokens else None)
        if reason is not None:
            req.done = True
            req.segments.close(reason)
