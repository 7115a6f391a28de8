"""Read a load test's logs: locust's CSV stats, the per-request log (locustfile.py) and the
swap log (swap_driver.py) -> summaries, and the check that every response's versions agree
with the swaps.

Version periods. A successful swap of a role to V, logged with wall times `before` and
`after` around its admin call, took effect at some moment in [before, after]. So the version
serving before it was serving until `after` at the latest, and V from `before` at the
earliest: V's period is [before, the next swap's after] (the first version's starts at -inf,
the last one's ends at +inf). A request observed over [start, end] can only report V if one
of V's periods overlaps [start, end], and the versions it reports in order (its
`specrl.versions` runs, then its fingerprint) must come from periods in swap order. A
"drain" policy swap lets admitted requests finish on the old target: they were admitted
before the swap's `after`, so their period still overlaps them.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

ROLE_OF = {"target": "policy", "drafter": "drafter"}  # fingerprint field -> swap role
RUN_FIELD = {"policy": 1, "drafter": 2}  # index in a version run [first output index, target, drafter]


def read_jsonl(path: Path | str) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def locust_aggregated(csv_prefix: Path | str) -> dict:
    """The "Aggregated" row of `<prefix>_stats.csv` (locust's own totals; custom TTFT/ITL events count as requests)."""
    with open(f"{csv_prefix}_stats.csv", newline="") as fh:
        for row in csv.DictReader(fh):
            if row["Name"] == "Aggregated":
                return row
    raise ValueError(f"{csv_prefix}_stats.csv has no Aggregated row")


def locust_rows(csv_prefix: Path | str) -> list[dict]:
    with open(f"{csv_prefix}_stats.csv", newline="") as fh:
        return list(csv.DictReader(fh))


# ---- version periods ---------------------------------------------------------------------
def serving_periods(swap_log: list[dict], role: str) -> list[tuple[str, float, float]]:
    """-> [(version, earliest start, latest end)] of `role`, in swap order (see the module doc)."""
    [start] = [e for e in swap_log if e["event"] == "start"]
    periods = [(start["serving"][role], -math.inf, math.inf)]
    for e in sorted((e for e in swap_log if e["event"] == "swap" and e["role"] == role and e["status"] == 200),
                    key=lambda e: e["before"]):
        version, begin, _ = periods[-1]
        periods[-1] = (version, begin, e["after"])
        periods.append((e["version"], e["before"], math.inf))
    return periods


def _in_order(sequence: list[str], periods: list[tuple[str, float, float]], start: float, end: float) -> bool:
    """Can `sequence` (consecutive entries differ) be served by periods overlapping [start, end], in swap order?"""
    first = 0
    for version in sequence:
        match = next((i for i in range(first, len(periods))
                      if periods[i][0] == version and periods[i][1] <= end and periods[i][2] >= start), None)
        if match is None:
            return False
        first = match + 1
    return True


def _collapse(values: list[str]) -> list[str]:
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def version_problems(requests: list[dict], swap_log: list[dict]) -> list[str]:
    """Every finished request's versions against the swap log -> a list of problems (empty: consistent)."""
    periods = {role: serving_periods(swap_log, role) for role in ROLE_OF.values()}
    problems = []
    for r in requests:
        if r["status"] != "ok":
            continue
        for field, role in ROLE_OF.items():
            runs_per_choice = r.get("versions") or [[]]
            for runs in runs_per_choice:
                sequence = _collapse([run[RUN_FIELD[role]] for run in runs] + [r[field]])
                if not _in_order(sequence, periods[role], r["start"], r["end"]):
                    problems.append(f"{r['id']} [{r['start']:.3f}, {r['end']:.3f}]: {role} versions {sequence} "
                                    f"do not fit the swap periods {_show(periods[role])}")
            seen = _collapse([s[1 if role == "policy" else 2] for s in r.get("seen", [])])
            if not _in_order(seen, periods[role], r["start"], r["end"]):
                problems.append(f"{r['id']}: streamed {role} fingerprints {seen} do not fit {_show(periods[role])}")
    return problems


def _show(periods: list[tuple[str, float, float]]) -> str:
    return ", ".join(f"{v}@[{a:.3f}, {b:.3f}]" for v, a, b in periods)


# ---- summaries ---------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(requests: list[dict], swap_log: list[dict] | None = None) -> dict:
    """Throughput, latency percentiles and failures of one run; with a swap log, drafter swap visibility."""
    ok = [r for r in requests if r["status"] == "ok"]
    span = (max(r["end"] for r in ok) - min(r["start"] for r in ok)) if ok else 0.0
    tokens = sum(r.get("completion_tokens") or 0 for r in ok)
    ttft = [r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None]
    itl = [gap for r in ok for gap in r.get("itl_ms", [])]
    latency = [(r["end"] - r["start"]) * 1000 for r in ok]
    acceptance = [r["acceptance_length"] for r in ok if r.get("acceptance_length") is not None]
    summary = {
        "requests_ok": len(ok), "requests_failed": sum(r["status"] not in ("ok", "interrupted") for r in requests),
        "requests_interrupted": sum(r["status"] == "interrupted" for r in requests),
        "span_s": span, "requests_per_s": len(ok) / span if span else 0.0,
        "completion_tokens": tokens, "tokens_per_s": tokens / span if span else 0.0,
        "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99), "count": len(ttft)},
        "itl_ms": {"p50": percentile(itl, 50), "p99": percentile(itl, 99), "count": len(itl)},
        "latency_ms": {"p50": percentile(latency, 50), "p99": percentile(latency, 99)},
        "mean_acceptance_length": sum(acceptance) / len(acceptance) if acceptance else None,
        "failures": sorted({r["status"] for r in requests if r["status"] not in ("ok", "interrupted")})[:10],
    }
    if swap_log is not None:
        swaps = [e for e in swap_log if e["event"] == "swap"]
        summary["swaps"] = {"count": len(swaps), "ok": sum(e["status"] == 200 for e in swaps),
                            "swap_ms": [e["response"].get("swap_ms") for e in swaps if e["status"] == 200],
                            "load_ms": [e["response"].get("load_ms") for e in swaps if e["status"] == 200]}
        summary["drafter_visibility_ms"] = drafter_visibility(requests, swap_log)
    return summary


def drafter_visibility(requests: list[dict], swap_log: list[dict]) -> list[float | None]:
    """Per successful drafter swap: ms from its admin call to the first response chunk (stream) or
    response (non-stream) whose fingerprint shows the new drafter, before the next drafter swap;
    None when no response showed it."""
    swaps = sorted((e for e in swap_log if e["event"] == "swap" and e["role"] == "drafter" and e["status"] == 200),
                   key=lambda e: e["before"])
    sightings = sorted([(s[0], s[2]) for r in requests if r["status"] == "ok" for s in r.get("seen", [])]
                       + [(r["end"], r["drafter"]) for r in requests if r["status"] == "ok" and not r["stream"]])
    result = []
    for i, e in enumerate(swaps):
        until = swaps[i + 1]["before"] if i + 1 < len(swaps) else math.inf
        first = next((t for t, drafter in sightings if e["before"] <= t < until and drafter == e["version"]), None)
        result.append(None if first is None else (first - e["before"]) * 1000)
    return result
