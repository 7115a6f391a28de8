"""`specrl bench fleet --scenarios learn`: does a fleet learn from all of its traffic?

Two runs on fresh deployments, each `minutes` of the same offered traffic (`users` clients replaying the train split
of bench adapt's prompt mix, greedy, 64 tokens): one replica, then `replicas` replicas, each deployment with one
drafter trainer actor (as `specrl up --ray`) that learns from the deployment's stream, every replica's records,
and publishes; the replicas follow `current`. After each run the trainer stops (checkpoint, acks) and this process
measures the drafter the deployment then serves (its `current`) on bench adapt's held-out prompts: the mean
acceptance length at k = 4, greedy, beside the day-0 head's (bench adapt's `Meter`). The fleet learns from all of
its traffic when its drafter's gain over day 0 matches the single replica's, on the same traffic; the records each
trainer trained on are counted beside it (the replicas' records, all of them, reach the one trainer).
"""

from __future__ import annotations

import sys
import time
import uuid

from specrl.config import Settings


def run_learning(settings: Settings, replicas: int, users: int, minutes: float) -> dict:
    """Ray must be initialized with a CPU per replica thread and one for the trainer -> {"runs": [...], ...}."""
    import torch

    from specrl.apps.bench.adapt import MIX, TRAFFIC_TOKENS, heldout_prompts
    from specrl.apps.bench.adapt_meter import FIXED_K, NEW_TOKENS, Meter
    from specrl.speculation.sampling import SamplingParams

    torch.set_num_threads(max(1, settings.threads))
    _progress(f"loading {settings.model} for the measurements")
    meter = Meter(settings)
    prompts = meter.encode(heldout_prompts(MIX, settings.seed))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    day0 = meter.fixed_k(*meter.drafter(None, None), prompts, params)
    _progress(f"day-0 head: acceptance length {day0['mean_acceptance_length_k4']:.3f} at k = {FIXED_K}")
    runs = []
    for n in sorted({1, replicas}):
        run = _run(settings, n, users, minutes, TRAFFIC_TOKENS, MIX)
        version, drafter = meter.drafter(run.pop("store"), run["drafter"])
        run.update(meter.fixed_k(version, drafter, prompts, params))
        run["gain"] = run["mean_acceptance_length_k4"] - day0["mean_acceptance_length_k4"]
        _progress(f"{n} replica(s): drafter {version}, acceptance length {run['mean_acceptance_length_k4']:.3f} "
                  f"(day 0 {day0['mean_acceptance_length_k4']:.3f}), {run['trained_records']} records trained of "
                  f"{run['requests']} requests")
        runs.append(run)
    single, fleet = runs[0], runs[-1]
    return {"minutes": minutes, "users": users, "fixed_k": FIXED_K, "heldout_prompts": len(prompts),
            "day0": day0, "runs": runs,
            "gain_fleet_over_single": fleet["gain"] / single["gain"] if single["gain"] > 0 else None}


def _run(settings: Settings, replicas: int, users: int, minutes: float, max_tokens: int, mix_weights: dict) -> dict:
    """One deployment: `replicas` replicas and a trainer actor under `minutes` of traffic -> its counts."""
    import ray

    from specrl.apps.redis_server import RedisServer
    from specrl.apps.traffic import Traffic
    from specrl.data import PromptMix
    from specrl.redis_conn import connect
    from specrl.serving.ray_replicas import run_replicas, stop_replicas
    from specrl.telemetry import events_stream
    from specrl.trainer.ray_actor import start_trainer_actor
    from specrl.weights import WeightsStore
    from specrl.weights.deployment import DeploymentVersions, control_stream, current_key

    deployment = f"bench-fleet-learn-{replicas}-{uuid.uuid4().hex[:6]}"
    redis_server = RedisServer(settings.redis_url)
    store = WeightsStore(settings.home / "bench-fleet" / deployment / "store")
    settings = settings.replace(redis_url=redis_server.url, deployment=deployment, store=str(store.root),
                                durable_store=str(store.root), follow_current=True, drafter="day0")
    trainer = None
    try:
        _progress(f"{replicas} replica(s): starting them and the trainer (deployment {deployment})")
        url = run_replicas(settings, replicas, router="prefix")
        trainer, trainer_run = start_trainer_actor(settings)
        _wait_reading(connect(redis_server.url), events_stream(deployment), trainer_run)
        traffic, started = Traffic(url, settings.model, users, max_tokens), time.monotonic()

        def tick() -> None:
            elapsed = time.monotonic() - started
            if int(elapsed) % 60 == 0:
                _progress(f"{replicas} replica(s): {elapsed / 60:.0f} of {minutes:g} min, {traffic.requests} "
                          f"requests")

        traffic.serve(PromptMix(mix_weights, split="train", seed=settings.seed), minutes * 60, tick=tick)
        trainer.stop.remote()
        trained = ray.get(trainer_run, timeout=300)
        trainer = None
        current = DeploymentVersions(store, redis_server.url, deployment).get().get("drafter")
        return {"replicas": replicas, "requests": traffic.requests, "completion_tokens": traffic.tokens,
                "failed_requests": traffic.failures, "trainer_steps": trained["steps"],
                "trained_records": trained["records"], "drafter": current[0] if current else None,
                "published": [m.version for m in store.versions("drafter")], "store": store}
    finally:
        if trainer is not None:
            ray.kill(trainer)
        stop_replicas(shutdown_ray=False)
        connect(redis_server.url).delete(events_stream(deployment), current_key(deployment), control_stream(deployment))
        redis_server.stop()


def _wait_reading(client, stream: str, trainer_run, timeout_s: float = 600.0) -> None:
    """Until the trainer reads the stream (its consumer joined the group): the traffic starts then in every run."""
    import ray

    from specrl.redis_conn import REDIS_ERRORS
    from specrl.trainer.main import GROUP

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.wait([trainer_run], timeout=0)[0]:
            ray.get(trainer_run)  # it ended: raises its error
            raise RuntimeError("the trainer ended before the traffic started")
        try:
            if client.xinfo_consumers(stream, GROUP):
                return
        except REDIS_ERRORS:  # no stream or group yet
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the trainer did not read {stream} within {timeout_s:g} s")


def _progress(message: str) -> None:
    print(f"bench fleet: learn: {message}", file=sys.stderr, flush=True)
