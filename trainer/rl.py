"""`specrl rl`: the policy RL loop, Generator -> Environment -> Trainer, with the drafter following.

    server (the Generator; speculative decoding, events to Redis)   drafter trainer (follows the policy)
        ^ rollouts: n samples per task, log-probs, per-token versions          ^ events
        |                                                                      |
    rollout thread -> Environment scores -> queue -> GRPO step -> publish policy -> swap (interrupt)

Rollouts are produced continuously in a background thread while the policy trains (asynchronous,
as in slime), so a rollout can be one or more versions behind: the staleness bound in GRPO drops
what is too old. Every `eval_every` steps the serving policy answers held-out tasks greedily and
the environment scores them: the reward curve over policy versions.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import secrets
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specrl.assets import resolve_model
from specrl.config import Settings
from specrl.launch import spawn, terminate, wait_healthy
from specrl.trainer.envs import make_env, safe_score
from specrl.trainer.grpo import GRPOConfig, GRPOTrainer
from specrl.trainer.rollout import RolloutClient, mean_and_ci, task_messages
from specrl.up import Redis, rates, sample_metrics
from specrl.weights import WeightsStore

log = logging.getLogger("specrl.trainer.rl")


def run_rl(settings: Settings, *, env_name: str, minutes: float, group_size: int = 4, tasks_per_step: int = 4,
           publish_every: int = 2, eval_every: int = 4, eval_tasks: int = 24, max_tokens: int = 64,
           config: GRPOConfig | None = None, out_dir: str | None = None) -> dict:
    run_dir = Path(out_dir) if out_dir else settings.home / "runs" / time.strftime(f"rl-{env_name}-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    env = make_env(env_name)
    model_dir = resolve_model(settings.model, settings.home)
    store = WeightsStore(settings.store_path)
    redis = Redis(settings.redis_url)
    token, url = settings.admin_token or secrets.token_hex(16), f"http://{settings.host}:{settings.port}"
    env_vars = {**os.environ, "SPECRL_ADMIN_TOKEN": token, "SPECRL_HOME": str(settings.home)}
    common = ["--model", settings.model, "--redis-url", redis.url, "--deployment", settings.deployment,
              "--store", str(settings.store_path)]
    children, stop = [], threading.Event()
    report = {"command": sys.argv, "env": env_name, "model": settings.model, "steps": [], "evals": [], "samples": [],
              "publishes": []}
    try:
        children.append(spawn(["serve", *common, "--port", str(settings.port), "--host", settings.host], env_vars,
                              run_dir / "server.log"))
        wait_healthy(url, children[0], run_dir / "server.log")
        children.append(spawn(["train-drafter", *common, "--server", url, "--publish-every-s", "30"], env_vars,
                              run_dir / "drafter-trainer.log"))
        trainer = GRPOTrainer(model_dir, config or GRPOConfig())
        client = RolloutClient(url, settings.model, n=group_size, max_tokens=max_tokens)
        rollouts: queue.Queue = queue.Queue(maxsize=2 * tasks_per_step)
        producer = threading.Thread(target=_produce, args=(env, client, rollouts, stop, settings.seed), daemon=True)
        producer.start()
        heldout = list(itertools.islice(env.tasks("heldout", settings.seed), eval_tasks))
        started = time.monotonic()
        report["evals"].append(_evaluate(env, client, heldout, trainer.version, started))
        previous = sample_metrics(url, started)
        while time.monotonic() - started < minutes * 60 and all(c.poll() is None for c in children):
            batch = [r for _ in range(tasks_per_step) for r in rollouts.get()]
            stats = trainer.step(batch)
            entry = {"t": round(time.monotonic() - started, 1), "step": trainer.steps, "policy": trainer.version,
                     **{k: v for k, v in stats.__dict__.items() if k != "versions"}}
            report["steps"].append(entry)
            log.info("event=grpo_step %s", " ".join(f"{k}={v}" for k, v in entry.items()))
            if stats.trained and trainer.steps % publish_every == 0:
                _publish(trainer, store, url, token, report, started)
            if trainer.steps and trainer.steps % eval_every == 0:
                report["evals"].append(_evaluate(env, client, heldout, trainer.version, started))
            sample = sample_metrics(url, started)
            if sample and previous:
                report["samples"].append({**sample, **rates(previous, sample)})
            previous = sample or previous
        report["evals"].append(_evaluate(env, client, heldout, trainer.version, started))
        report["rollout_tokens_per_s"] = client.tokens / client.seconds if client.seconds else None
    finally:
        stop.set()
        for child in reversed(children):
            terminate(child)
        redis.stop()
    _write_report(run_dir, report)
    return report


def _produce(env, client: RolloutClient, out: queue.Queue, stop: threading.Event, seed: int) -> None:
    """Sample and score groups continuously; the queue bound keeps them from running far ahead."""
    for group, task in enumerate(env.tasks("train", seed)):
        if stop.is_set():
            return
        try:
            rollouts = client.sample(env, task, group, lambda e, t, text: safe_score(e, t, text, timeout_s=10.0))
        except OSError as exc:
            log.warning("event=rollout_failed error=%r", exc)
            stop.wait(1.0)
            continue
        while not stop.is_set():
            try:
                out.put(rollouts, timeout=0.5)
                break
            except queue.Full:
                continue


def _publish(trainer: GRPOTrainer, store: WeightsStore, url: str, token: str, report: dict, started: float) -> None:
    try:
        version = trainer.publish(store, {"step": trainer.steps})
    except FloatingPointError as exc:
        log.error("event=publish_refused reason=%s", exc)
        report["publishes"].append({"t": time.monotonic() - started, "refused": str(exc)})
        return
    body = json.dumps({"role": "policy", "version": version, "mode": "interrupt"}).encode()
    request = urllib.request.Request(url + "/admin/weights", data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=300) as resp:
        result = json.loads(resp.read())
    report["publishes"].append({"t": round(time.monotonic() - started, 1), "version": version,
                                "load_ms": result["load_ms"], "swap_ms": result["swap_ms"]})
    log.info("event=policy_swap version=%s load_ms=%s swap_ms=%s", version, result["load_ms"], result["swap_ms"])


def _evaluate(env, client: RolloutClient, tasks: list, version: str, started: float) -> dict:
    """Greedy answers of the serving policy on held-out tasks -> mean reward with a 95% CI."""
    def reward(task) -> float:
        data = client.complete(task_messages(task), n=1, temperature=0.0)
        return safe_score(env, task, data["choices"][0]["message"]["content"], timeout_s=10.0).reward

    with ThreadPoolExecutor(8) as pool:  # concurrent requests: the server batches them
        rewards = list(pool.map(reward, tasks))
    mean, ci = mean_and_ci(rewards)
    log.info("event=eval policy=%s reward=%.3f ci95=%.3f n=%d", version, mean, ci, len(rewards))
    return {"t": round(time.monotonic() - started, 1), "policy": version, "reward": mean, "ci95": ci,
            "n": len(rewards)}


def _write_report(run_dir: Path, report: dict) -> None:
    (run_dir / "rl-report.json").write_text(json.dumps(report, indent=2, default=str))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6))
    evals = report["evals"]
    ax1.errorbar(range(len(evals)), [e["reward"] for e in evals], yerr=[e["ci95"] or 0 for e in evals], marker="o")
    ax1.set_xticks(range(len(evals)), [e["policy"] for e in evals], fontsize=7)
    ax1.set_ylabel(f"held-out reward ({report['env']})")
    samples = report["samples"]
    ax2.plot([s["t"] for s in samples], [s.get("acceptance_length") or 1.0 for s in samples])
    for publish in report["publishes"]:
        ax2.axvline(publish["t"], color="tab:red", linestyle="--", alpha=0.5)
    ax2.set_xlabel("seconds (dashed: policy swaps)")
    ax2.set_ylabel("acceptance length")
    fig.tight_layout()
    fig.savefig(run_dir / "rl-report.png", dpi=100)
    plt.close(fig)
    print(f"specrl rl: report {run_dir / 'rl-report.json'} and {run_dir / 'rl-report.png'}", file=sys.stderr)
