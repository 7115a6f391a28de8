"""IFEval: follow verifiable instructions ("answer in under 100 words", "no commas", "wrap it in JSON").

Held-out split: IFEval's official 541 prompts (834 instructions, 25 kinds), verbatim, scored by the official
checkers (`ifeval_checks`), drawn in a seeded order (every prompt once per pass), so `--tasks N` is a seeded subset
and 541 is all of them. They are never trained on.

Train split: not built yet (issue 47 step 2: the project's own prompts with constraints drawn from IFEval's
instruction registry); asking for it raises a one-line error.

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

from specrl.errors import SpecrlError
from specrl.trainer.envs.base import Score, Task, check_split, task_id
from specrl.trainer.envs.ifeval_checks import CheckerDataMissing, follows, instruction_ids, load_rows
from specrl.trainer.significance import Z95, mcnemar, paired_bootstrap

METRICS = ("prompt_strict", "prompt_loose", "instruction_strict", "instruction_loose")
NAMES = {"prompt_strict": "prompt-level strict", "prompt_loose": "prompt-level loose",
         "instruction_strict": "instruction-level strict", "instruction_loose": "instruction-level loose"}


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
        if split == "train":
            raise SpecrlError("ifeval has no training tasks yet (the project's prompts with IFEval constraints land "
                              "with `specrl rl --env ifeval`); `specrl eval-policy --env ifeval` uses the 541 "
                              "held-out prompts")
        rows = self.rows()
        rng = random.Random(f"ifeval/{split}/{seed}")
        while True:
            for row in rng.sample(rows, len(rows)):   # every prompt once per pass
                yield Task(task_id("ifeval", row["prompt"]), row["prompt"], split,
                           {"key": row["key"], "instruction_ids": list(row["instruction_id_list"]),
                            "kwargs": [dict(k) for k in row["kwargs"]]})

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
                    alone = paired_bootstrap([[False] * len(v) for v in items], items)  # the rate and its CI
                    entry[metric] = {"value": alone["diff"], "ci95": (alone["ci95"][1] - alone["ci95"][0]) / 2}
                    if version != versions[0]:
                        entry[metric]["vs_first"] = paired_bootstrap(reference, items)
        return report, table_lines(report, len(first["strict"]))


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
