"""`specrl eval-policy`: held-out reward of policy versions, side by side, on the same tasks.

`specrl rl` evaluates every few steps on a small held-out slice (it must stay short, the loop
waits for it); whether the reward really rose needs more tasks and a paired comparison. This
takes the versions from a weights store ("base": the model itself), answers the same N held-out
tasks greedily with each (the native engine, batched, no drafter: greedy output does not depend
on it), scores them with the environment's scorer, and reports per version the mean reward with
a 95% CI, and for each version against the first one the paired difference (same tasks) with its
95% CI: a rise is measured when that interval lies above 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

from specrl.apps.flags import COMMON, add_settings, settings_from
from specrl.apps.rl import with_deployment_store
from specrl.config import Settings
from specrl.errors import InvalidRequestError
from specrl.trainer.envs import ENVIRONMENTS, make_env, safe_score
from specrl.trainer.rollout import mean_and_ci, task_messages


def register(sub) -> None:
    p = sub.add_parser("eval-policy", help="held-out reward of policy versions side by side, paired CI")
    p.add_argument("--env", required=True, choices=list(ENVIRONMENTS))
    p.add_argument("--versions", required=True, help="comma-separated policy versions of the store; base = the model")
    p.add_argument("--tasks", type=int, default=128, help="held-out tasks (the same for every version)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default=None, help="JSON report path")
    add_settings(p, *COMMON, "store", "deployment", "model")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    versions = [v for v in args.versions.split(",") if v]
    evaluate_policies(with_deployment_store(settings_from(args)), args.env, versions, args.tasks, args.max_tokens,
                      Path(args.out) if args.out else None)
    return 0


def evaluate_policies(settings: Settings, env_name: str, versions: list[str], tasks: int, max_tokens: int,
                      out: Path | None = None) -> dict:
    from transformers import AutoTokenizer

    from specrl.assets import resolve_model
    from specrl.models.llama import load_llama
    from specrl.engine.engine import Engine
    from specrl.spec.sampling import SamplingParams
    from specrl.weights import WeightsStore

    if not versions or tasks < 2 or max_tokens < 1:
        raise InvalidRequestError("--versions must name at least one version, --tasks must be >= 2 and "
                                  "--max-tokens >= 1")
    env = make_env(env_name)
    model_dir = resolve_model(settings.model, settings.home)
    store = WeightsStore(settings.store_path)
    directories = {v: model_dir if v == "base" else store.verify("policy", v) for v in versions}  # fail before any work
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    heldout = list(itertools.islice(env.tasks("heldout", settings.seed), tasks))
    prompts = [tokenizer.apply_chat_template(task_messages(t), add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for t in heldout]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rewards: dict[str, list[float]] = {}
    for version, directory in directories.items():
        started = time.monotonic()
        engine = Engine(load_llama(directory), tokenizer, settings.replace(drafter="none"))
        completions = engine.generate(prompts, params)
        rewards[version] = [safe_score(env, t, c.text).reward for t, c in zip(heldout, completions)]
        mean, ci = mean_and_ci(rewards[version])
        print(f"eval-policy: {version}: reward {mean:.3f} +- {ci:.3f} on {len(heldout)} held-out {env_name} tasks "
              f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    first = versions[0]
    result = {"env": env_name, "model": settings.model, "store": str(store.root), "tasks": len(heldout),
              "max_tokens": max_tokens, "seed": settings.seed, "versions": {}}
    for version in versions:
        mean, ci = mean_and_ci(rewards[version])
        diff_mean, diff_ci = mean_and_ci([b - a for a, b in zip(rewards[first], rewards[version])])
        result["versions"][version] = {"reward": mean, "ci95": ci, "vs_first": diff_mean, "vs_first_ci95": diff_ci,
                                       "rewards": rewards[version]}
        print(f"{version:>8}: reward {mean:.3f} +- {ci:.3f}   vs {first}: {diff_mean:+.3f} +- {diff_ci:.3f}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"report: {out}")
    return result
