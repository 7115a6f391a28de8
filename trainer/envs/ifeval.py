"""IFEval: follow verifiable instructions ("answer in under 100 words", "no commas", "wrap it in JSON").

Held-out split: IFEval's official 541 prompts (834 instructions, 25 kinds), verbatim, scored by the official
checkers (`ifeval_checks`), drawn in a seeded order (every prompt once per pass), so `--tasks N` is a seeded subset
and 541 is all of them. They are never trained on.

Train split: never IFEval's prompts. The project's own train prompts (`specrl.data.prompts`: code, math, chat,
structured requests), each followed by 1-3 instructions written by IFEval's registry (`build_description` with
arguments drawn from a seed per task: "Answer with less than 168 words."), never two the registry says conflict.
The kinds are drawn by TRAIN_WEIGHTS: toward the kinds the base model follows sometimes, where a group of samples
can differ (GRPO learns nothing from a group whose rewards are all equal).

Score: per instruction the strict and the loose verdict (`details["strict"]`, `details["loose"]`, in the order of
`details["instruction_ids"]`); reward = the fraction followed strictly (so reward 1.0 is "prompt-level strict"). An
empty response, an unknown instruction id, or checker data that cannot be found score 0 with the reason in `error`.

`summarize` gives what the IFEval paper reports, per version: prompt-level and instruction-level accuracy, strict
and loose, each with a 95% CI, and against the first version the paired tests (`significance`): McNemar on prompts
(prompt level), a paired bootstrap over prompts on instructions (instruction level).
"""

from __future__ import annotations

import random
from typing import Iterator

from specrl.data.prompts import load_prompts
from specrl.trainer.envs.base import Score, Task, check_split, task_id
from specrl.trainer.envs.ifeval_checks import (CheckerDataMissing, conflicts, describe, follows, instruction_ids,
                                               load_rows)
from specrl.trainer.significance import Z95, bootstrap_rate, mcnemar, paired_bootstrap

METRICS = ("prompt_strict", "prompt_loose", "instruction_strict", "instruction_loose")
NAMES = {"prompt_strict": "prompt-level strict", "prompt_loose": "prompt-level loose",
         "instruction_strict": "instruction-level strict", "instruction_loose": "instruction-level loose"}

# SmolLM2-135M-Instruct's greedy strict rate per instruction kind on the 541 held-out prompts (bfloat16, 256 tokens;
# docs/results/2026-12-06-xeon-amx-ifeval-base.md). A kind is drawn for training with weight 1 - p^G - (1 - p)^G,
# the chance that a group of G = 4 samples is not flat if each follows it with probability p (greedy p stands in for
# the sampled one), at least MIN_TRAIN_WEIGHT so that no kind is never seen: other models keep this mix.
BASE_STRICT_RATES = {
    "length_constraints:number_sentences": 0.60,
    "detectable_format:title": 0.59,
    "detectable_content:postscript": 0.58,
    "detectable_format:multiple_sections": 0.57,
    "keywords:forbidden_words": 0.47,
    "keywords:letter_frequency": 0.42,
    "detectable_format:number_highlighted_sections": 0.42,
    "change_case:capital_word_frequency": 0.40,
    "punctuation:no_comma": 0.38,
    "keywords:frequency": 0.33,
    "keywords:existence": 0.28,
    "length_constraints:number_words": 0.27,
    "detectable_content:number_placeholders": 0.26,
    "language:response_language": 0.26,
    "detectable_format:constrained_response": 0.20,
    "detectable_format:number_bullet_lists": 0.19,
    "startend:end_checker": 0.15,
    "length_constraints:number_paragraphs": 0.07,
    "detectable_format:json_format": 0.06,
    "combination:two_responses": 0.04,
    "change_case:english_capital": 0.00,
    "change_case:english_lowercase": 0.00,
    "combination:repeat_prompt": 0.00,
    "length_constraints:nth_paragraph_first_word": 0.00,
    "startend:quotation": 0.00,
}
GROUP, MIN_TRAIN_WEIGHT = 4, 0.05
TRAIN_WEIGHTS = {kind: max(1 - p ** GROUP - (1 - p) ** GROUP, MIN_TRAIN_WEIGHT) for kind, p in BASE_STRICT_RATES.items()}


class IFEvalEnv:
    name = "ifeval"
    max_tokens = 256          # the base measured in the issue: 256 new tokens
    timeout_s = 30.0          # langdetect on a long answer is the slow check

    def __init__(self, rows: list[dict] | None = None):
        """`rows`: IFEval-shaped rows instead of the official ones (tests)."""
        self._given = rows

    def rows(self) -> list[dict]:
        return list(self._given if self._given is not None else load_rows()[0])

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        check_split(split)
        rng = random.Random(f"ifeval/{split}/{seed}")
        if split == "train":
            yield from self._train_tasks(rng)   # endless
            return
        rows = self.rows()
        while True:
            for row in rng.sample(rows, len(rows)):   # every prompt once per pass
                yield Task(task_id("ifeval", row["prompt"]), row["prompt"], split,
                           {"key": row["key"], "instruction_ids": list(row["instruction_id_list"]),
                            "kwargs": [dict(k) for k in row["kwargs"]]})

    def _train_tasks(self, rng: random.Random) -> Iterator[Task]:
        prompts = load_prompts(split="train")
        clash = conflicts()
        while True:
            base = rng.choice(prompts)
            wanted, chosen = rng.choices((1, 2, 3), weights=(0.5, 0.35, 0.15))[0], []
            while len(chosen) < wanted:
                allowed = [k for k in TRAIN_WEIGHTS if not any(k in clash.get(c, {c}) or c in clash.get(k, {k})
                                                               for c in chosen)]
                if not allowed:        # json_format, say, goes with few others
                    break
                chosen += rng.choices(allowed, weights=[TRAIN_WEIGHTS[k] for k in allowed])
            described = [describe(kind, rng.getrandbits(32), base.text) for kind in chosen]
            prompt = " ".join([base.text, *(text for text, _ in described)])
            yield Task(task_id("ifeval", prompt), prompt, "train",
                       {"key": base.id, "instruction_ids": chosen, "kwargs": [args for _, args in described]})

    def score(self, task: Task, completion: str) -> Score:
        ids, kwargs = task.data["instruction_ids"], task.data["kwargs"]
        missed = {"instruction_ids": ids, "strict": [False] * len(ids), "loose": [False] * len(ids)}
        if not completion.strip():
            return Score(0.0, missed, "empty response")
        try:
            unknown = sorted(set(ids) - set(instruction_ids()))
            if unknown:
                return Score(0.0, missed, f"unknown IFEval instruction id(s): {', '.join(unknown)}")
            strict, loose = follows(ids, kwargs, task.prompt, completion)
        except (CheckerDataMissing, LookupError) as exc:
            return Score(0.0, missed, f"IFEval checker data missing: {str(exc).strip().splitlines()[0][:300]}")
        return Score(sum(strict) / len(ids) if ids else 0.0,
                     {"instruction_ids": ids, "strict": strict, "loose": loose})

    def summarize(self, tasks: list[Task], scores: dict[str, list[Score]]) -> tuple[dict, list[str]]:
        """Per version (the first is the reference) the four IFEval accuracies with 95% CIs and the paired tests
        against the first, on `tasks` (scores[version][i] is tasks[i]'s) -> (the report's entry, table lines).
        A score without verdicts (a scorer that failed) counts every instruction of its task as not followed."""
        def verdict(task: Task, score: Score, way: str) -> list[bool]:
            return list(score.details.get(way) or [False] * len(task.data["instruction_ids"]))

        verdicts = {version: {way: [verdict(t, s, way) for t, s in zip(tasks, version_scores)]
                              for way in ("strict", "loose")}
                    for version, version_scores in scores.items()}
        versions = list(verdicts)
        first = verdicts[versions[0]]
        report: dict = {}
        for version in versions:
            entry = report[version] = {}
            for metric in METRICS:
                level, way = metric.split("_")
                items, reference = verdicts[version][way], first[way]
                if level == "prompt":
                    passed = [all(v) for v in items]
                    value = sum(passed) / len(passed)
                    entry[metric] = {"value": value, "ci95": Z95 * (value * (1 - value) / len(passed)) ** 0.5}
                    if version != versions[0]:
                        entry[metric]["vs_first"] = mcnemar([all(v) for v in reference], passed)
                else:
                    alone = bootstrap_rate(items)
                    entry[metric] = {"value": alone["rate"], "ci95": (alone["ci95"][1] - alone["ci95"][0]) / 2}
                    if version != versions[0]:
                        entry[metric]["vs_first"] = paired_bootstrap(reference, items)
            entry["by_instruction"] = by_instruction(tasks, verdicts[version])
        return report, table_lines(report, len(first["strict"]))


def by_instruction(tasks: list[Task], verdicts: dict[str, list[list[bool]]]) -> dict[str, dict]:
    """Per instruction kind: how often it was asked and the share followed, strict and loose."""
    kinds: dict[str, dict] = {}
    for task, strict, loose in zip(tasks, verdicts["strict"], verdicts["loose"]):
        for kind, s, lo in zip(task.data["instruction_ids"], strict, loose):
            entry = kinds.setdefault(kind, {"n": 0, "strict": 0, "loose": 0})
            entry["n"], entry["strict"], entry["loose"] = entry["n"] + 1, entry["strict"] + s, entry["loose"] + lo
    return {kind: {"n": e["n"], "strict": e["strict"] / e["n"], "loose": e["loose"] / e["n"]}
            for kind, e in sorted(kinds.items())}


def table_lines(report: dict, prompts: int) -> list[str]:
    """The four metrics down, versions across, then each later version's paired difference [95% CI] and p."""
    versions = list(report)
    header = [f"{'IFEval, ' + str(prompts) + ' prompts':<26}", *(f"{v:>16}" for v in versions),
              *(f"{v + ' - ' + versions[0]:>30}" for v in versions[1:])]
    lines = ["  ".join(header)]
    for metric in METRICS:
        cells = [f"{report[v][metric]['value']:.3f} +- {report[v][metric]['ci95']:.3f}".rjust(16) for v in versions]
        for version in versions[1:]:
            paired = report[version][metric]["vs_first"]
            low, high = paired["ci95"]
            cells.append(f"{paired['diff']:+.3f} [{low:+.3f}, {high:+.3f}] p={paired['p_value']:.2g}".rjust(30))
        lines.append("  ".join([f"{NAMES[metric]:<26}", *cells]))
    return lines
