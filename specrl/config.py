"""Typed settings in one place.

Every knob has a default that runs on a laptop. Environment variables `SPECRL_<FIELD>`
(upper case) override defaults; CLI flags override both (`Settings.load(**flags)`).
No other module reads `os.environ`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from specrl.errors import InvalidRequestError


def _default_home() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "specrl"


@dataclass(frozen=True)
class Settings:
    # Where fetched models, converted weights and reports live.
    home: Path = field(default_factory=_default_home)
    # Model alias (see specrl.assets.MODELS) or a path to an HF safetensors directory.
    model: str = "smollm2-135m"
    # Drafter directory, "day0" (an untrained EAGLE head built from the target) or "none".
    drafter: str = "day0"
    # Torch intra-op threads. 0 keeps torch's default.
    threads: int = 0
    # Engine: KV slots (concurrent sequences), context per slot, waiting-queue bound.
    max_batch: int = 8
    max_seq_len: int = 2048
    max_waiting: int = 256
    # Prompt tokens prefilled per engine step, so a long prompt cannot stall decoding.
    prefill_chunk: int = 512
    # Speculation: the largest draft length the controller may choose (it may choose 0).
    max_draft_tokens: int = 4
    # A fixed draft length for every step (benchmarks, tests); -1 lets the controller choose.
    fixed_draft_tokens: int = -1
    # Versions of the weights serving at start (the weights store sets them later).
    target_version: str = "base"
    drafter_version: str = "day0"
    seed: int = 0

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Defaults <- SPECRL_* environment variables <- explicit overrides (None = not given)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"SPECRL_{f.name.upper()}")
            if raw is not None:
                values[f.name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise InvalidRequestError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        return cls(**{k: _coerce(cls, k, v) for k, v in values.items()})

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)


def _coerce(cls: type, name: str, value: Any) -> Any:
    kind = {f.name: f.type for f in fields(cls)}[name]
    try:
        if kind in ("int", int):
            return int(value)
        if kind in ("Path", Path):
            return Path(value).expanduser()
        return str(value)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"setting {name}={value!r} is not a valid {kind}") from None
