"""The event record: one per request segment (up to `SEGMENT_STEPS` verify steps).

A record holds what the trainer needs to rebuild the context and score the drafter: the
prompt ids (first segment only), the tokens committed in the segment, and per verify step the
position of its first new token, k, the draft tokens with their draft log-probs, how many were
accepted and the recovered/bonus token. The versions name the weights that produced it.
Encoded with msgpack; `schema` guards decoding.

Invariant per step: committed tokens of the step = draft_tokens[:accepted] + [bonus].
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import msgpack

SCHEMA_VERSION = 1
SEGMENT_STEPS = 64


@dataclass
class StepRecord:
    position: int  # position of the step's first new token in the sequence (prompt included)
    k: int
    draft_tokens: list[int]
    draft_logprobs: list[float]
    accepted: int
    bonus: int  # the recovered token, or the bonus token when all k were accepted


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

    @property
    def drafted(self) -> int:
        return sum(s.k for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    def to_msgpack(self) -> bytes:
        return msgpack.packb(asdict(self), use_bin_type=True)

    @classmethod
    def from_msgpack(cls, data: bytes) -> "SegmentRecord":
        raw = msgpack.unpackb(data, raw=False)
        if not isinstance(raw, dict) or raw.get("schema") != SCHEMA_VERSION:
            found = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
            raise ValueError(f"record schema {found!r} is not {SCHEMA_VERSION}")
        raw["steps"] = [StepRecord(**s) for s in raw["steps"]]
        return cls(**raw)
