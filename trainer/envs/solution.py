"""A model's code answer, for the environments that run it (`code`, `humaneval`): where the code is in a
completion, and the part of the sandbox harness that loads it.

    python_blocks(completion) -> [code, ...]       the ```python / ```py / bare ``` blocks
    defines(code, "f")                              whether a line starts `def f(`
    HARNESS_PRELUDE + harness                       a program for `sandbox.run_python`
    result_records(outcome.results) -> [dict, ...]  what the harness wrote, one JSON object a line

HARNESS_PRELUDE, run first in the sandboxed child, reads the job (JSON on stdin) into `_job`, opens the
results file as `_out`, and defines `_error(exc)` (a short, never-raising description), `_finish()`
(flush and exit at once, without running the code's atexit hooks) and `_load(prefix, code, function,
emit)`: the program `prefix + code`, compiled up to the code's line where it stops being Python (prose
after an unfenced answer, a cut-off reply), run in a fresh namespace -> (namespace, code lines kept);
when that fails (not even the first line compiles, the code raises, `function` is not defined) it
emits stage "load" with the error and finishes. Each harness defines its own `_emit`, then loads.
"""

from __future__ import annotations

import json
import re

MAX_CODE_CHARS = 32_000   # longer code scores 0 unrun

HARNESS_PRELUDE = r"""
import json, os, sys, traceback
_out = os.fdopen(int(sys.argv[1]), "w", buffering=1)
_job = json.loads(sys.stdin.read())
sys.stdin.close()
def _error(exc):
    try:
        return f"{type(exc).__name__}: {exc}"[:300]
    except BaseException:
        return type(exc).__name__
def _finish():                                # exit without running the code's atexit hooks
    for stream in (sys.stdout, sys.stderr, _out):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(0)
def _load(prefix, code, function, emit):
    lines, first = code.split("\n"), prefix.count("\n") + 1   # the program's line number of the code's first line
    try:
        while True:                           # compile up to the code's line where it stops being Python
            try:
                compiled = compile(prefix + "\n".join(lines), "solution.py", "exec")
                break
            except SyntaxError as exc:
                keep = (exc.lineno or 0) - first  # code lines before the one that broke
                if keep < 1 or len(lines) <= 1:
                    raise
                lines = lines[:min(keep, len(lines) - 1)]
        namespace = {"__name__": "solution"}
        exec(compiled, namespace)
        if not callable(namespace.get(function)):
            raise NameError(f"the code defines no function {function!r}")
    except BaseException as exc:
        emit(stage="load", error=_error(exc))
        _finish()
    return namespace, len(lines)
"""


def python_blocks(completion: str) -> list[str]:
    """The bodies of the completion's ```python (or ```py, or bare ```) blocks; an unclosed last one runs to the end."""
    return [body for lang, body in re.findall(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", completion, re.DOTALL)
            if lang.lower() in ("", "python", "py", "python3")]


def defines(code: str, function: str) -> bool:
    """Whether a line of `code` starts `def function(`."""
    return re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(function)}\s*\(", code, re.MULTILINE) is not None


def result_records(results: str) -> list[dict]:
    """The JSON objects of a results file, one a line (anything else skipped)."""
    records = []
    for line in results.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
