"""`specrl eval-policy`: held-out reward, pass@1 and pass@k of policy versions, side by side, on the same tasks.

`specrl rl` evaluates every few steps on a small held-out slice (it must stay short, the loop
waits for it); whether the policy really improved needs every held-out task and a paired
comparison. This takes the versions from a weights store ("base": the model itself), answers the
same held-out tasks with each through a live `specrl serve` of that version (speculation on: the
day-0 drafter and the suffix index, adaptive k; greedy output is the same as without, sampled output
follows the same distribution), EVAL_CONCURRENCY requests at a time (the server batches them); every
answer must say it came from that version. It scores them in the environment's scoring pool and
reports per version:

  reward         greedy answers (temperature 0): the mean reward over the tasks
  pass@1 greedy  the fraction of tasks the greedy answer solves (reward 1.0: every test passed;
                 for HumanEval, whose reward is pass/fail, the same number as the reward)
  pass@k         with --samples n >= k: n answers per task at --temperature (seeded), c of them
                 solving it, and per task the unbiased estimator of Chen et al. (2021),
                 1 - C(n - c, k) / C(n, k) (`pass_at_k`), averaged over the tasks

each with a 95% CI by the normal approximation over tasks (mean +- 1.96 s / sqrt(N)), and for each
version against the first the paired difference (the same tasks, per-task differences) with its
95% CI: a rise is measured when that interval lies above 0. The tasks are distinct (`take_tasks`):
--tasks is capped by what the split holds (HumanEval: its 40 held-out problems; IFEval: its 541).

An environment with a `summarize(tasks, scores)` method adds its own metrics and paired tests
(IFEval: prompt- and instruction-level accuracy, strict and loose, McNemar and a paired bootstrap);
the report keeps them under "env_metrics". The served speed (tokens per verify step, tokens/s) is
reported per version too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import secrets
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from specrl.apps.flags import COMMON, add_settings, settings_from
from specrl.apps.launch import running_server
from specrl.apps.rl import add_env_flags, with_deployment_store
from specrl.config import Settings
from specrl.errors import InvalidRequestError, SpecrlError
from specrl.speculation.quantities import SpecCounts
from specrl.trainer.envs import ScorePool, env_max_tokens, env_timeout_s, make_env, take_tasks
from specrl.trainer.rollout import RolloutClient, mean_and_ci, pass_at_k, task_messages
from specrl.weights import WeightsStore

CI_METHOD = "normal approximation over tasks: mean +- 1.96 * sd / sqrt(tasks); paired: the same on per-task differences"
EVAL_CONCURRENCY = 8   # requests in flight: the server batches them (its --max-batch caps what runs at once)


def register(sub) -> None:
    p = sub.add_parser("eval-policy", help="held-out reward of policy versions side by side, paired CIs")
    add_env_flags(p)
    p.add_argument("--versions", required=True, help="comma-separated policy versions of the store; base = the model")
    p.add_argument("--tasks", type=int, default=128, help="held-out tasks (the same for every version; at most the "
                                                          "split's)")
    p.add_argument("--samples", type=int, default=0, help="answers sampled per task for pass@k (0: greedy only)")
    p.add_argument("--k", type=int, default=10, help="pass@k's k (needs --samples >= k)")
    p.add_argument("--temperature", type=float, default=0.8, help="the sampled answers' temperature")
    p.add_argument("--out", default=None, help="JSON report path")
    add_settings(p, *COMMON, "store", "deployment", "model")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    versions = [v for v in args.versions.split(",") if v]
    evaluate_policies(with_deployment_store(settings_from(args)), args.env, versions, args.tasks, args.max_tokens,
                      Path(args.out) if args.out else None, samples=args.samples, k=args.k,
                      temperature=args.temperature, score_workers=args.score_workers,
                      score_timeout_s=args.score_timeout)
    return 0


def evaluate_policies(settings: Settings, env_name: str, versions: list[str], tasks: int, max_tokens: int | None = None,
                      out: Path | None = None, *, samples: int = 0, k: int = 10, temperature: float = 0.8,
                      score_workers: int = 4, score_timeout_s: float | None = None) -> dict:
    if not versions or tasks < 2 or (max_tokens is not None and max_tokens < 1):
        raise InvalidRequestError("--versions must name at least one version, --tasks must be >= 2 and "
                                  "--max-tokens >= 1")
    if samples and not (1 <= k <= samples and 0 < temperature <= 2):
        raise InvalidRequestError(f"pass@k needs 1 <= --k <= --samples and --temperature in (0, 2]; got k={k}, "
                                  f"samples={samples}, temperature={temperature}")
    cache_dir = settings.home / "cache"
    env = make_env(env_name, cache_dir=cache_dir)
    max_tokens = max_tokens or env_max_tokens(env)
    store = WeightsStore(settings.store_path)
    for version in versions:      # fail before any work
        if version != "base":
            store.verify("policy", version)
    heldout = take_tasks(env, env_name, "heldout", settings.seed, tasks)
    per_task: dict[str, dict[str, list[float]]] = {}
    greedy: dict[str, list] = {}
    served: dict[str, dict] = {}
    timeout_s = score_timeout_s or env_timeout_s(env)
    with tempfile.TemporaryDirectory(prefix="specrl-eval-policy-") as work_dir, \
            ScorePool(env_name, workers=score_workers, timeout_s=timeout_s, cache_dir=cache_dir) as pool:
        for version in versions:
            started = time.monotonic()
            with served_policy(settings, store, version, Path(work_dir)) as url:
                client = RolloutClient(url, settings.model, n=1, max_tokens=max_tokens)
                per_task[version], greedy[version], served[version] = _answer(
                    client, version, pool, heldout, samples=samples, k=k, temperature=temperature, seed=settings.seed)
            mean, ci = mean_and_ci(per_task[version]["reward"])
            print(f"eval-policy: {version}: reward {mean:.3f} +- {ci:.3f} on {len(heldout)} held-out {env_name} tasks "
                  f"({time.monotonic() - started:.0f} s, {served[version]['tokens_per_s']:.1f} tok/s served, "
                  f"{served[version]['tokens_per_step']:.2f} tokens per verify step)", file=sys.stderr, flush=True)
    metrics = ["reward", "pass@1_greedy"] + ([f"pass@{k}"] if samples else [])
    result = {"env": env_name, "model": settings.model, "store": str(store.root), "tasks": len(heldout),
              "task_ids": [t.id for t in heldout], "max_tokens": max_tokens, "seed": settings.seed,
              "samples": samples, "k": k if samples else None, "temperature": temperature if samples else None,
              "ci_method": CI_METHOD, "served": served, "versions": {}}
    first = versions[0]
    for version in versions:
        entry = result["versions"][version] = {}
        for metric in metrics:
            values, base = per_task[version][metric], per_task[first][metric]
            mean, ci = mean_and_ci(values)
            diff, diff_ci = mean_and_ci([b - a for a, b in zip(base, values)])
            summary = {"value": mean, "ci95": ci, "vs_first": diff, "vs_first_ci95": diff_ci, "per_task": values}
            if metric == "reward":   # the shape earlier reports had
                entry.update(reward=mean, ci95=ci, vs_first=diff, vs_first_ci95=diff_ci, rewards=values)
            else:
                entry[metric] = summary
        if samples:
            entry["correct"] = per_task[version]["correct"]
        entry["answers"] = [s.details.get("answer") for s in greedy[version]]   # greedy, in task order
        entry["errors"] = [s.error for s in greedy[version]]
    lines = table_lines(result, metrics)
    if callable(getattr(env, "summarize", None)):
        result["env_metrics"], env_lines = env.summarize(heldout, greedy)
        lines += ["", *env_lines]
    for line in lines:
        print(line)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"report: {out}")
    return result


@contextlib.contextmanager
def served_policy(settings: Settings, store: WeightsStore, version: str, work_dir: Path) -> Iterator[str]:
    """A `specrl serve` of policy `version` ("base": the model) on a free loopback port, stopped on exit -> its URL.

    It gets a store of its own in which `version` (linked to the deployment's copy) is `current`, so it starts on
    it; no drafter is current there, so it drafts with the day-0 head and the suffix index. Its records stay in
    memory (no Redis): an evaluation is not traffic to learn from.
    """
    own = WeightsStore(work_dir / f"store-{version}")
    if version != "base":
        (own.root / "policy").mkdir(parents=True, exist_ok=True)
        link = own.root / "policy" / version
        if not link.exists():
            link.symlink_to(store.verify("policy", version).resolve(), target_is_directory=True)
        own.set_current("policy", version)
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(SPECRL_HOME=str(settings.home), SPECRL_ADMIN_TOKEN=secrets.token_hex(16))
    with running_server(["--model", settings.model, "--store", str(own.root), "--deployment",
                         f"eval-{secrets.token_hex(4)}", "--threads", str(settings.threads)], env,
                        work_dir / f"serve-{version}.log") as url:
        yield url


def _answer(client: RolloutClient, version: str, pool: ScorePool, heldout: list, *, samples: int, k: int,
            temperature: float, seed: int) -> tuple[dict[str, list[float]], list, dict]:
    """One version's answers, scored -> (per-task values: reward and pass@1 greedy, and with samples the correct
    counts and pass@k; the greedy Scores; the served speed)."""
    counts, started = SpecCounts(), time.monotonic()
    texts = ask(client, version, heldout, [{"n": 1, "temperature": 0.0}] * len(heldout), counts, "greedy")
    greedy = [dataclasses.replace(score, details={**score.details, "answer": text[0]})
              for score, text in zip(pool.score_each(heldout, [t[0] for t in texts]), texts)]
    values = {"reward": [s.reward for s in greedy], "pass@1_greedy": [float(s.reward >= 1.0) for s in greedy]}
    if samples:
        options = [{"n": samples, "temperature": temperature, "seed": seed + i} for i in range(len(heldout))]
        sampled = ask(client, version, heldout, options, counts, f"{samples} samples/task")
        scores = pool.score_each([t for t in heldout for _ in range(samples)], [x for group in sampled for x in group])
        values["correct"] = [sum(s.reward >= 1.0 for s in scores[i * samples:(i + 1) * samples])
                             for i in range(len(heldout))]
        values[f"pass@{k}"] = [pass_at_k(samples, c, k) for c in values["correct"]]
    seconds = time.monotonic() - started
    served = {"completion_tokens": client.tokens, "seconds": round(seconds, 1),
              "tokens_per_s": client.tokens / seconds if seconds else 0.0,
              "tokens_per_step": counts.tokens_per_step or 1.0, "spec_decode": counts.to_dict()}
    return values, greedy, served


def ask(client: RolloutClient, version: str, tasks: list, options: list[dict], counts: SpecCounts,
        what: str) -> list[list[str]]:
    """Each task's answers (`options[i]`: n, temperature, seed), EVAL_CONCURRENCY at a time, with a progress bar;
    the server's speculation counters are added to `counts`. Raises SpecrlError for an answer from another policy."""
    from tqdm import tqdm

    def one(i: int) -> dict:
        return client.complete(task_messages(tasks[i]), **options[i])

    answers = []
    with ThreadPoolExecutor(EVAL_CONCURRENCY) as pool, \
            tqdm(total=len(tasks), desc=f"eval-policy {version} {what}", unit="task", file=sys.stderr,
                 leave=False) as bar:
        for data in pool.map(one, range(len(tasks))):
            if data["specrl"]["target_version"] != version:
                raise SpecrlError(f"eval-policy: the server answered with policy {data['specrl']['target_version']}, "
                                  f"not {version}")
            spec = data["specrl"]["spec_decode"]
            counts.add(SpecCounts(spec["num_steps"], spec["num_drafts"], spec["num_draft_tokens"],
                                  spec["num_accepted_tokens"], spec["num_accepted_tokens_per_pos"]))
            answers.append([choice["message"]["content"] for choice in data["choices"]])
            bar.update(1)
    return answers


def table_lines(result: dict, metrics: list[str]) -> list[str]:
    """Metrics down, versions across, then each later version's paired difference against the first."""
    versions = list(result["versions"])
    first, later = versions[0], versions[1:]
    names = {"reward": "reward (greedy)", "pass@1_greedy": "pass@1 greedy"}
    if result["samples"]:
        names[f"pass@{result['k']}"] = f"pass@{result['k']} (n={result['samples']}, T={result['temperature']:g})"
    header = [f"{'95% CI, ' + str(result['tasks']) + ' tasks':<26}", *(f"{v:>16}" for v in versions),
              *(f"{v + ' - ' + first:>18}" for v in later)]
    lines = ["  ".join(header)]
    for metric in metrics:
        cells = []
        for version in versions:
            entry = result["versions"][version]
            value = entry if metric == "reward" else entry[metric]
            cells.append(f"{_pm(value['reward' if metric == 'reward' else 'value'], value['ci95']):>16}")
        for version in later:
            entry = result["versions"][version]
            value = entry if metric == "reward" else entry[metric]
            cells.append(f"{_pm(value['vs_first'], value['vs_first_ci95'], signed=True):>18}")
        lines.append("  ".join([f"{names[metric]:<26}", *cells]))
    return lines


def _pm(mean: float, ci: float, signed: bool = False) -> str:
    return f"{mean:+.3f} +- {ci:.3f}" if signed else f"{mean:.3f} +- {ci:.3f}"
