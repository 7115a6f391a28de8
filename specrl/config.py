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


NON_NEGATIVE = ("threads", "max_draft_tokens", "draft_vocab_size", "unroll_steps", "suffix_capacity",
                "suffix_max_tokens", "record_features_max_bytes", "trainer_replay_records")


def setting(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING,
            choices: tuple[str, ...] | None = None) -> Any:
    """A settings field with its help text and allowed values (the CLI's flags are made from these)."""
    return field(default=default, default_factory=factory, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class Settings:
    # ---- where things are
    home: Path = setting(factory=_default_home, help="cache home: models, weights, runs, reports")
    model: str = setting("smollm2-135m", "model alias (smollm2-135m, tiny-random) or an HF safetensors directory")
    drafter: str = setting("pretrained", "'pretrained' (the head shipped for the model, trained offline on its "
                                         "own outputs; day0 where none ships), 'day0' (an untrained EAGLE head built "
                                         "from the target), 'none', or a drafter directory")
    store: str = setting("", "weights store root (default <home>/weights)")
    durable_store: str = setting("", "where a server pulls a version its own store lacks, after Ray's object store, "
                                     "and where trainers copy each version they publish (when it is not their "
                                     "--store): a directory or an fsspec URL (file://; s3://bucket/prefix with the "
                                     "[s3] extra, AWS credentials and endpoint from the environment) (empty: none; "
                                     "`--ray` sets it to --store, each replica then keeps its own copy)")
    threads: int = setting(0, "torch intra-op threads (0: torch's default)")
    dtype: str = setting("auto", "serving weights: float32; float16 or bfloat16 (half the bytes a decode step "
                                 "streams; activations and KV cache stay float32; bfloat16 multiplies on the CPU's "
                                 "bf16 units); int8 (1.125 bytes a weight) or q4 (Q4_1, 0.625 bytes): they change "
                                 "outputs (bench quality), native engine only. auto: bfloat16 where the CPU has "
                                 "native bf16 dot products (amx_bf16 or avx512_bf16), float16 where it has "
                                 "avx2+fma+f16c, else float32 (vLLM: bfloat16 where the CPU has native bf16 but no "
                                 "AMX, else float32)",
                         choices=("auto", "float32", "float16", "bfloat16", "int8", "q4"))
    seed: int = setting(0, "seed of the engine's own randomness and of day-0 drafters")
    # ---- engine
    max_batch: int = setting(8, "KV slots: the most sequences decoded together")
    max_seq_len: int = setting(2048, "context per sequence (prompt + output), in tokens")
    max_waiting: int = setting(256, "queued requests beyond which new ones get 429")
    prefill_chunk: int = setting(512, "prompt tokens prefilled per engine step, so a long prompt cannot stall decoding")
    # Measured on SmolLM2-135M fp32, one core: copying 1,000 positions of KV 7 ms, recomputing them 3.9 s.
    prefix_cache: bool = setting(True, "reuse the KV of finished and running sequences for prompts that start the "
                                       "same way (both backends; off: every prompt is prefilled in full)")
    max_draft_tokens: int = setting(4, "the largest draft length the controller may choose (it may choose 0)")
    fixed_draft_tokens: int = setting(-1, "draft this many tokens every step (benchmarks, tests); -1: the controller "
                                          "chooses")
    # Measured on SmolLM2: a drafter pass costs 5.4 ms with 8192 ids vs 28.5 ms with all 49,152 (the
    # head is most of it), with the same held-out acceptance after the same training.
    draft_vocab_size: int = setting(8192, "a day-0 drafter's vocabulary: the first N token ids (0: all)")
    # The suffix index: 4 bytes of tokens + 16 of hash chains per slot (1M slots: ~20 MB); measured
    # proposing for 8 sequences in 67 us (p50) at 3M slots.
    suffix_capacity: int = setting(1_000_000, "suffix index size in tokens over recent requests (0: the suffix "
                                              "proposer is off)")
    suffix_max_tokens: int = setting(16, "the longest draft the suffix index may propose")
    suffix_min_confidence: float = setting(0.1, "the suffix index stops drafting when the product of its token "
                                                "confidences falls below this")
    target_version: str = setting("base", "the policy version serving at start when the store has none")
    drafter_version: str = setting("day0", "the drafter version serving at start when the store has none")
    # ---- serving
    backend: str = setting("native", "serving backend: native (specrl's engine) or vllm (the [vllm] extra)",
                           choices=("native", "vllm"))
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    admin_token: str = setting("", "admin API bearer token; empty disables the admin routes")
    api_key: str = setting("", "API key: /v1/*, /tokenize and /detokenize then need 'Authorization: Bearer <key>'; "
                               "empty leaves them open (the admin routes keep their own token)")
    max_body_bytes: int = setting(1 << 20, "request bodies over this many bytes get 413")
    shutdown_timeout: float = setting(30.0, "seconds a SIGTERM waits for in-flight requests before aborting them")
    follow_current: bool = setting(True, "swap to the deployment's current versions whenever they move (announced on "
                                         "Redis, else read from the store), so a replica that starts late or missed "
                                         "a swap catches up by itself")
    follow_interval_s: float = setting(2.0, "read the deployment's current versions at least this often (an "
                                            "announcement on Redis wakes the replica at once)")
    vllm_kv_cache_mb: int = setting(1024, "vLLM backend: KV cache MiB (on CPU vLLM otherwise takes most of the memory)")
    # ---- reward events
    redis_url: str = setting("", "Redis URL for reward events (empty: records stay in memory)")
    deployment: str = setting("default", "deployment name: the stream {specrl:<deployment>}:events")
    replica: str = setting("0", "this server's replica name in the records")
    telemetry_content: bool = setting(True, "record token ids (off: counters only)")
    telemetry_maxlen: int = setting(100_000, "approximate stream length kept in Redis")
    # float16 hidden states: 2 * H bytes per token (1,152 for SmolLM2), against ~40 bytes of the rest of a record.
    record_features: bool = setting(True, "native engine: put the target's hidden state of every position it computed "
                                          "into the reward events (float16), so the drafter trainer need not run the "
                                          "target again (never with --no-telemetry-content or the vllm backend)")
    record_features_max_bytes: int = setting(4 << 20, "a record whose features would pass this many bytes carries "
                                                      "none (the trainer dead-letters records over it)")
    # ---- drafter trainer
    servers: str = setting("", "comma-separated replica URLs asked to swap after a publish")
    objective: str = setting("kl", "drafter objective", choices=("kl", "kl_neg", "pg"))
    # Measured: first-draft acceptance 0.23 vs 0.14 for 3e-4 after the same 50 steps.
    lr: float = setting(1e-3, "drafter learning rate (AdamW)")
    # Drafts after the first read the drafter's own outputs, not the target's, when serving.
    unroll_steps: int = setting(1, "extra passes on the drafter's own predicted features (training-time test); 0: off")
    train_records: int = setting(16, "records per optimizer step")
    train_positions: int = setting(1024, "at most this many drafter positions per optimizer step")
    # The lag from a record to a serving drafter that learned from it is about this cadence; a drafter
    # swap never changes outputs, and the canary rolls back live regressions.
    publish_every_s: float = setting(10.0, "evaluate (and maybe publish) at least this often")
    publish_every_steps: int = setting(50, "evaluate (and maybe publish) every this many optimizer steps")
    publish_margin: float = setting(0.0, "a candidate that learned from new records is published when its held-out "
                                         "tau is at least the serving drafter's times (1 + this)")
    heldout_fraction: float = setting(0.1, "fraction of requests held out for evaluation")
    eval_k: int = setting(4, "draft length of the held-out evaluation")
    canary_tokens: int = setting(200, "drafted tokens observed before judging the drafters published since the "
                                      "last verdict live")
    canary_margin: float = setting(0.05, "roll back to the last good drafter when the newer ones' live accept rate "
                                         "falls this far below its")
    consumer: str = setting("trainer-0", "stable consumer name in the stream's consumer group")
    claim_idle_ms: int = setting(60_000, "another consumer's records idle this long are claimed (it died)")
    trainer_metrics_port: int = setting(0, "serve the trainer's Prometheus metrics on this port (0: off)")
    trainer_events: str = setting("", "the trainer's progress events, JSON lines (default "
                                      "<home>/trainer/<deployment>/<consumer>.events.jsonl)")
    checkpoint_every_steps: int = setting(5, "checkpoint (then ack) every this many optimizer steps")
    trainer_recompute: bool = setting(True, "drafter trainer: recompute the target's features of records that carry "
                                            "none, with its own copy of the target, loaded on the first such record "
                                            "(off: it loads only the target's embeddings, final norm and head, skips "
                                            "those records, and exits when the stream carries no features at all)")
    trainer_max_age_s: float = setting(600.0, "drafter trainer: a record older than this (its stream entry time) "
                                              "when its turn comes is not trained but expired (acked, counted)")
    trainer_replay_records: int = setting(256, "drafter trainer: recent trained examples kept to replay when no new "
                                               "records arrive (0: no replay, it idles)")

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
        for f in fields(cls):
            choices = f.metadata.get("choices")
            if choices and getattr(settings, f.name) not in choices:
                raise InvalidRequestError(f"{f.name} must be one of {', '.join(choices)}, got {getattr(settings, f.name)!r}")
        for name in NON_NEGATIVE:
            if getattr(settings, name) < 0:
                raise InvalidRequestError(f"{name} must be >= 0, got {getattr(settings, name)}")
        return settings

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

    @property
    def store_path(self) -> Path:
        return Path(self.store).expanduser() if self.store else self.home / "weights"

    @classmethod
    def help_of(cls, name: str) -> tuple[str, str, tuple[str, ...] | None]:
        """-> (type name, help text, choices) of a setting (the CLI builds its flags from them)."""
        f = {f.name: f for f in fields(cls)}[name]
        return str(f.type), f.metadata.get("help", ""), f.metadata.get("choices")

    def with_env_redis(self, env: Mapping[str, str] | None = None) -> "Settings":
        """`specrl up`, `rl`, `bench adapt`: without --redis-url, the conventional $REDIS_URL (else they
        start an embedded server)."""
        env = os.environ if env is None else env
        return self if self.redis_url else self.replace(redis_url=env.get("REDIS_URL", ""))

    @property
    def trainer_events_path(self) -> Path:
        if self.trainer_events:
            return Path(self.trainer_events).expanduser()
        return self.home / "trainer" / self.deployment / f"{self.consumer}.events.jsonl"


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
