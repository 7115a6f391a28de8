"""`specrl bench quality`: what each weight format costs in quality, measured against float32.

Speed per format is `bench engine`'s; this is the other half of the trade. The reference is the
float32 model as the engine serves it (packed by the float32 calibration). For each format of
`--dtypes` (the weights' dtype; activations, KV cache and sums stay float32 in every format), on
`--prompts` held-out prompts of the bundled mix (seeded, every domain):

  kl              mean over tokens of KL(p_float32 || p_format), in nats: both models read the same
                  text (the prompt, then float32's greedy answer) in one teacher-forced forward, and
                  every answer position is one token (what llama.cpp's `--kl-divergence` reports)
  top1            the share of those positions where both models' most likely token is the same
  greedy prefix   each format answers the prompts greedily on its own engine; the mean number of
                  leading tokens identical to float32's answer (out of --max-tokens), and the share
                  of answers identical throughout
  reward          an environment's held-out tasks (`--env`, default format) answered greedily by
                  each format and scored in its scoring pool: the mean reward and, against float32
                  on the same tasks, the paired difference with a 95% CI (normal approximation)

Table, JSON (`bench-quality.json`) and PNG (`bench-quality.png`) under <home>/reports/.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specrl.apps.flags import COMMON, add_settings, settings_from
from specrl.config import Settings
from specrl.errors import InvalidRequestError

REFERENCE = "float32"
DEFAULT_FORMATS = ("float16", "bfloat16")


def register(sub) -> None:
    p = sub.add_parser("quality", help="each weight format against float32: KL, top-1, greedy prefix, env reward")
    p.add_argument("--dtypes", default=",".join(DEFAULT_FORMATS),
                   help=f"weight formats to measure against float32 (default {','.join(DEFAULT_FORMATS)})")
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts of the bundled mix (default 32)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens of each greedy answer (default 128)")
    p.add_argument("--env", default="format", help="environment whose held-out reward is compared (default format)")
    p.add_argument("--env-tasks", type=int, default=32, help="its held-out tasks (default 32; 0: no reward)")
    p.add_argument("--out", default=None, help="report directory (default <home>/reports/bench-quality-<time>)")
    add_settings(p, *COMMON, "model")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    formats = parse_formats(args.dtypes)
    if args.prompts < 1 or args.max_tokens < 1 or args.env_tasks < 0:
        raise InvalidRequestError("--prompts and --max-tokens must be >= 1 and --env-tasks >= 0")
    run_quality_bench(settings_from(args), formats, prompts=args.prompts, max_tokens=args.max_tokens,
                      env_name=args.env, env_tasks=args.env_tasks, out_dir=args.out)
    return 0


def parse_formats(text: str) -> list[str]:
    """"float16,bfloat16" -> the formats, each one the engine can serve (float32 itself allowed: a
    self-check that must read KL 0, top-1 1)."""
    from specrl.models.calibration import DTYPES

    formats = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in formats if f not in DTYPES]
    if unknown or not formats:
        raise InvalidRequestError(f"--dtypes takes some of {', '.join(DTYPES)}; got {text!r}")
    return formats


@dataclass
class Agreement:
    """Per-token agreement of a format's next-token distributions with float32's, over answers."""

    kl: list[float] = field(default_factory=list)  # one per answer position
    top1_same: int = 0

    def add(self, reference_logits: torch.Tensor, logits: torch.Tensor) -> None:
        """reference_logits, logits [L, V] float32: the same L positions under float32 and the format."""
        self.kl += token_kl(reference_logits, logits).tolist()
        self.top1_same += int((reference_logits.argmax(-1) == logits.argmax(-1)).sum())

    def summary(self) -> dict:
        from specrl.loadtest.report import percentile

        tokens = len(self.kl)
        return {"tokens": tokens, "kl_mean": sum(self.kl) / max(tokens, 1), "kl_max": max(self.kl, default=0.0),
                "kl_p99": percentile(self.kl, 99), "top1": self.top1_same / max(tokens, 1)}


def token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[L, V] float32 logits of p (the reference) and q -> [L] float64 KL(p || q) = sum_v p (log p - log q)
    in nats, computed in float64 (a tiny KL is a difference of nearly equal sums)."""
    log_p = torch.log_softmax(reference_logits.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)


def common_prefix(a: list[int], b: list[int]) -> int:
    """The number of leading tokens two answers share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_quality_bench(settings: Settings, formats: list[str], *, prompts: int = 32, max_tokens: int = 128,
                      env_name: str = "format", env_tasks: int = 32, out_dir: str | None = None) -> dict:
    """Answer, teacher-force and score per format; print a table; write bench-quality.json and .png."""
    from transformers import AutoTokenizer

    from specrl.apps.bench.backends import machine_record, save_report
    from specrl.assets import resolve_model
    from specrl.data.prompts import chat_token_ids, load_prompts

    model_dir = resolve_model(settings.model, settings.home)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    heldout = load_prompts(split="heldout", seed=settings.seed)
    chosen = random.Random(settings.seed).sample(heldout, min(prompts, len(heldout)))
    prompt_ids = chat_token_ids(tokenizer, chosen)
    env = _env_tasks(settings, env_name, env_tasks, tokenizer)
    longest = max(map(len, prompt_ids + (env["prompt_ids"] if env else [])))
    settings = settings.replace(drafter="none", suffix_capacity=0, max_batch=8, prefix_cache=False,
                                max_seq_len=longest + max(max_tokens, env["max_tokens"] if env else 0) + 8)
    started = time.monotonic()
    models, answers, rewards, notes = {}, {}, {}, {}
    for fmt in dict.fromkeys([REFERENCE, *formats]):  # float32 first: every format is compared with its answers
        models[fmt], notes[fmt] = _load(settings, model_dir, fmt)
        answers[fmt], rewards[fmt] = _answer(settings, models[fmt], tokenizer, fmt, prompt_ids, max_tokens, env)
    agreement = {fmt: Agreement() for fmt in formats}
    _progress(f"teacher-forced logits over {len(prompt_ids)} float32 answers")
    for prompt, answer in zip(prompt_ids, answers[REFERENCE]):
        tokens = torch.tensor([prompt + answer])
        positions = slice(len(prompt) - 1, len(prompt) + len(answer) - 1)  # each predicts the next answer token
        reference = _logits(models[REFERENCE], tokens, positions)
        for fmt in formats:
            agreement[fmt].add(reference, reference if fmt == REFERENCE else _logits(models[fmt], tokens, positions))
    rows = {fmt: _row(fmt, agreement[fmt], answers, rewards, max_tokens, notes[fmt]) for fmt in formats}
    result = {"command": sys.argv, "model": settings.model, "machine": machine_record(), "reference": REFERENCE, "prompts": len(prompt_ids),
              "max_tokens": max_tokens, "env": env_name if env else None, "env_tasks": len(env["tasks"]) if env else 0,
              "seed": settings.seed, "seconds": round(time.monotonic() - started, 1),
              "reference_reward": _mean(rewards[REFERENCE]), "formats": rows}
    save_report(result, "bench-quality", out_dir, settings.home, _print_table, _plot)
    return result


def _env_tasks(settings: Settings, env_name: str, n: int, tokenizer) -> dict | None:
    """The environment's held-out tasks and their chat prompts (None: --env-tasks 0)."""
    if n == 0:
        return None
    from specrl.trainer.envs import env_max_tokens, env_timeout_s, make_env, take_tasks
    from specrl.trainer.rollout import task_messages

    env = make_env(env_name, cache_dir=settings.home / "cache")
    tasks = take_tasks(env, env_name, "heldout", settings.seed, n)
    prompt_ids = [list(tokenizer.apply_chat_template(task_messages(t), add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)) for t in tasks]
    return {"name": env_name, "tasks": tasks, "prompt_ids": prompt_ids, "max_tokens": env_max_tokens(env),
            "timeout_s": env_timeout_s(env)}


def _load(settings: Settings, model_dir: Path, fmt: str):
    """The target in one weight format, packed as this machine's calibration for it chose."""
    from specrl.models.calibration import Calibration
    from specrl.models.llama import load_llama

    plan = Calibration.open(settings.home / "calibration", fmt, progress=True)
    _progress(f"{fmt}: {plan.note}")
    return load_llama(model_dir, plan=plan), plan.note


def _answer(settings: Settings, target, tokenizer, fmt: str, prompt_ids: list[list[int]], max_tokens: int,
            env: dict | None) -> tuple[list[list[int]], list[float]]:
    """One format's greedy answers (token ids) to the prompts, and its rewards on the env's tasks."""
    from specrl.engine.engine import Engine
    from specrl.speculation.sampling import SamplingParams

    engine = Engine(target, tokenizer, settings, calibrate=False)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    answers = [c.output_ids for c in _complete(engine, prompt_ids, [greedy] * len(prompt_ids),
                                              f"bench quality {fmt}: prompts")]
    rewards: list[float] = []
    if env:
        from specrl.trainer.envs import ScorePool

        params = [SamplingParams(max_tokens=env["max_tokens"], temperature=0.0)] * len(env["tasks"])
        texts = [c.text for c in _complete(engine, env["prompt_ids"], params, f"bench quality {fmt}: {env['name']}")]
        with ScorePool(env["name"], workers=2, timeout_s=env["timeout_s"], cache_dir=settings.home / "cache") as pool:
            rewards = [s.reward for s in pool.score_each(env["tasks"], texts)]
    return answers, rewards


def _complete(engine, prompts: list, params: list, what: str) -> list:
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


@torch.inference_mode()
def _logits(target, tokens: torch.Tensor, positions: slice) -> torch.Tensor:
    """tokens [1, T] int64 -> logits [L, V] float32 at `positions` (one causal forward, no cache)."""
    return target.logits(target(tokens)[0, positions])


def _row(fmt: str, agreement: Agreement, answers: dict, rewards: dict, max_tokens: int, note: str) -> dict:
    from specrl.trainer.rollout import mean_and_ci

    prefixes = [common_prefix(a, b) for a, b in zip(answers[REFERENCE], answers[fmt])]
    identical = [a == b for a, b in zip(answers[REFERENCE], answers[fmt])]
    row = {**agreement.summary(), "note": note, "greedy_prefix_mean": sum(prefixes) / len(prefixes),
           "greedy_prefix": prefixes, "identical_answers": sum(identical) / len(identical),
           "answer_tokens_mean": sum(map(len, answers[fmt])) / len(answers[fmt]), "max_tokens": max_tokens}
    if rewards[fmt]:
        reward, reward_ci = mean_and_ci(rewards[fmt])
        diff, diff_ci = mean_and_ci([b - a for a, b in zip(rewards[REFERENCE], rewards[fmt])])
        row.update(reward=reward, reward_ci95=reward_ci, reward_vs_float32=diff, reward_vs_float32_ci95=diff_ci,
                   rewards=rewards[fmt])
    return row


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _progress(message: str) -> None:
    print(f"bench quality: {message}", file=sys.stderr, flush=True)


def _print_table(result: dict) -> None:
    from specrl.apps.bench.backends import machine_line

    print(f"machine: {machine_line(result['machine'])}")
    print(f"{result['model']} against {result['reference']}, {result['prompts']} held-out prompts, greedy answers of "
          f"up to {result['max_tokens']} tokens" + (f"; {result['env']} reward on {result['env_tasks']} held-out tasks "
                                                     f"(float32 {result['reference_reward']:.3f})" if result['env']
                                                    else ""))
    print(f"{'format':<9} {'tokens':>6} {'KL mean':>9} {'KL p99':>8} {'top-1':>6} {'prefix':>7} {'same':>5} "
          f"{'reward':>7} {'vs float32':>16}")
    for fmt, r in result["formats"].items():
        reward = f"{r['reward']:>7.3f} {r['reward_vs_float32']:>+7.3f} +- {r['reward_vs_float32_ci95']:.3f}" \
            if "reward" in r else f"{'-':>7} {'-':>16}"
        print(f"{fmt:<9} {r['tokens']:>6} {r['kl_mean']:>9.2e} {r['kl_p99']:>8.2e} {r['top1']:>6.3f} "
              f"{r['greedy_prefix_mean']:>7.1f} {r['identical_answers']:>5.2f} {reward}")
    print("KL: nats per token, KL(p_float32 || p_format); prefix: mean leading tokens equal to float32's greedy "
          "answer; same: share of answers equal throughout")


def _plot(result: dict, path: Path) -> None:
    """Per format: the KL distribution over tokens (CDF), and top-1 / identical prefix / reward bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = list(result["formats"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for fmt in formats:
        r = result["formats"][fmt]
        prefixes = sorted(r["greedy_prefix"])
        left.plot(prefixes, [(i + 1) / len(prefixes) for i in range(len(prefixes))], drawstyle="steps-post",
                  label=f"{fmt} (mean {r['greedy_prefix_mean']:.0f})")
    left.set_xlabel(f"leading tokens equal to float32's greedy answer (of {result['max_tokens']})")
    left.set_ylabel("share of answers")
    left.set_title("greedy answers against float32's")
    left.grid(True, alpha=0.3)
    left.legend()
    measures = [("top-1 agreement", "top1"), ("identical answers", "identical_answers")]
    if result["env"]:
        measures.append((f"{result['env']} reward", "reward"))
    width = 0.8 / max(len(formats), 1)
    for i, fmt in enumerate(formats):
        r = result["formats"][fmt]
        values = [r.get(key, 0.0) for _, key in measures]
        right.bar([j + i * width for j in range(len(measures))], values, width,
                  label=f"{fmt} (KL {r['kl_mean']:.1e} nats/token)")
    if result["env"] and result["reference_reward"] is not None:
        right.axhline(result["reference_reward"], color="gray", linestyle="--", label="float32 reward")
    right.set_xticks([j + width * (len(formats) - 1) / 2 for j in range(len(measures))], [m for m, _ in measures])
    right.set_ylim(0, 1.05)
    right.set_title(f"{result['model']}: each format against float32")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
