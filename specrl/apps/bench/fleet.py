"""`specrl bench fleet`: the replicas on Ray Serve (`specrl up --ray`'s serving part), routers side by side.

routing: TTFT by router. T tenants, each with its own system prompt of SYSTEM_TOKENS tokens, take turns (tenant
0, 1, ..., T-1, 0, 1, ...) asking short questions, `--users` requests at a time, streamed, 8 new tokens. Each
replica's prefix cache holds `--max-batch` contexts (one per KV slot, least recently used out:
`engine/prefix_cache.py`), so with T = 2 x max-batch tenants the replicas can hold every tenant only if each holds
its half: routed by prefix (`serving.ray_router`) a tenant's turns meet the replica that computed its system
prompt; under Serve's default (power of two choices on queue lengths) each replica sees every tenant, and a
tenant's next turn finds its prompt evicted more often than not. With T = 1 (one system prompt shared by all) both
routers hit after the first turn on each replica: the control. Each router gets fresh replicas (cold caches) on
the same Ray cluster; the first round (each tenant's first prefill) is not counted; routers alternate over
`--repeats`. The replicas' prefix counters (`vllm:prefix_cache_queries` / `_hits`, summed over replicas) are kept
per run.

publish and restart (`--scenarios`): one deployment of the replicas (prefix routing, Redis, each replica with its
own store and the bench's store as the durable one), light traffic throughout (`--users` clients, 4 new tokens
a request). publish: drafter versions published the way a trainer on Ray does (into the store, into the object
store, then the deployment's `current` on Redis), one every few seconds; for each, the seconds from the publish's
start to each replica's first record on it (the record's stream entry time: its segment ends within the few steps
of a short request, so this is an upper bound on the replica's first step on it). restart: one replica's process
is SIGKILLed; Serve starts another, which takes traffic once its follower serves `current`; the seconds from the
kill to the first record of a new replica, and on which drafter. Requests that failed in each scenario are
counted (only those in flight on the killed replica may fail).

learn (`--scenarios learn`, `--minutes`): one replica, then `--replicas` replicas, each deployment with a drafter
trainer actor, under the same traffic; the drafter each then serves measured on held-out prompts
(`specrl.apps.bench.fleet_learning`).

autoscale (`--scenarios autoscale`): one deployment autoscaled between 1 and `--replicas` replicas under a load that
rises and falls; replicas running, tokens/s and latency over time (`specrl.apps.bench.fleet_autoscale`).

Each replica computes with `--threads` threads (0: one). The Ray cluster: `--nodes 2` starts a head and a second
node with CPUs for their share of the replicas on this machine
(`ray.cluster_utils.Cluster`: separate raylets and object stores, one replica per node), `--nodes 1` one local
node.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from pathlib import Path

from specrl.apps.flags import COMMON, add_settings, settings_from
from specrl.config import Settings
from specrl.errors import InvalidRequestError

ROUTERS = ("prefix", "pow2")
SCENARIOS = ("routing", "publish", "restart", "learn", "autoscale")
TARGET = 0.5  # TTFT p50 routed by prefix over Serve's default, at most (issue 46)


def register(sub) -> None:
    p = sub.add_parser("fleet", help="replicas on Ray Serve: TTFT with long per-tenant system prompts, routed by "
                                     "prefix vs Serve's default")
    p.add_argument("--replicas", type=int, default=2, help="serving replicas (default 2)")
    p.add_argument("--nodes", type=int, default=2, help="Ray nodes started on this machine (default 2)")
    p.add_argument("--tenants", type=int, default=0, help="system prompts taking turns (default: 2 x --max-batch)")
    p.add_argument("--rounds", type=int, default=4, help="turns per tenant; the first is not counted (default 4)")
    p.add_argument("--users", type=int, default=2, help="requests in flight at once (default 2)")
    p.add_argument("--repeats", type=int, default=1, help="runs per router, alternating (default 1)")
    p.add_argument("--scenarios", default="routing", help=f"comma-separated: {', '.join(SCENARIOS)} (default routing)")
    p.add_argument("--publishes", type=int, default=5, help="publish: drafter versions published (default 5)")
    p.add_argument("--minutes", type=float, default=10.0, help="learn: traffic minutes of each run (default 10)")
    p.add_argument("--out", default=None, help="report directory (default <home>/reports/bench-fleet-<time>)")
    add_settings(p, *COMMON, "model", "max_batch", "redis_url")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    for name in ("replicas", "nodes", "rounds", "users", "repeats"):
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.minutes <= 0:
        raise InvalidRequestError(f"--minutes must be > 0, got {args.minutes:g}")
    if args.rounds < 2:
        raise InvalidRequestError("--rounds must be at least 2: the first round is not counted")
    scenarios = [s for s in args.scenarios.split(",") if s]
    if not scenarios or set(scenarios) - set(SCENARIOS):
        raise InvalidRequestError(f"--scenarios takes some of {', '.join(SCENARIOS)}; got {args.scenarios!r}")
    settings = settings_from(args).with_env_redis()
    tenants = args.tenants or 2 * settings.max_batch
    run_fleet_bench(settings, args.replicas, args.nodes, tenants, args.rounds, args.users, args.repeats, args.out,
                    scenarios=scenarios, publishes=args.publishes, minutes=args.minutes)
    return 0


def run_fleet_bench(settings: Settings, replicas: int, nodes: int, tenants: int, rounds: int, users: int,
                    repeats: int, out_dir: str | None, scenarios: list[str] = ("routing",),
                    publishes: int = 5, minutes: float = 10.0) -> dict:
    """Start the Ray cluster, run the scenarios (routing: each router `repeats` times on fresh replicas), print a
    table, write bench-fleet.json and .png -> the result."""
    from specrl.apps.bench.backends import machine_record, save_report
    from specrl.apps.bench.prefix_reuse import SYSTEM_TOKENS
    from specrl.serving.ray_replicas import run_replicas, stop_replicas

    redis_url = settings.redis_url  # publish/restart need Redis (this one, or an embedded one); routing none
    settings = settings.replace(threads=max(1, settings.threads), redis_url="", follow_current=False)
    machine = machine_record()
    cluster = _start_ray(nodes, replicas, settings.threads, trainer="learn" in scenarios)
    runs, prompts, lifecycle, learning, autoscale = [], None, None, None, None
    try:
        for repeat in range(repeats if "routing" in scenarios else 0):
            for router in ROUTERS if repeat % 2 == 0 else ROUTERS[::-1]:
                print(f"bench fleet: {router} routing, run {repeat + 1} of {repeats}: starting {replicas} replicas",
                      flush=True)
                url = run_replicas(settings, replicas, router=router)
                try:
                    prompts = prompts or _tenant_prompts(url, settings.model, tenants, SYSTEM_TOKENS)
                    runs.append({"router": router, "repeat": repeat,
                                 **_turns(url, settings.model, prompts, rounds, users, router)})
                finally:
                    stop_replicas(shutdown_ray=False)
        if {"publish", "restart"} & set(scenarios):
            from specrl.apps.bench.fleet_lifecycle import run_lifecycle

            lifecycle = run_lifecycle(settings.replace(redis_url=redis_url), replicas, users, publishes,
                                      "restart" in scenarios)
        if "learn" in scenarios:
            from specrl.apps.bench.fleet_learning import run_learning

            learning = run_learning(settings.replace(redis_url=redis_url), replicas, users, minutes)
        if "autoscale" in scenarios:
            from specrl.apps.bench.fleet_autoscale import run_autoscale

            autoscale = run_autoscale(settings, replicas)
    finally:
        _stop_ray(cluster)
    result = {"bench": "fleet", "machine": machine, "model": settings.model, "replicas": replicas, "nodes": nodes,
              "threads_per_replica": settings.threads, "max_batch": settings.max_batch, "tenants": tenants,
              "system_tokens": SYSTEM_TOKENS, "rounds": rounds, "users": users, "runs": runs,
              "ttft_p50_prefix_over_pow2": _ratio(runs), "target": TARGET, "lifecycle": lifecycle,
              "learning": learning, "autoscale": autoscale}
    result["met"] = result["ttft_p50_prefix_over_pow2"] is not None and result["ttft_p50_prefix_over_pow2"] <= TARGET
    save_report(result, "bench-fleet", out_dir, settings.home, _print_table, _plot)
    return result


def _start_ray(nodes: int, replicas: int, threads: int, trainer: bool = False):
    """-> the cluster_utils Cluster (nodes > 1) or None (one local node); either way Ray is initialized. CPUs for
    the replicas' threads, and on the head for a trainer's (`trainer`)."""
    import ray

    extra = threads if trainer else 0
    if nodes == 1:
        ray.init(address="local", num_cpus=replicas * threads + extra, include_dashboard=False, log_to_driver=False)
        return None
    from ray.cluster_utils import Cluster

    per_node = max(threads, -(-replicas // nodes) * threads)  # the replicas spread over the nodes
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": per_node + extra, "include_dashboard": False})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=per_node)
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def _stop_ray(cluster) -> None:
    import ray

    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()


def _tenant_prompts(url: str, model: str, tenants: int, tokens: int) -> list[str]:
    from specrl.apps.bench.prefix_reuse import long_text

    return [f"You answer for company {t}. " + long_text(url, model, tokens, random.Random(t)) for t in range(tenants)]


def _turns(url: str, model: str, prompts: list[str], rounds: int, users: int, label: str) -> dict:
    """Round r asks every tenant its r-th question in tenant order, `users` requests at a time -> TTFT (ms) of the
    rounds after the first, and the replicas' prefix counters over those rounds."""
    from specrl.apps.bench.prefix_reuse import TURNS, first_token_ms

    def body(tenant: int, turn: int) -> dict:
        return {"model": model, "messages": [{"role": "system", "content": prompts[tenant]},
                                             {"role": "user", "content": f"{TURNS[turn % len(TURNS)]} (turn {turn})"}],
                "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": True}

    chat = url + "/v1/chat/completions"
    ttft: list[float] = []
    before = None
    for turn in range(rounds):
        if turn == 1:
            before = _fleet_prefix_counters(url)
        queue = list(range(len(prompts)))
        lock, times = threading.Lock(), []

        def user():
            while True:
                with lock:
                    if not queue:
                        return
                    tenant = queue.pop(0)
                times.append(first_token_ms(chat, body(tenant, turn))[0])

        workers = [threading.Thread(target=user) for _ in range(users)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if turn:
            ttft += times
        print(f"bench fleet: {label}: round {turn + 1}/{rounds}, TTFT p50 {_p(times, 50):.0f} ms", flush=True)
    after = _fleet_prefix_counters(url)
    return {"ttft_ms": {"p50": _p(ttft, 50), "p90": _p(ttft, 90), "values": ttft},
            "prefix_cache_queries": after[0] - before[0], "prefix_cache_hits": after[1] - before[1]}


def _fleet_prefix_counters(url: str, tries: int = 40) -> tuple[float, float]:
    """(queries, hits) summed over the replicas: /metrics through the front reaches one replica at a time, the
    replica named on its engine-info gauge; read until every replica answered or `tries` pages."""
    import httpx

    from specrl.apps.bench.serve import prometheus_value
    from specrl.apps.scrape import info_labels

    seen: dict[str, tuple[float, float]] = {}
    for _ in range(tries):
        text = httpx.get(url + "/metrics", timeout=30).text
        replica = (info_labels(text).get("specrl_engine_info") or [{}])[0].get("replica", "?")
        seen[replica] = tuple(prometheus_value(text, f"vllm:prefix_cache_{name}_total") or 0.0
                              for name in ("queries", "hits"))
        time.sleep(0.05)
    return sum(q for q, _ in seen.values()), sum(h for _, h in seen.values())


def _p(values: list[float], q: float) -> float:
    from specrl.loadtest.report import percentile

    return percentile(values, q)


def _ratio(runs: list[dict]) -> float | None:
    """Median over repeats of each router's TTFT p50: prefix over pow2."""
    import statistics

    from specrl.apps.bench.backends import ratio

    p50 = {r: [run["ttft_ms"]["p50"] for run in runs if run["router"] == r] for r in ROUTERS}
    return ratio(statistics.median(p50["prefix"]) if p50["prefix"] else None,
                 statistics.median(p50["pow2"]) if p50["pow2"] else None)


def _print_table(result: dict) -> None:
    from specrl.apps.bench.backends import machine_line

    print(f"machine: {machine_line(result['machine'])}")
    print(f"{result['replicas']} replicas of {result['model']} on {result['nodes']} Ray node(s), "
          f"{result['threads_per_replica']} thread(s) and {result['max_batch']} KV slots each")
    if result["runs"]:
        print(f"routing: {result['tenants']} tenants x {result['system_tokens']}-token system prompts, "
              f"{result['rounds'] - 1} counted rounds, {result['users']} users")
        print(f"{'router':<7} {'run':>3} {'TTFT p50 ms':>11} {'p90 ms':>8} {'prefix hits':>11}")
        for run in result["runs"]:
            print(f"{run['router']:<7} {run['repeat'] + 1:>3} {run['ttft_ms']['p50']:>11.0f} "
                  f"{run['ttft_ms']['p90']:>8.0f} {run['prefix_cache_hits']:>5.0f}/{run['prefix_cache_queries']:<5.0f}")
        value = result["ttft_p50_prefix_over_pow2"]
        print(f"TTFT p50, prefix over pow2: {value:.2f}x (target <= {TARGET}: {'met' if result['met'] else 'NOT met'})"
              if value is not None else "TTFT p50 ratio: not measured")
    life = result.get("lifecycle")
    if life:
        publish = life["publish"]
        print(f"publish -> each replica's first record on it: p50 {publish['p50_s']} s, p90 {publish['p90_s']} s "
              f"over {len(publish['rows'])} versions x {len(life['replicas'])} replicas (target p50 <= 2 s)")
        restart = life.get("restart")
        if restart:
            print(f"restart: SIGKILL -> a new replica's first record: {restart.get('seconds_to_first_record')} s on "
                  f"drafter {restart.get('drafter')} (serves current: {restart.get('serves_current')}; target "
                  f"<= 20 s); requests failed around the kill: {restart.get('failed_requests')}"
                  if "error" not in restart else f"restart: {restart['error']}")
        print(f"requests: {life['requests']}, failed {life['failed_requests']} "
              f"({life['failed_requests_before_restart']} before the restart)")
    learning = result.get("learning")
    if learning:
        print(f"learn: {learning['minutes']:g} min of traffic per run, {learning['users']} users; acceptance length "
              f"at k = {learning['fixed_k']} on {learning['heldout_prompts']} held-out prompts, day-0 head "
              f"{learning['day0']['mean_acceptance_length_k4']:.3f}")
        print(f"{'replicas':>8} {'requests':>8} {'trained':>7} {'drafter':>8} {'accept len':>10} {'gain':>6}")
        for run in learning["runs"]:
            print(f"{run['replicas']:>8} {run['requests']:>8} {run['trained_records']:>7} {str(run['drafter']):>8} "
                  f"{run['mean_acceptance_length_k4']:>10.3f} {run['gain']:>+6.3f}")
        ratio = learning["gain_fleet_over_single"]
        print(f"gain over day 0, fleet over one replica: {ratio:.2f}x" if ratio is not None else
              "gain over day 0, fleet over one replica: the single replica's drafter did not gain")
    scaling = result.get("autoscale")
    if scaling:
        _print_autoscale(scaling)


def _print_autoscale(scaling: dict) -> None:
    def fmt(value, spec=".1f", unit=""):
        return "-" if value is None else f"{value:{spec}}{unit}"

    print(f"autoscale: 1 to {scaling['max_replicas']} replicas, {scaling['users']} users then 1, "
          f"{scaling['max_tokens']} tokens a request, scale-down delay {scaling['scale_down_s']:g} s")
    print(f"{'t s':>6} {'phase':<5} {'replicas':>8} {'tok/s':>7} {'p50 s':>6} {'failed':>6}")
    for w in scaling["windows"]:
        print(f"{w['t']:>6.0f} {w['phase']:<5} {fmt(w['replicas'], 'd'):>8} {w['tokens_per_s']:>7.1f} "
              f"{fmt(w['latency_p50_s'], '.2f'):>6} {w['failed']:>6}")
    print(f"load -> {scaling['max_replicas']} replicas running: {fmt(scaling['seconds_to_scale_up'], '.0f', ' s')}; "
          f"calm -> 1: {fmt(scaling['seconds_to_scale_down'], '.0f', ' s')}; tok/s under the load with 1 replica "
          f"{fmt(scaling['load_tokens_per_s_one_replica'])}, with {scaling['max_replicas']} "
          f"{fmt(scaling['load_tokens_per_s_all_replicas'])} ({fmt(scaling['all_over_one'], '.2f', 'x')}); "
          f"requests {scaling['requests']}, failed {scaling['failed_requests']}")


def _plot(result: dict, path: Path) -> None:
    """TTFT's distribution (CDF) per routing run; the seconds from each publish to each replica's first record."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    life, learning, scaling = result.get("lifecycle"), result.get("learning"), result.get("autoscale")
    panels = [p for p in ("routing" if result["runs"] else None, "publish" if life else None,
                          "learn" if learning else None, "autoscale" if scaling else None) if p]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(7 * max(1, len(panels)), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "routing":
            for run in result["runs"]:
                values = sorted(run["ttft_ms"]["values"])
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))],
                        label=f"{run['router']} (run {run['repeat'] + 1})",
                        color="C0" if run["router"] == "prefix" else "C1")
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel("time to first token (ms, log)")
            ax.set_ylabel("share of requests")
            ax.set_title(f"{result['replicas']} replicas on Ray Serve, {result['tenants']} tenants x "
                         f"{result['system_tokens']}-token system prompts")
        elif panel == "autoscale":
            _plot_autoscale(ax, scaling)
        elif panel == "learn":
            labels = ["day 0"] + [f"{run['replicas']} replica{'s' if run['replicas'] > 1 else ''}"
                                  for run in learning["runs"]]
            values = [learning["day0"]["mean_acceptance_length_k4"]] + [run["mean_acceptance_length_k4"]
                                                                        for run in learning["runs"]]
            ax.bar(labels, values, color=["grey"] + [f"C{i}" for i in range(len(learning["runs"]))])
            for i, value in enumerate(values):
                ax.annotate(f"{value:.2f}", (i, value), ha="center", va="bottom")
            ax.set_ylabel(f"acceptance length at k = {learning['fixed_k']} (held-out prompts)")
            ax.set_title(f"the drafter each deployment serves after {learning['minutes']:g} min of the same traffic")
        else:
            rows = life["publish"]["rows"]
            for j, replica in enumerate(life["replicas"]):
                ax.plot(range(1, len(rows) + 1), [row["seconds"].get(replica) for row in rows], "o-",
                        label=replica, color=f"C{j}")
            ax.axhline(2.0, color="grey", linestyle="--", label="target (p50)")
            ax.set_xlabel("published drafter (in order)")
            ax.set_ylabel("publish -> replica's first record on it (s)")
            ax.set_title("a publish reaching each replica")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_autoscale(ax, scaling: dict) -> None:
    """Tokens/s per window (bars, shaded where the load is on) and the replicas running (a step line, right axis)."""
    windows = scaling["windows"]
    width = scaling["window_s"]
    ax.bar([w["t"] + width / 2 for w in windows], [w["tokens_per_s"] for w in windows], width=width * 0.9,
           color=[{"load": "C0", "calm": "C2"}.get(w["phase"], "grey") for w in windows],
           label="tokens/s (blue: load, green: calm)")
    ax.set_xlabel("seconds from the load's start")
    ax.set_ylabel("tokens/s served")
    right = ax.twinx()
    counts = [w["replicas"] or 0 for w in windows]
    right.step([w["t"] for w in windows] + [windows[-1]["t"] + width], counts + counts[-1:], where="post",
               color="C3", label="replicas running")
    right.set_ylabel("replicas running", color="C3")
    right.set_ylim(0, scaling["max_replicas"] + 0.5)
    right.set_yticks(range(scaling["max_replicas"] + 1))
    ax.set_title(f"autoscaling: {scaling['users']} users, then 1 (scale-down delay {scaling['scale_down_s']:g} s)")
