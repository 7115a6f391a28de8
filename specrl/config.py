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


NON_NEGATIVE = ("threads", "max_draft_tokens", "draft_vocab_size", "unroll_steps")


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
    # A day-0 drafter's vocabulary: the first N token ids (0: the target's whole vocabulary).
    # Measured on SmolLM2: a drafter pass costs 5.4 ms with 8192 ids vs 28.5 ms with all 49,152
    # (the head is most of it), and the same held-out acceptance after the same training.
    draft_vocab_size: int = 8192
    # Versions of the weights serving at start (the weights store sets them later).
    target_version: str = "base"
    drafter_version: str = "day0"
    seed: int = 0
    # Serving.
    host: str = "127.0.0.1"
    port: int = 8000
    # Weights store root; empty: <home>/weights.
    store: str = ""
    # Admin API bearer token; empty disables the admin routes (fail closed).
    admin_token: str = ""
    # Reward events: Redis URL (empty: keep records in memory only), stream naming, content.
    redis_url: str = ""
    deployment: str = "default"
    replica: str = "0"
    telemetry_content: bool = True
    telemetry_maxlen: int = 100_000
    max_body_bytes: int = 1 << 20
    # Seconds a SIGTERM waits for in-flight requests before aborting them.
    shutdown_timeout: float = 30.0
    # Drafter trainer.
    servers: str = ""  # comma-separated replica URLs asked to swap after a publish
    objective: str = "kl"  # kl | kl_neg | pg
    lr: float = 1e-3  # measured: first-draft acceptance 0.23 vs 0.14 for 3e-4 after the same 50 steps
    # Extra training passes that feed the drafter its own predicted features (training-time test):
    # drafts after the first read the drafter's outputs, not the target's, at serving time.
    unroll_steps: int = 1
    train_records: int = 16  # records per optimizer step
    train_positions: int = 1024  # at most this many drafter positions per step
    publish_every_s: float = 60.0
    publish_every_steps: int = 50
    publish_margin: float = 0.02  # candidate tau must beat serving tau by this fraction
    heldout_fraction: float = 0.1
    eval_k: int = 4
    canary_tokens: int = 200  # drafted tokens observed before judging a new drafter live
    canary_margin: float = 0.05  # rollback when its accept rate falls this far below the previous
    consumer: str = "trainer-0"
    claim_idle_ms: int = 60_000  # another consumer's records idle this long are claimed (it died)
    trainer_metrics_port: int = 0  # > 0: the trainer serves Prometheus metrics (consumer lag) here
    checkpoint_every_steps: int = 5
    # Serving backend: "native" (specrl's engine) or "vllm" (vLLM's async engine; the [vllm] extra).
    backend: str = "native"
    # vLLM backend: KV cache size in MiB (on CPU vLLM otherwise reserves most of the machine's memory).
    vllm_kv_cache_mb: int = 1024

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
        settings = cls(**{k: _coerce(cls, k, v) for k, v in values.items()})
        for name in NON_NEGATIVE:
            if getattr(settings, name) < 0:
                raise InvalidRequestError(f"{name} must be >= 0, got {getattr(settings, name)}")
        return settings

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

    @property
    def store_path(self) -> Path:
        return Path(self.store).expanduser() if self.store else self.home / "weights"


def _coerce(cls: type, name: str, value: Any) -> Any:
    kind = {f.name: f.type for f in fields(cls)}[name]
    try:
        if kind in ("bool", bool):
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind in ("int", int):
            return int(value)
        if kind in ("float", float):
            return float(value)
        if kind in ("Path", Path):
            return Path(value).expanduser()
        return str(value)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"setting {name}={value!r} is not a valid {kind}") from None
