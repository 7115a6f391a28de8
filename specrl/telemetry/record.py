"""The event record: one per request segment (up to `SEGMENT_STEPS` verify steps).

A record holds what the trainer needs to rebuild the context and score the drafter: the
prompt ids (first segment only), the tokens committed in the segment, and per verify step the
position of its first new token, k, the draft tokens with their draft log-probs, how many were
accepted and the target's own token (`target_token`: the recovered token at the first rejection,
or the bonus token when all k drafts passed). The versions name the weights that produced it.
Each step also names its `proposer`: "head" (the learned drafter), "suffix" (the suffix
index) or "" (no draft). Encoded with msgpack; `schema` guards decoding. Older schemas are still
read: schema 1 named `target_token` `bonus`; schemas 1 and 2 had no proposer.

Invariant per step: committed tokens of the step = draft_tokens[:accepted] + [target_token].
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import msgpack

from specrl.spec.quantities import SpecCounts

SCHEMA_VERSION = 3
READABLE_SCHEMAS = (1, 2, 3)
SEGMENT_STEPS = 64


@dataclass
class StepRecord:
    position: int  # position of the step's first new token in the sequence (prompt included)
    k: int
    draft_tokens: list[int]
    draft_logprobs: list[float]
    accepted: int
    target_token: int  # the target's token after the accepted drafts: recovered, or the bonus when all k passed
    proposer: str = ""  # "head", "suffix", or "" when nothing was drafted


@dataclass
class SegmentRecord:
    request_id: str
    segment: int
    target_version: str
    drafter_version: str
    deployment: str = "default"
    replica: str = "0"
    prompt_ids: list[int] | None = None  # first segment only
    tokens: list[int] = field(default_factory=list)  # committed in this segment
    steps: list[StepRecord] = field(default_factory=list)
    finish_reason: str | None = None  # set on the request's last segment
    schema: int = SCHEMA_VERSION

    def spec_counts(self) -> SpecCounts:
        counts = SpecCounts()
        for step in self.steps:
            counts.count(step.k, step.accepted)
        return counts

    def to_msgpack(self) -> bytes:
        return msgpack.packb(asdict(self), use_bin_type=True)

    @classmethod
    def from_msgpack(cls, data: bytes) -> "SegmentRecord":
        raw = msgpack.unpackb(data, raw=False)
        if not isinstance(raw, dict) or raw.get("schema") not in READABLE_SCHEMAS:
            found = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
            raise ValueError(f"record schema {found!r} is not one of {READABLE_SCHEMAS}")
        for step in raw["steps"]:
            if raw["schema"] == 1:
                step["target_token"] = step.pop("bonus")
            if raw["schema"] < 3:  # which proposer drafted was not recorded: a drafted step was the head's
                step["proposer"] = "head" if step["k"] else ""
        raw["steps"] = [StepRecord(**s) for s in raw["steps"]]
        raw["schema"] = SCHEMA_VERSION
        return cls(**raw)
