"""Hot-swap weights on a live `specrl serve` at a fixed rate, and log every swap. HTTP only: the
versions to swap between must already be in the server's weights store (the bench or test that
runs this publishes them: `specrl.apps.bench.swap_versions.prepare_versions`).

    python -m specrl.loadtest.swap_driver --url http://127.0.0.1:8000 --token $SPECRL_ADMIN_TOKEN \
        --duration 20 --log swaps.jsonl

`run_swaps` calls POST /admin/weights every `interval_s` seconds, cycling through the roles
(drafter, policy, drafter, ...) and, for policy swaps, through the modes (drain, interrupt, ...),
always to a version of the role that is not the one serving. Without explicit versions the
driver cycles through every version the store holds (GET /admin/weights).

The log (JSON lines, flushed per line) starts with {"event": "start", "time", "serving"}
(the versions serving before the first swap, from /health) and has one line per swap:
{"event": "swap", "before", "after" (wall clock around the admin call), "role", "version",
"mode", "status" (HTTP status, 0 when the call itself failed), "response"}.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx

SWAP_TIMEOUT_S = 120.0


def stored_versions(url: str, token: str) -> dict[str, list[str]]:
    """-> {"drafter": [...], "policy": [...]}: every version the server's store holds, oldest first."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        resp = client.get("/admin/weights")
        resp.raise_for_status()
        return {role: [m["version"] for m in manifests] for role, manifests in resp.json()["stored"].items()}


def run_swaps(url: str, token: str, versions: dict[str, list[str]], *, roles=("drafter", "policy"),
              modes=("drain", "interrupt"), interval_s: float = 2.0, duration_s: float = 20.0,
              log_path: Path | str | None = None, stop: threading.Event | None = None) -> list[dict]:
    """Swap every `interval_s` seconds (the first after one interval) until `duration_s` has
    passed or `stop` is set; -> the log entries (also appended to `log_path` when given).
    With no `roles` it only logs the start entry and returns."""
    stop = stop or threading.Event()
    headers = {"Authorization": f"Bearer {token}"}
    log = open(log_path, "a", buffering=1) if log_path else None
    entries: list[dict] = []

    def write(entry: dict) -> None:
        entries.append(entry)
        if log:
            log.write(json.dumps(entry) + "\n")
            log.flush()

    try:
        with httpx.Client(base_url=url, headers=headers, timeout=SWAP_TIMEOUT_S) as client:
            health = client.get("/health").json()
            serving = {"policy": health["target_version"], "drafter": health["drafter_version"]}
            write({"event": "start", "time": time.time(), "serving": dict(serving)})
            if not roles:  # nothing to swap: the log only records what serves
                return entries
            started, count, policy_swaps = time.monotonic(), 0, 0
            while not stop.wait(max(0.0, started + (count + 1) * interval_s - time.monotonic())):
                if time.monotonic() - started > duration_s:
                    break
                role = roles[count % len(roles)]
                mode = modes[policy_swaps % len(modes)] if role == "policy" else "drain"
                policy_swaps += role == "policy"
                version = _next_version(versions[role], serving[role])
                entry = swap(client, role, version, mode)
                if entry["status"] == 200:
                    serving[role] = version
                write(entry)
                count += 1
    finally:
        if log:
            log.close()
    return entries


def _next_version(cycle: list[str], serving: str) -> str:
    """The version after `serving` in `cycle` (the first when `serving` is not in it)."""
    return cycle[(cycle.index(serving) + 1) % len(cycle)] if serving in cycle else cycle[0]


def swap(client: httpx.Client, role: str, version: str, mode: str) -> dict:
    """One POST /admin/weights -> a swap log entry."""
    entry = {"event": "swap", "role": role, "version": version, "mode": mode, "before": time.time()}
    try:
        resp = client.post("/admin/weights", json={"role": role, "version": version, "mode": mode})
        entry["status"] = resp.status_code
        try:
            entry["response"] = resp.json()
        except ValueError:
            entry["response"] = resp.text[:500]
    except httpx.HTTPError as exc:
        entry["status"], entry["response"] = 0, f"{type(exc).__name__}: {exc}"
    entry["after"] = time.time()
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", required=True, help="the server's SPECRL_ADMIN_TOKEN")
    parser.add_argument("--drafters", default=None, help="comma-separated drafter versions (default: all stored)")
    parser.add_argument("--policies", default=None, help="comma-separated policy versions (default: all stored)")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--roles", default="drafter,policy")
    parser.add_argument("--modes", default="drain,interrupt")
    parser.add_argument("--log", default="swaps.jsonl")
    args = parser.parse_args(argv)
    versions = stored_versions(args.url, args.token)
    for role, given in (("drafter", args.drafters), ("policy", args.policies)):
        if given:
            versions[role] = given.split(",")
    entries = run_swaps(args.url, args.token, versions, roles=tuple(args.roles.split(",")),
                        modes=tuple(args.modes.split(",")), interval_s=args.interval, duration_s=args.duration,
                        log_path=args.log)
    swaps = [e for e in entries if e["event"] == "swap"]
    ok = sum(e["status"] == 200 for e in swaps)
    print(f"swaps={len(swaps)} ok={ok} log={args.log}", file=sys.stderr)
    return 0 if ok == len(swaps) else 1


if __name__ == "__main__":
    sys.exit(main())
