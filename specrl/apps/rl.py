"""`specrl rl`: the policy RL loop, Generator -> Environment -> Trainer, with the drafter following.

    server (the Generator; speculative decoding, events to Redis)   drafter trainer (follows the policy)
        ^ rollouts: n samples per task, log-probs, per-token versions          ^ events
        |                                                                      |
    rollout thread -> scoring pool (Environment) -> queue -> GRPO step -> publish policy -> swap (interrupt)

Rollouts are produced continuously in a background thread while the policy trains (asynchronous,
as in slime), so a rollout can be one or more versions behind: the staleness bound in GRPO drops
what is too old. The rollout thread hands each sampled group to a bounded pool of scoring worker
processes (`ScorePool`) and goes on sampling; GRPO takes scored groups (`RolloutPipeline`, whose
per-stage rates and waits are in the report). The environment is any `--env` spec `make_env`
resolves, a user's `package.module:Class` included; it is resolved, and its first tasks drawn,
before any process starts. Every `eval_every` steps the serving policy answers held-out tasks
greedily and the environment scores them: the reward curve over policy versions. Rollouts pause while an
evaluation runs, so the server's counters over that stretch hold evaluation tokens only and the
acceptance measured on rollouts is not mixed with greedy answers.

The report (`rl_report`): reward per policy version; acceptance length over time from /metrics
samples (every `sample_every_s`, and right before and after each swap), with the rollout tokens
each policy swap took to bring it back within 10% of its pre-swap value; and, at the end, rollout
tokens/s with and without speculation on the final policy (`_measure_speed`).

With `--ray [ADDRESS]` the roles run on Ray (`ray_fleet.Fleet`): the server as replicas on Ray Serve, the drafter
trainer, GRPO, the rollout worker and the scoring workers as actors; this process stays the single controller (the
loop below is the same; the trainer, rollout client and pool are the actors' proxies).

Each deployment has its own weights store (`<home>/rl/<deployment>/weights` unless --store), so
policies trained by one run never reach another. Restart: run it again with the same --deployment.
The server serves the store's current policy and drafter, the drafter trainer resumes from its
own checkpoint and pending records, and the policy trainer from its checkpoint
(`grpo.GRPOTrainer`: written at every publish).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis
import torch

from specrl.apps.flags import COMMON, add_settings, settings_from
from specrl.apps.launch import running_server, shared_threads, spawn, start_server, terminate
from specrl.apps.ray_fleet import Fleet
from specrl.apps.redis_server import RedisServer
from specrl.apps.rl_report import acceptance_recovery, recovery_summary, write_report
from specrl.apps.scrape import rates, sample_metrics
from specrl.assets import resolve_model
from specrl.config import Settings
from specrl.errors import SpecrlError
from specrl.redis_conn import connect
from specrl.telemetry.event_log import EventLog, read_events
from specrl.telemetry.redis_sink import events_stream
from specrl.trainer.envs import ENV_HELP, ScorePool, env_max_tokens, env_timeout_s, make_env, take_tasks
from specrl.trainer.grpo import GRPOConfig, GRPOTrainer
from specrl.trainer.publisher import post_swap
from specrl.trainer.rollout import TEMPERATURE, RolloutClient, RolloutPipeline, mean_and_ci, task_messages
from specrl.weights import WeightsStore

log = logging.getLogger("specrl.apps.rl")
# The drafter trainer takes the cycles rollouts and GRPO leave: on 2 cores three busy processes at equal
# priority gave each ~2/3 of a core, and the policy's steps per minute are what the run is for.
DRAFTER_TRAINER_NICE = 10
POLICY_SWAP_RETRIES = 7  # 0.5 s doubling: ~30 s for a drafter swap in flight to land
SPEED_METHOD = ("final policy; the live server (drafter and suffix index, adaptive k) vs a second server on the same "
                "store with --drafter none --suffix-capacity 0 (plain decoding; its records to a stream of its own); the same held-out tasks sent as "
                "rollouts are (one request at a time, n samples, same max_tokens and temperature, no seed), one "
                "warm-up each, rounds in alternating order; tokens/s = completion tokens / summed request time")


def register(sub) -> None:
    p = sub.add_parser("rl", help="policy RL: rollouts, scoring, GRPO, hot swaps; writes a report")
    add_env_flags(p)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--group-size", type=int, default=4, help="samples per task (GRPO group)")
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--publish-every", type=int, default=2, help="GRPO steps per published policy")
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--eval-tasks", type=int, default=24)
    p.add_argument("--final-eval-tasks", type=int, default=256,
                   help="at the end, base and the last published policy on this many held-out tasks, paired "
                        "(`specrl eval-policy`; 0: skip)")
    p.add_argument("--policy-lr", type=float, default=2e-6)
    p.add_argument("--max-lag", type=int, default=1, help="staleness bound in policy versions")
    p.add_argument("--policy-compute", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="GRPO's forward and backward: bfloat16 autocast (float32 weights and optimizer) or float32; "
                        "auto: bfloat16 where the CPU has native bf16 dot products")
    p.add_argument("--out", default=None, help="run directory (default <home>/runs/rl-<env>-<time>)")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run the roles on Ray: the server as replicas on Ray Serve behind its proxy on --port, the "
                        "drafter trainer, GRPO, a rollout worker and the scoring workers as Ray actors (a local Ray "
                        "cluster, or join ADDRESS; needs the [ray] extra)")
    p.add_argument("--replicas", type=int, default=1, help="with --ray: serving replicas")
    add_settings(p, *COMMON, "redis_url", "port", "model", "deployment", "durable_store")
    p.set_defaults(run=run)


def add_env_flags(p) -> None:
    """--env and the flags that follow it (shared with eval-policy)."""
    p.add_argument("--env", default="humaneval", help=f"the environment (default humaneval): {ENV_HELP}")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="completion tokens per sample (default: the environment's max_tokens, else 64)")
    p.add_argument("--score-workers", type=int, default=4, help="scoring worker processes")
    p.add_argument("--score-timeout", type=float, default=None,
                   help="seconds one score may take before it is cut and scores 0 (default: the environment's "
                        "timeout_s, else 10)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    fleet = Fleet.check(args.ray, args.replicas, 0, trainers=2) if args.ray else None  # drafter trainer + GRPO
    run_rl(settings_from(args).with_env_redis(), env_name=args.env, minutes=args.minutes, group_size=args.group_size,
           tasks_per_step=args.tasks_per_step, publish_every=args.publish_every, eval_every=args.eval_every,
           eval_tasks=args.eval_tasks, final_eval_tasks=args.final_eval_tasks, max_tokens=args.max_tokens,
           config=GRPOConfig(lr=args.policy_lr, max_lag=args.max_lag, compute=args.policy_compute), out_dir=args.out,
           score_workers=args.score_workers, score_timeout_s=args.score_timeout, fleet=fleet)
    return 0


def run_rl(settings: Settings, *, env_name: str, minutes: float, group_size: int = 4, tasks_per_step: int = 4,
           publish_every: int = 2, eval_every: int = 4, eval_tasks: int = 24, final_eval_tasks: int = 0,
           max_tokens: int | None = None,
           config: GRPOConfig | None = None, out_dir: str | None = None, window_tokens: int = 256,
           sample_every_s: float = 1.0, speed_tasks: int = 8, speed_rounds: int = 5, score_workers: int = 4,
           score_timeout_s: float | None = None, fleet: Fleet | None = None) -> dict:
    """`env_name`: a `make_env` spec; `max_tokens`, `score_timeout_s`: None for the environment's own;
    `window_tokens`: the acceptance window of the recovery measure (`rl_report.acceptance_recovery`);
    `speed_tasks` x `speed_rounds`: the rollout speed measurement at the end (`_measure_speed`); `fleet`: the
    roles on Ray (`specrl.apps.ray_fleet`), else child processes and threads of this one."""
    cache_dir = settings.home / "cache"
    env = make_env(env_name, cache_dir=cache_dir)  # a spec that does not resolve: one line, before any process
    heldout = take_tasks(env, env_name, "heldout", settings.seed, max(eval_tasks, speed_tasks))
    take_tasks(env, env_name, "train", settings.seed, 1)
    max_tokens = max_tokens or env_max_tokens(env)
    timeout_s = score_timeout_s or env_timeout_s(env)
    tag = env_name.replace(":", "-").replace("/", "-")
    run_dir = Path(out_dir) if out_dir else settings.home / "runs" / time.strftime(f"rl-{tag}-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(settings.model, settings.home)
    settings = with_deployment_store(settings)
    store = _resumable_store(settings)
    redis_server = RedisServer(settings.redis_url)
    token, url = settings.admin_token or secrets.token_hex(16), f"http://{settings.host}:{settings.port}"
    env_vars = {**os.environ, "SPECRL_ADMIN_TOKEN": token, "SPECRL_HOME": str(settings.home)}
    # The server, the drafter trainer and GRPO (this process) compute at once: the cores split three ways.
    threads = fleet.threads(settings) if fleet else shared_threads(settings.threads, 3)
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    common = ["--model", settings.model, "--redis-url", redis_server.url, "--deployment", settings.deployment,
              "--store", str(settings.store_path), "--threads", str(threads)]
    children, stop, pause, failed, pool = [], threading.Event(), _Pause(), [], None
    report = {"command": sys.argv, "env": env_name, "model": settings.model, "max_tokens": max_tokens,
              "heldout_tasks": len(heldout), "steps": [], "evals": [], "samples": [], "publishes": [],
              "ray": None if fleet is None else {"address": fleet.address or "local", "replicas": fleet.replicas}}
    events = EventLog(run_dir / "rl-events.jsonl")  # grpo_step, eval, policy_swap: what reports read
    try:
        if fleet is None:
            pool = ScorePool(env_name, workers=score_workers, timeout_s=timeout_s, cache_dir=cache_dir)
            _start_children(children, settings, common, env_vars, url, run_dir)
            trainer = GRPOTrainer(model_dir, config or GRPOConfig(), state_path=policy_state_path(settings),
                                  store=store)
        else:
            pool = fleet.score_pool(env_name, workers=score_workers, timeout_s=timeout_s, cache_dir=cache_dir)
            url = _start_fleet(fleet, settings.replace(admin_token=token, redis_url=redis_server.url), run_dir)
            trainer = fleet.policy_trainer(settings, model_dir, config or GRPOConfig(), policy_state_path(settings),
                                           store)
        if trainer.version != (store.current("policy") or trainer.published[0]):  # resumed past the served one
            _, error = _swap_policy(url, token, trainer.version)
            if error is not None:
                raise SpecrlError(f"the server did not take the resumed policy {trainer.version}: {error}")
        client = RolloutClient(url, settings.model, n=group_size, max_tokens=max_tokens)  # evaluations, here
        rollouts = (fleet.rollout_client(url, settings.model, n=group_size, max_tokens=max_tokens)
                    if fleet else client)
        pipeline = RolloutPipeline(pool, max_scoring=2 * tasks_per_step, max_scored=2 * tasks_per_step)
        started, started_wall = time.monotonic(), time.time()
        samples = _Samples(url, started, report["samples"])
        producer = threading.Thread(target=_produce, args=(env, rollouts, pipeline, stop, pause, settings.seed,
                                                           failed), daemon=True)
        sampler = threading.Thread(target=samples.run, args=(stop, sample_every_s), daemon=True)
        producer.start()
        sampler.start()

        def evaluate() -> dict:  # rollouts held back: the interval holds evaluation tokens only
            with pause, samples.evaluation():
                result = _evaluate(pool, client, heldout[:eval_tasks], trainer.version, started)
            events.write("eval", **result)
            return result

        report["evals"].append(evaluate())
        pipeline.start()  # the stages' clocks start with training
        deadline = started + minutes * 60
        while not failed and all(c.poll() is None for c in children) and not (fleet and fleet.trainer_ended()):
            batch = pipeline.take(tasks_per_step, deadline)
            if batch is None:
                break
            began = time.monotonic()
            trained = _grpo_step(trainer, batch, started, report, events)
            if trained and trainer.steps % publish_every == 0:
                _publish(trainer, store, url, token, report, started, samples, events)
            pipeline.trained(time.monotonic() - began)
            if trained and trainer.steps % eval_every == 0:
                report["evals"].append(evaluate())
        report["pipeline"] = pipeline.stats()
        if failed:
            raise SpecrlError(f"the rollout thread failed: {failed[0]}")
        report["evals"].append(evaluate())
        report["rollout_tokens_per_s"] = rollouts.tokens / rollouts.seconds if rollouts.seconds else None
        stop.set()
        pipeline.stop()
        producer.join()  # the rollout in flight finishes; no other starts
        sampler.join()
        if fleet is None:  # the drafter trainer: nothing but the measured requests runs from here
            terminate(children[1])
        else:
            fleet.stop_trainer()
        report["speed"] = _measure_speed(settings, common, redis_server.url, env_vars, run_dir, url,
                                         heldout[:speed_tasks], n=group_size, max_tokens=max_tokens,
                                         rounds=speed_rounds)
    finally:
        stop.set()
        if pool is not None:
            pool.close()
        for child in reversed(children):
            terminate(child)
        if fleet is not None:
            fleet.stop()  # the replicas, the trainer, and with Ray the actors
        redis_server.stop()
        torch.set_num_threads(caller_threads)
    report["final_eval"] = _final_evaluation(settings, env_name, trainer.version, final_eval_tasks, max_tokens,
                                             run_dir, score_workers, score_timeout_s)
    report["drafter_evaluations"] = drafter_evaluations(run_dir / "drafter-events.jsonl", started_wall)
    report["recovery"] = recovery_summary(acceptance_recovery(report["samples"], window_tokens=window_tokens),
                                          window_tokens=window_tokens)
    write_report(run_dir, report)
    return report


def _final_evaluation(settings: Settings, env_name: str, version: str, tasks: int, max_tokens: int, run_dir: Path,
                      score_workers: int, score_timeout_s: float | None) -> dict | None:
    """Base and the last published policy on `tasks` held-out tasks, paired, each through a server of its own
    (`eval-policy`), once the loop's processes are gone -> the paired numbers (None when skipped)."""
    if tasks <= 0 or version == "base":
        return None if tasks <= 0 else {"skipped": "no policy was published"}
    from specrl.apps.eval_policy import evaluate_policies   # eval_policy imports this module's flags

    print(f"specrl rl: final evaluation: base and {version} on {tasks} held-out tasks", file=sys.stderr, flush=True)
    result = evaluate_policies(settings, env_name, ["base", version], tasks, max_tokens, run_dir / "final-eval.json",
                               score_workers=score_workers, score_timeout_s=score_timeout_s)
    trained = result["versions"][version]
    summary = {"policy": version, "tasks": result["tasks"], "report": str(run_dir / "final-eval.json"),
               "reward": {"base": result["versions"]["base"]["reward"], "trained": trained["reward"],
                          "diff": trained["vs_first"], "ci95": trained["vs_first_ci95"]}}
    for metric, entry in (result.get("env_metrics") or {}).get(version, {}).items():
        if isinstance(entry, dict) and "vs_first" in entry:
            paired = entry["vs_first"]
            summary[metric] = {"base": paired["first"], "trained": paired["second"], "diff": paired["diff"],
                               "ci95": paired["ci95"], "p_value": paired["p_value"]}
    return summary


def _start_children(children: list, settings: Settings, common: list[str], env_vars: dict, url: str,
                    run_dir: Path) -> None:
    """The server (waited for until healthy), then the drafter trainer (at a lower CPU priority), appended to
    `children` as they start."""
    server, _ = start_server(common, env_vars, run_dir / "server.log", host=settings.host, port=settings.port)
    children.append(server)
    children.append(spawn(["train-drafter", *common, "--server", url,
                           "--trainer-events", str(run_dir / "drafter-events.jsonl")], env_vars,
                          run_dir / "drafter-trainer.log", nice=DRAFTER_TRAINER_NICE))


def _start_fleet(fleet: Fleet, settings: Settings, run_dir: Path) -> str:
    """The replicas on Ray Serve (waited for until Serve runs them all), then the drafter trainer actor pushing to
    their proxy -> the proxy's URL."""
    print(f"specrl rl: starting {fleet.replicas} replica(s) on Ray Serve", file=sys.stderr, flush=True)
    url = fleet.start(settings)
    fleet.start_trainer(settings.replace(servers=url, trainer_events=str(run_dir / "drafter-events.jsonl")))
    return url


def _resumable_store(settings: Settings) -> WeightsStore:
    """The deployment's store, refused when it serves a policy GRPO has no checkpoint of."""
    store = WeightsStore(settings.store_path)
    if store.current("policy") is not None and not policy_state_path(settings).is_file():
        raise SpecrlError(f"the weights store {store.root} already serves policy {store.current('policy')}, but "
                          f"{policy_state_path(settings)} does not exist: GRPO would start from the base model "
                          "behind it; use a fresh --store, or the --deployment that trained it")
    return store


def _swap_policy(url: str, token: str, version: str) -> tuple[dict | None, str | None]:
    """-> (the server's answer, None) or (None, the error). The drafter trainer swaps the same
    server: a 409 (its swap in flight) is waited out."""
    return post_swap(url, token, {"role": "policy", "version": version, "mode": "interrupt"},
                     retries=POLICY_SWAP_RETRIES, timeout_s=300.0)


def _grpo_step(trainer: GRPOTrainer, batch: list, started: float, report: dict, events: EventLog) -> bool:
    """One GRPO step on `batch`, recorded in the report and the event file. -> whether it trained."""
    stats = trainer.step(batch)
    entry = {"t": round(time.monotonic() - started, 1), "step": trainer.steps, "policy": trainer.version,
             **{k: v for k, v in stats.__dict__.items() if k != "versions"}}
    report["steps"].append(entry)
    events.write("grpo_step", **entry)
    log.info("event=grpo_step %s", " ".join(f"{k}={v}" for k, v in entry.items()))
    return bool(stats.trained)


def drafter_evaluations(events: Path, started_wall: float) -> list[dict]:
    """The drafter trainer's periodic evaluations: exact greedy tokens per step (k = 4) of the
    serving drafter and of its candidate on held-out records, by seconds since the run started.
    Unlike the served acceptance, this does not depend on how often the controller drafts."""
    return [{"t": round(e["time"] - started_wall, 1), "serving_tau": e.get("serving_tau"),
             "candidate_tau": e.get("candidate_tau"), "records": e.get("records", 0)}
            for e in read_events(events, "evaluate", since=started_wall)]


def deployment_dir(settings: Settings) -> Path:
    """What `specrl rl` keeps per deployment: its weights store (unless --store) and GRPO's checkpoint."""
    return settings.home / "rl" / settings.deployment


def with_deployment_store(settings: Settings) -> Settings:
    """Without --store, the deployment's own store: a policy trained here never leaks into another one."""
    return settings if settings.store else settings.replace(store=str(deployment_dir(settings) / "weights"))


def policy_state_path(settings: Settings) -> Path:
    """The policy trainer's checkpoint: `specrl rl` again with the same --deployment resumes from it
    (and the server from the store's current policy)."""
    return deployment_dir(settings) / "grpo.pt"


class _Pause:
    """The main thread holds rollouts back (evaluations, the end of the run) with `with pause:`,
    which waits for the rollout in flight; the producer starts none until the block ends."""

    def __init__(self):
        self.requested = threading.Event()
        self.busy = threading.Lock()

    def __enter__(self):
        self.requested.set()
        self.busy.acquire()

    def __exit__(self, *exc):
        self.busy.release()
        self.requested.clear()

    def rollout(self, stop: threading.Event) -> threading.Lock:
        """The producer's side: hold this while one rollout request runs."""
        while self.requested.is_set() and not stop.is_set():
            stop.wait(0.05)
        return self.busy


class _Samples:
    """/metrics samples every `every_s` on a thread, and one before and after each swap and
    evaluation (`take`), appended to `items` with rates since the previous one. `eval: True`
    marks an interval during which only evaluation requests ran."""

    def __init__(self, url: str, started: float, items: list[dict]):
        self.url, self.started, self.items = url, started, items
        self.lock = threading.Lock()
        self.evaluating = False

    def take(self, evaluation: bool = False) -> None:
        with self.lock:
            sample = sample_metrics(self.url, self.started)
            if sample is None:
                return
            sample["eval"] = evaluation or self.evaluating  # read after the scrape: see `evaluation`
            # behind Ray Serve's proxy a scrape reaches any replica: rates compare a replica with itself
            before = next((s for s in reversed(self.items) if s.get("replica") == sample.get("replica")), None)
            if before is not None:
                sample.update(rates(before, sample))
            self.items.append(sample)

    @contextlib.contextmanager
    def evaluation(self):
        """Samples at both ends; the flag is set before the first evaluation request and cleared after the last."""
        self.take()
        self.evaluating = True
        try:
            yield
        finally:
            self.take(evaluation=True)
            self.evaluating = False

    def run(self, stop: threading.Event, every_s: float) -> None:
        while not stop.wait(every_s):
            self.take()


def _measure_speed(settings: Settings, flags: list[str], redis_url: str, env_vars: dict, run_dir: Path, url: str,
                   tasks: list, *, n: int, max_tokens: int, rounds: int) -> dict:
    """Rollout tokens/s with and without speculation, side by side, on the final policy.

    Method: after training has stopped (no rollouts, no evaluations, the drafter trainer ended), a
    second server starts on the same weights store with `--drafter none --suffix-capacity 0`, so
    it serves the same current policy with no proposer at all (the plain k = 0 decode path; not a
    switch inside the speculating server, which would still carry the drafter's bookkeeping and
    would set k for the whole batch). Both get the same held-out tasks the way training rollouts
    are sent: one request at a time, n samples each, the same max_tokens, temperature and
    log-prob/token-id options, and no seed. (Fixed seeds, as this measurement once used, repeat
    the same texts every round: the live server's suffix index then recalls round 1 in round 2,
    which no training epoch sees; and seeded rows take the coupled rule, under which the head
    accepts less than training's unseeded rollouts.) Each server answers one untimed warm-up
    request; then rounds alternate the order (A B, B A, ...) so drift in machine load falls on
    both. tokens/s = completion tokens / summed request wall time (sampled completions differ in
    length; the rate accounts for it); `ratio` is the totals', `ratio_median` the median over rounds
    of each round's ratio (two rounds of the same engines drifted 277 -> 345 tok/s on one machine).
    Both servers send their records to Redis, the second under a deployment of its own (its
    stream deleted at the end) so that it feeds neither the live server's suffix index nor a
    trainer: telemetry costs a server ~5% of its rollout tokens/s on 2 cores (four servers side by
    side, AVX-512 EPYC), and a second server without it once credited speculation with that 5% as
    a loss.
    """
    plain_deployment = f"{settings.deployment}-no-speculation"
    plain_flags = [*flags, "--deployment", plain_deployment, "--drafter", "none", "--suffix-capacity", "0"]
    messages = [task_messages(task) for task in tasks]
    try:
        with running_server(plain_flags, env_vars, run_dir / "server-no-speculation.log",
                            host=settings.host) as plain_url:
            urls = {"with_speculation": url, "without_speculation": plain_url}
            clients = {name: RolloutClient(u, settings.model, n=n, max_tokens=max_tokens) for name, u in urls.items()}
            for client in clients.values():
                client.complete(messages[0], n=n, temperature=TEMPERATURE)
                client.tokens, client.seconds = 0, 0.0
            before = {name: sample_metrics(u, 0.0) for name, u in urls.items()}
            per_round: dict[str, list[float]] = {name: [] for name in clients}
            for r in range(rounds):
                for name, client in list(clients.items())[:: 1 if r % 2 == 0 else -1]:
                    tokens, seconds = client.tokens, client.seconds
                    for m in messages:
                        client.complete(m, n=n, temperature=TEMPERATURE)
                    per_round[name].append((client.tokens - tokens) / max(client.seconds - seconds, 1e-9))
            after = {name: sample_metrics(u, 0.0) for name, u in urls.items()}
        if None in (*before.values(), *after.values()):
            raise OSError("a server did not answer /metrics")
    except (SpecrlError, OSError) as exc:
        log.error("event=speed_measurement_failed error=%r", exc)
        return {"error": repr(exc)}
    finally:
        _delete_stream(redis_url, events_stream(plain_deployment))
    arms = {name: {"tokens": c.tokens, "seconds": round(c.seconds, 3),
                   "tokens_per_s": c.tokens / c.seconds if c.seconds else 0.0,
                   "rounds_tokens_per_s": per_round[name]} for name, c in clients.items()}
    for name, arm in arms.items():
        # what each server did while measured: records sent (both pay for telemetry), and its
        # engine's decode steps and their seconds: the rest of the request time (prefill, HTTP,
        # queueing) tells a gap between the arms that is not in the decode steps
        delta = {k: after[name].get(k, 0) - before[name].get(k, 0) for k in ("records_sent", "decode_s", "steps")}
        arm.update(records_sent=delta["records_sent"], decode_seconds=round(delta["decode_s"], 3), steps=delta["steps"])
    # tokens per step, and by proposer (the suffix index, the head)
    served = rates(before["with_speculation"], after["with_speculation"])
    arms["with_speculation"].update({k: served[k] for k in ("tokens_per_step", "speedup", "suffix_acceptance_rate",
                                                            "head_acceptance_rate", "suffix_draft_tokens_per_s",
                                                            "head_draft_tokens_per_s")})
    off = arms["without_speculation"]["tokens_per_s"]
    # one disturbed round (another process, the machine's neighbours) moves the totals, not the median
    ratio_median = statistics.median(spec / plain for spec, plain in zip(per_round["with_speculation"],
                                                                          per_round["without_speculation"]))
    return {**arms, "ratio": arms["with_speculation"]["tokens_per_s"] / off if off else None, "ratio_median": ratio_median,
            "policy": after["with_speculation"]["policy"], "policy_without": after["without_speculation"]["policy"],
            "drafter": after["with_speculation"]["drafter"],
            "tasks": len(tasks), "samples_per_task": n, "max_tokens": max_tokens, "temperature": TEMPERATURE,
            "rounds": rounds, "method": SPEED_METHOD}


def _delete_stream(redis_url: str, stream: str) -> None:
    try:
        connect(redis_url).delete(stream)
    except redis.RedisError as exc:
        log.warning("event=stream_not_deleted stream=%s error=%r", stream, exc)


def _produce(env, client: RolloutClient, pipeline: RolloutPipeline, stop: threading.Event, pause: _Pause,
             seed: int, failed: list) -> None:
    """Sample groups continuously and hand each to the scoring pool; the pipeline's bounds keep
    sampling from running far ahead of scoring and training. A task stream that raises or ends
    is recorded in `failed` (the run stops with it)."""
    try:
        for group, task in enumerate(env.tasks("train", seed)):
            held = time.monotonic()
            try:
                with pause.rollout(stop):
                    if stop.is_set():
                        return
                    began = time.monotonic()
                    rollouts = client.sample(task, group)
            except OSError as exc:
                log.warning("event=rollout_failed error=%r", exc)
                stop.wait(1.0)
                continue
            done = time.monotonic()
            if not pipeline.hand_off(task, rollouts, busy_s=done - began, paused_s=began - held):
                return
        failed.append("the environment's train task stream ended (tasks() must be endless)")
    except Exception as exc:  # noqa: BLE001 - a user's task stream: the run ends with its reason
        log.error("event=rollout_thread_failed error=%r", exc)
        failed.append(f"{type(exc).__name__}: {exc}")
    pipeline.stop()


def _publish(trainer: GRPOTrainer, store: WeightsStore, url: str, token: str, report: dict, started: float,
             samples: _Samples, events: EventLog) -> None:
    """Store the policy and swap it in (interrupt), with a metrics sample right before and after the swap."""
    try:
        version = trainer.publish(store, {"step": trainer.steps})
    except FloatingPointError as exc:
        log.error("event=publish_refused reason=%s", exc)
        report["publishes"].append({"t": time.monotonic() - started, "refused": str(exc)})
        return
    samples.take()
    result, error = _swap_policy(url, token, version)
    samples.take()
    if error is not None:  # the server keeps its policy; the next publish tries again
        log.error("event=policy_swap_failed version=%s error=%s", version, error)
        report["publishes"].append({"t": round(time.monotonic() - started, 1), "stored": version, "swap_failed": error})
        return
    report["publishes"].append({"t": round(time.monotonic() - started, 1), "version": version,
                                "load_ms": result["load_ms"], "swap_ms": result["swap_ms"]})
    events.write("policy_swap", **report["publishes"][-1])
    log.info("event=policy_swap version=%s load_ms=%s swap_ms=%s", version, result["load_ms"], result["swap_ms"])


def _evaluate(pool: ScorePool, client: RolloutClient, tasks: list, version: str, started: float) -> dict:
    """Greedy answers of the serving policy on held-out tasks -> mean reward with a 95% CI."""
    def answer(task) -> str:
        return client.complete(task_messages(task), n=1, temperature=0.0)["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(8) as requests:  # concurrent requests: the server batches them
        texts = list(requests.map(answer, tasks))
    scores = pool.score_each(tasks, texts)
    rewards = [s.reward for s in scores]
    mean, ci = mean_and_ci(rewards)
    log.info("event=eval policy=%s reward=%.3f ci95=%.3f n=%d", version, mean, ci, len(rewards))
    return {"t": round(time.monotonic() - started, 1), "policy": version, "reward": mean, "ci95": ci,
            "n": len(rewards), "errors": sum(s.error is not None for s in scores)}
