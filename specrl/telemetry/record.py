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
import numpy as np
import torch

from specrl.speculation.quantities import SpecCounts

SCHEMA_VERSION = 4
READABLE_SCHEMAS = (1, 2, 3, 4)
SEGMENT_STEPS = 64
FEATURE_DTYPE = "float16"  # the only feature encoding: little-endian IEEE half precision


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
    features: bytes | None = None  # target hidden states, FEATURE_DTYPE rows (see the module docstring)
    feature_start: int = 0  # position of the first row
    feature_dim: int = 0  # H: values per row
    feature_dtype: str = ""  # FEATURE_DTYPE when there are features
    schema: int = SCHEMA_VERSION

    @property
    def feature_rows(self) -> int:
        """How many positions the features cover (0 without features)."""
        return len(self.features) // (2 * self.feature_dim) if self.features and self.feature_dim > 0 else 0

    def set_features(self, start: int, rows: torch.Tensor) -> None:
        """rows [n, H] (any float dtype) at positions start..start+n-1 -> stored as float16 bytes."""
        self.features = rows.to(torch.float16).contiguous().numpy().astype("<f2", copy=False).tobytes()
        self.feature_start, self.feature_dim, self.feature_dtype = start, int(rows.shape[1]), FEATURE_DTYPE

    def feature_tensor(self) -> torch.Tensor | None:
        """-> the features [n, H] float16 (a copy), or None without any. Check `feature_problem` first."""
        if self.features is None:
            return None
        rows = np.frombuffer(self.features, dtype="<f2").reshape(-1, self.feature_dim)
        return torch.from_numpy(rows.astype(np.float16))

    def feature_problem(self, hidden_size: int | None, max_bytes: int | None) -> str | None:
        """Why this record's features cannot be used (dtype, hidden size, byte length, budget), or None.
        Whether they cover the right positions needs the context: `ContextBook.add` checks that."""
        if self.features is None:
            return None
        if self.feature_dtype != FEATURE_DTYPE:
            return f"feature_dtype {self.feature_dtype!r} is not {FEATURE_DTYPE!r}"
        if hidden_size is not None and self.feature_dim != hidden_size:
            return f"feature_dim {self.feature_dim} is not the target's hidden size {hidden_size}"
        if self.feature_dim <= 0 or len(self.features) % (2 * self.feature_dim):
            return f"{len(self.features)} feature bytes are not whole rows of {self.feature_dim} float16 values"
        if max_bytes is not None and len(self.features) > max_bytes:
            return f"{len(self.features)} feature bytes exceed the budget of {max_bytes} (record_features_max_bytes)"
        if self.feature_start < 0:
            return f"feature_start {self.feature_start} is negative"
        return None

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
