"""A live server seen from outside: /metrics and /health sampled, and rates between two samples
(`specrl up`'s status line, the RL report, `bench adapt`). HTTP only."""

from __future__ import annotations

import json
import re
import time
import urllib.request

from specrl.spec.quantities import acceptance_rate, tokens_per_step

METRICS = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
           "vllm:spec_decode_num_accepted_tokens_total": "accepted", "specrl_generation_tokens_total": "tokens",
           "specrl_verify_steps_total": "steps", "specrl_decode_seconds_total": "decode_s",
           "specrl_plain_equivalent_seconds_total": "plain_s"}
BY_PROPOSER = re.compile(r'specrl_spec_decode_(num_draft_tokens|num_accepted_tokens)_total\{proposer="(\w+)"\} (\S+)')
PROPOSERS = ("head", "suffix")


def sample_metrics(url: str, started: float) -> dict | None:
    """-> the server's counters (METRICS' short names), ok requests and serving versions at `t`
    seconds since `started` (monotonic), or None when it does not answer."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            health = json.loads(resp.read())
    except OSError:
        return None
    sample = {"t": round(time.monotonic() - started, 2), "drafter": health.get("drafter_version"),
              "policy": health.get("target_version")}
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
