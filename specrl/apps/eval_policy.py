"""`specrl eval-policy`: held-out reward, pass@1 and pass@k of policy versions, side by side, on the same tasks.

`specrl rl` evaluates every few steps on a small held-out slice (it must stay short, the loop
waits for it); whether the policy really improved needs every held-out task and a paired
comparison. This takes the versions from a weights store ("base": the model itself), answers the
same held-out tasks with each (the native engine, batched, no drafter: its output does not depend
on one), scores them in the environment's scoring pool, and reports per version:

  reward         greedy answers (temperature 0): the mean reward over the tasks
  pass@1 greedy  the fraction of tasks the greedy answer solves (reward 1.0: every test passed;
                 for HumanEval, whose reward is pass/fail, the same number as the reward)
  pass@k         with --samples n >= k: n answers per task at --temperature (seeded), c of them
                 solving it, and per task the unbiased estimator of Chen et al. (2021),
                 1 - C(n - c, k) / C(n, k) (`pass_at_k`), averaged over the tasks

each with a 95% CI by the normal approximation over tasks (mean +- 1.96 s / sqrt(N)), and for each
version against the first the paired difference (the same tasks, per-task differences) with its
95% CI: a rise is measured when that interval lies above 0. The tasks are distinct (`take_tasks`):
--tasks is capped by what the split holds (HumanEval: its 40 held-out problems).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specrl.apps.flags import COMMON, add_settings, settings_from
from specrl.apps.rl import add_env_flags, with_deployment_store
from specrl.config import Settings
from specrl.errors import InvalidRequestError
from specrl.trainer.envs import ScorePool, env_max_tokens, env_timeout_s, make_env, take_tasks
from specrl.trainer.rollout import mean_and_ci, pass_at_k, task_messages

CI_METHOD = "normal approximation over tasks: mean +- 1.96 * sd / sqrt(tasks); paired: the same on per-task differences"


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
    from transformers import AutoTokenizer

    from specrl.assets import resolve_model
    from specrl.weights import WeightsStore

    if not versions or tasks < 2 or (max_tokens is not None and max_tokens < 1):
        raise InvalidRequestError("--versions must name at least one version, --tasks must be >= 2 and "
                                  "--max-tokens >= 1")
    if samples and not (1 <= k <= samples and 0 < temperature <= 2):
        raise InvalidRequestError(f"pass@k needs 1 <= --k <= --samples and --temperature in (0, 2]; got k={k}, "
                                  f"samples={samples}, temperature={temperature}")
    cache_dir = settings.home / "cache"
    env = make_env(env_name, cache_dir=cache_dir)
    max_tokens = max_tokens or env_max_tokens(env)
    model_dir = resolve_model(settings.model, settings.home)
    store = WeightsStore(settings.store_path)
    directories = {v: model_dir if v == "base" else store.verify("policy", v) for v in versions}  # fail before any work
    heldout = take_tasks(env, env_name, "heldout", settings.seed, tasks)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.apply_chat_template(task_messages(t), add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for t in heldout]
    per_task: dict[str, dict[str, list[float]]] = {}
    with ScorePool(env_name, workers=score_workers, timeout_s=score_timeout_s or env_timeout_s(env),
                   cache_dir=cache_dir) as pool:
        for version, directory in directories.items():
            started = time.monotonic()
            per_task[version] = _answer(settings, directory, tokenizer, pool, heldout, prompts, max_tokens=max_tokens,
                                        samples=samples, k=k, temperature=temperature)
            mean, ci = mean_and_ci(per_task[version]["reward"])
            print(f"eval-policy: {version}: reward {mean:.3f} +- {ci:.3f} on {len(heldout)} held-out {env_name} tasks "
                  f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    metrics = ["reward", "pass@1_greedy"] + ([f"pass@{k}"] if samples else [])
    result = {"env": env_name, "model": settings.model, "store": str(store.root), "tasks": len(heldout),
              "task_ids": [t.id for t in heldout], "max_tokens": max_tokens, "seed": settings.seed,
              "samples": samples, "k": k if samples else None, "temperature": temperature if samples else None,
              "ci_method": CI_METHOD, "versions": {}}
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
    for line in table_lines(result, metrics):
        print(line)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"report: {out}")
    return result


def _answer(settings: Settings, directory: Path, tokenizer, pool: ScorePool, heldout: list, prompts: list, *,
            max_tokens: int, samples: int, k: int, temperature: float) -> dict[str, list[float]]:
    """One version's per-task values: reward and pass@1 greedy, and with samples the correct counts and pass@k."""
    from specrl.engine.engine import Engine
    from specrl.models.llama import load_llama
    from specrl.speculation.sampling import SamplingParams

    engine = Engine(load_llama(directory), tokenizer, settings.replace(drafter="none"))
    greedy = pool.score_each(heldout, _generate(engine, prompts, [SamplingParams(max_tokens=max_tokens,
                                                                                 temperature=0.0)] * len(prompts),
                                                "greedy"))
    values = {"reward": [s.reward for s in greedy], "pass@1_greedy": [float(s.reward >= 1.0) for s in greedy]}
    if samples:
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=settings.seed + i * samples + j)
                  for i in range(len(prompts)) for j in range(samples)]
        texts = _generate(engine, [p for p in prompts for _ in range(samples)], params, f"{samples} samples/task")
        scores = pool.score_each([t for t in heldout for _ in range(samples)], texts)
        values["correct"] = [sum(s.reward >= 1.0 for s in scores[i * samples:(i + 1) * samples])
                             for i in range(len(prompts))]
        values[f"pass@{k}"] = [pass_at_k(samples, c, k) for c in values["correct"]]
    return values


def _generate(engine, prompts: list, params: list, what: str) -> list[str]:
    return [c.text for c in complete(engine, prompts, params, f"eval-policy {what}")]


def complete(engine, prompts: list, params: list, what: str) -> list:
    """The engine's completions (`Completion`s, in the prompts' order), in chunks of a few batches so
    that a progress bar labelled `what` moves."""
    from tqdm import tqdm

    chunk = 4 * engine.settings.max_batch
    done: list = []
    with tqdm(total=len(prompts), desc=what, unit="answer", file=sys.stderr, leave=False) as bar:
        for start in range(0, len(prompts), chunk):
            done += engine.generate(prompts[start:start + chunk], params[start:start + chunk])
            bar.update(len(prompts[start:start + chunk]))
    return done


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
