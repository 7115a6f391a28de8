"""A live server (and a drafter trainer) seen from outside: /metrics and /health sampled, and rates
between two samples (`specrl up`'s status line, the RL report, `bench adapt`). HTTP only."""

from __future__ import annotations

import re
import time
import urllib.request

from specrl.speculation.quantities import acceptance_rate, tokens_per_step
from specrl.telemetry.token_use import token_yield

METRICS = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
           "vllm:spec_decode_num_accepted_tokens_total": "accepted", "specrl_generation_tokens_total": "tokens",
           "specrl_verify_steps_total": "steps", "specrl_decode_seconds_total": "decode_s",
           "specrl_plain_equivalent_seconds_total": "plain_s", "specrl_telemetry_records_sent_total": "records_sent",
           "specrl_telemetry_records_dropped_total": "records_dropped", "specrl_telemetry_records_lost_total":
           "records_lost", "specrl_telemetry_records_queued": "records_queued"}
BY_PROPOSER = re.compile(r'specrl_spec_decode_(num_draft_tokens|num_accepted_tokens)_total\{proposer="(\w+)"\} (\S+)')
PROPOSERS = ("head", "suffix")
TOKEN_USES = re.compile(r'specrl_tokens_total\{use="(\w+)"\} (\S+)')
TRAINER = {"specrl_trainer_produced_records_per_s": "produced_records_per_s",
           "specrl_trainer_produced_tokens_per_s": "produced_tokens_per_s",
           "specrl_trainer_consumed_records_per_s": "consumed_records_per_s",
           "specrl_trainer_consumed_tokens_per_s": "consumed_tokens_per_s",
           "specrl_trainer_lag_records": "lag_records", "specrl_trainer_lag_seconds": "lag_s",
           "specrl_trainer_expired_records_total": "expired", "specrl_trainer_replay_steps_total": "replays",
           "specrl_trainer_records_total": "trained_records", "specrl_trainer_steps_total": "steps"}


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()
    except OSError:
        return None


def engine_info(url: str) -> dict[str, str] | None:
    """What the server at `url` serves: its `specrl_engine_info` labels (backend, dtype and why, replica), or None."""
    text = _get(url + "/metrics")
    return next(iter(info_labels(text).get("specrl_engine_info", [])), None) if text is not None else None


def info_labels(text: str) -> dict[str, list[dict[str, str]]]:
    """A /metrics page's info gauges (`specrl_engine_info`, `specrl_weight_version_info`) -> {name: each sample's
    labels}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: [dict(sample.labels) for sample in f.samples] for f in text_string_to_metric_families(text)
            if f.name in ("specrl_engine_info", "specrl_weight_version_info")}


def token_uses(text: str) -> dict[str, float]:
    """`specrl_tokens_total{use=...}` of one /metrics page -> {use: tokens}."""
    return {m.group(1): float(m.group(2)) for m in map(TOKEN_USES.match, text.splitlines()) if m}


def sample_trainer(url: str) -> dict | None:
    """-> the drafter trainer's throughput matching (TRAINER's short names) and token uses, or None
    when its metrics port does not answer."""
    text = _get(url + "/metrics")
    if text is None:
        return None
    sample = {"uses": token_uses(text)}
    for line in text.splitlines():
        name = line.split(" ")[0]
        if name in TRAINER:
            sample[TRAINER[name]] = float(line.split()[-1])
    return sample


def yield_of(server: dict | None, trainer: dict | None) -> dict:
    """The effective-token yield (specrl/telemetry/token_use.py) over both processes' token uses
    so far: computed, useful, yield, trained_share and the uses themselves."""
    uses = {**((server or {}).get("uses") or {}), **((trainer or {}).get("uses") or {})}
    return {**token_yield(uses), "uses": uses}


def sample_metrics(url: str, started: float) -> dict | None:
    """-> the server's counters (METRICS' short names), ok requests, serving versions and replica name at `t`
    seconds since `started` (monotonic), or None when it does not answer. All from one /metrics page: behind a
    proxy (Ray Serve) two requests may reach two replicas."""
    text = _get(url + "/metrics")
    if text is None:
        return None
    info = info_labels(text)
    versions = {labels["role"]: labels["version"] for labels in info.get("specrl_weight_version_info", [])}
    engine = next(iter(info.get("specrl_engine_info", [])), {})
    sample = {"t": round(time.monotonic() - started, 2), "drafter": versions.get("drafter"),
              "policy": versions.get("policy"), "replica": engine.get("replica"), "uses": token_uses(text)}
    for line in text.splitlines():
        name = line.split(" ")[0]
        if name in METRICS:
            sample[METRICS[name]] = float(line.split()[-1])
        match = re.match(r'specrl_requests_total\{.*status="ok"\} (\S+)', line)
        if match:
            sample["requests"] = sample.get("requests", 0.0) + float(match.group(1))
        match = BY_PROPOSER.match(line)
        if match:  # e.g. "suffix_draft_tokens", "head_accepted"
            name = "draft_tokens" if match.group(1) == "num_draft_tokens" else "accepted"
            sample[f"{match.group(2)}_{name}"] = float(match.group(3))
    return sample


def rates(before: dict, after: dict) -> dict:
    """Per-second rates and spec-decode quantities over the interval between two samples."""
    dt = max(after["t"] - before["t"], 1e-9)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    out = {"tokens_per_s": delta("tokens") / dt, "requests_per_s": delta("requests") / dt,
           "tokens_per_step": tokens_per_step(delta("accepted"), delta("steps")),
           "acceptance_rate": acceptance_rate(delta("accepted"), delta("draft_tokens")),
           # plain-equivalent over actual decode time: the engine's live estimate of its speed-up
           "speedup": delta("plain_s") / delta("decode_s") if delta("decode_s") > 0 else None,
           "swap": after["drafter"] != before["drafter"] or after["policy"] != before["policy"]}
    for proposer in PROPOSERS:
        out[f"{proposer}_acceptance_rate"] = acceptance_rate(delta(f"{proposer}_accepted"),
                                                             delta(f"{proposer}_draft_tokens"))
        out[f"{proposer}_draft_tokens_per_s"] = delta(f"{proposer}_draft_tokens") / dt
    return out
