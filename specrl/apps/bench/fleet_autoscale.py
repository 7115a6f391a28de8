"""`specrl bench fleet --scenarios autoscale`: the replicas on Ray Serve following the load up and back down.

One deployment autoscaled between 1 and `--replicas` replicas on ongoing requests (`--max-replicas`'s policy: a
target of 2 a replica), with a short scale-down delay (SCALE_DOWN_S) so a run sees both ways. Load:
USERS_PER_REPLICA x `--replicas` clients (twice the target on the full fleet: it holds), each sending its next completion (MAX_TOKENS new tokens, greedy, EOS ignored) when the last is answered,
until Serve has run the larger fleet for STEADY_S; then calm: one client, until the fleet is back to one replica
and STEADY_S more (each phase at most PHASE_S). Every second the replicas Serve reports running; every request its
start, end, tokens and status. The timeline is cut into WINDOW_S windows (load, calm, or the one switching):
tokens/s served, requests' latency, replicas running. Reported: the seconds from the load's start to the second replica running and from the calm's
start to one; tokens/s under the same load with one replica running (after the first window) and with all of
them; requests failed (none should: a replica being removed drains first).
"""

from __future__ import annotations

import threading
import time

from specrl.apps.bench.fleet_clients import FleetClients
from specrl.config import Settings

SCALE_DOWN_S = 10.0  # Serve removes a replica after the load has wanted fewer for this long
STEADY_S = 40.0      # how long each phase goes on once the fleet has reached its size
PHASE_S = 240.0      # each phase's limit, reached or not
WINDOW_S = 5.0
MAX_TOKENS = 32
USERS_PER_REPLICA = 4


def run_autoscale(settings: Settings, max_replicas: int) -> dict:
    """Deploy (Ray must be initialized), run the load then the calm -> the timeline and its summary."""
    from specrl.serving.ray_replicas import run_replicas, stop_replicas

    users = USERS_PER_REPLICA * max_replicas
    print(f"bench fleet: autoscale: 1 replica, up to {max_replicas}, {users} users then 1", flush=True)
    url = run_replicas(settings, 1, max_replicas, router="prefix", scale_down_s=SCALE_DOWN_S)
    clients, replicas = FleetClients(url, settings.model, MAX_TOKENS), _ReplicaCount()
    try:
        replicas.start()
        started = time.monotonic()
        clients.set_users(users)
        load = _wait_for(replicas, lambda n: n >= max_replicas, "load", max_replicas)
        calm_at = time.monotonic()
        clients.set_users(1)
        calm = _wait_for(replicas, lambda n: n <= 1, "calm", 1)
        ended = time.monotonic()
    finally:
        clients.set_users(0)
        replicas.stop()
        stop_replicas(shutdown_ray=False)
    return summarize(clients.requests, replicas.samples, started, calm_at, ended, max_replicas, users,
                     {"load": load, "calm": calm})


def summarize(requests: list[tuple[float, float, int, bool]], samples: list[tuple[float, int]], started: float,
              calm_at: float, ended: float, max_replicas: int, users: int, reached: dict) -> dict:
    """requests: (start, end, completion tokens, ok) in monotonic seconds; samples: (time, replicas running) ->
    the report: windows (from `started`), phase times, tokens/s with one replica and with `max_replicas`."""
    from specrl.loadtest.report import percentile

    windows = []
    at = started
    while at < ended:
        done = [r for r in requests if at <= r[1] < at + WINDOW_S]
        running = [n for t, n in samples if at <= t < at + WINDOW_S]
        phase = "load" if at + WINDOW_S <= calm_at else "calm" if at >= calm_at else "switch"  # switch: both
        windows.append({"t": round(at - started, 1), "phase": phase,
                        "tokens_per_s": sum(r[2] for r in done if r[3]) / WINDOW_S,
                        "latency_p50_s": percentile([r[1] - r[0] for r in done if r[3]], 50) if done else None,
                        "failed": sum(not r[3] for r in done), "replicas": max(running) if running else None})
        at += WINDOW_S

    def first_time(after: float, ok) -> float | None:
        return next((round(t - after, 1) for t, n in samples if t >= after and ok(n)), None)

    def load_rate(replicas: int) -> float | None:
        rates = [w["tokens_per_s"] for w in windows[1:] if w["phase"] == "load" and w["replicas"] == replicas
                 and all(n == replicas for t, n in samples if started + w["t"] <= t < started + w["t"] + WINDOW_S)]
        return sum(rates) / len(rates) if rates else None

    one, full = load_rate(1), load_rate(max_replicas)
    return {"max_replicas": max_replicas, "users": users, "scale_down_s": SCALE_DOWN_S, "window_s": WINDOW_S,
            "max_tokens": MAX_TOKENS, "reached": reached, "windows": windows,
            "seconds_to_scale_up": first_time(started, lambda n: n >= max_replicas),
            "seconds_to_scale_down": first_time(calm_at, lambda n: n <= 1),
            "load_tokens_per_s_one_replica": one, "load_tokens_per_s_all_replicas": full,
            "all_over_one": full / one if one and full else None,
            "requests": len(requests), "failed_requests": sum(not r[3] for r in requests)}


def _wait_for(replicas: "_ReplicaCount", reached, phase: str, size: int) -> bool:
    """Until `reached(running replicas)` has held for STEADY_S (-> True) or PHASE_S went by (-> False)."""
    deadline, since = time.monotonic() + PHASE_S, None
    while time.monotonic() < deadline:
        now = time.monotonic()
        since = (since or now) if reached(replicas.running) else None
        if since is not None and now - since >= STEADY_S:
            return True
        time.sleep(0.5)
    print(f"bench fleet: autoscale: {phase}: {size} replica(s) not held for {STEADY_S:g} s within {PHASE_S:g} s",
          flush=True)
    return False


class _ReplicaCount:
    """Samples the replicas Serve reports running, once a second, printing each change."""

    def __init__(self):
        self.samples: list[tuple[float, int]] = []
        self.running = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _sample(self) -> None:
        from ray import serve

        from specrl.serving.ray_replicas import APP_NAME

        started = time.monotonic()
        while not self._stop.is_set():
            states = serve.status().applications[APP_NAME].deployments["server"].replica_states
            running = states.get("RUNNING", 0)
            if running != self.running:
                print(f"bench fleet: autoscale: t={time.monotonic() - started:5.1f}s  replicas running: {running}",
                      flush=True)
            self.running = running
            self.samples.append((time.monotonic(), running))
            self._stop.wait(1.0)
