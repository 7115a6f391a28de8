"""tools/docs_check.py and tools/results_table.py against small fixture trees, and the real docs against the code."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def load(name: str):
    """A tool as a module, registered under its own name (docs_check imports results_table so)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


results_table = load("results_table")
docs_check = load("docs_check")

REPORT = {"date": "2026-01-01", "machine": "Test CPU", "rows": [
    {"order": 20, "what": "Adapt, acceptance", "result": "1.9 | 2.1", "command": "specrl bench adapt --minutes 10"},
    {"order": 10, "what": "Engine, tok/s", "result": "40.2", "command": "specrl bench engine --threads 2"},
]}
TABLE = """\
| What | Result | Measured on | Reproduce |
|---|---|---|---|
| Engine, tok/s | 40.2 | [Test CPU, 2026-01-01](docs/results/2026-01-01-test-cpu.md) | `specrl bench engine --threads 2` |
| Adapt, acceptance | 1.9 \\| 2.1 | [Test CPU, 2026-01-01](docs/results/2026-01-01-test-cpu.md) | \
`specrl bench adapt --minutes 10` |
"""
README = f"""\
# Fixture

Run `specrl bench engine --threads 2`, or see [the notes](docs/x.md#first-steps-1) and [docs](docs/).

| Command | What |
|---|---|
| `specrl rl --env arithmetic\\|code [--minutes M] [--threads=2]` | the RL loop |

```sh
$ specrl serve --port 8000 \\
    --drafter none | tee log.txt
```

## Results

<!-- results:begin -->

{TABLE}
<!-- results:end -->

After the table.
"""
NOTES = """\
# Notes

## First steps

## First steps

Prose only: specrl is a service; `specrl.apps.cli`, `specrl/apps/cli.py`, `specrl_tokens_total`, `specrl: error`.
Back to [the README](../README.md#results), ![a plot](results/2026-01-01-test-cpu.md), [here](#anything),
[away](https://example.com/missing.md), `specrl generate "a prompt" --seed 3 --no-chat` and
`SPECRL_HOME=~/.specrl specrl up --demo`.
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "README.md").write_text(README)
    (tmp_path / "docs" / "x.md").write_text(NOTES)
    (tmp_path / "docs" / "results" / "2026-01-01-test-cpu.md").write_text("# 2026-01-01, Test CPU\n")
    (tmp_path / "docs" / "results" / "2026-01-01-test-cpu.json").write_text(json.dumps(REPORT))
    return tmp_path


def check(root: Path, capsys) -> tuple[int, list[str]]:
    code = docs_check.main(["--root", str(root)])
    return code, capsys.readouterr().out.splitlines()


def append(path: Path, text: str) -> int:
    """Append `text` as one line; its line number."""
    lines = path.read_text().splitlines() + [text]
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def test_clean_tree_passes(tree, capsys):
    code, out = check(tree, capsys)
    assert out[-1].startswith("docs_check: ok (3 files, ") and code == 0, out


def test_clean_tree_passes_as_a_script(tree):
    done = subprocess.run([sys.executable, str(TOOLS / "docs_check.py"), "--root", str(tree)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_table_is_generated_sorted_and_escaped(tree, capsys):
    assert results_table.main(["--root", str(tree)]) == 0
    assert capsys.readouterr().out == TABLE


def test_unknown_flag_is_reported_with_file_and_line(tree, capsys):
    append(tree / "docs" / "x.md", "```")
    line = append(tree / "docs" / "x.md", "specrl bench engine --threads 2 --no-such-flag")
    append(tree / "docs" / "x.md", "```")
    code, out = check(tree, capsys)
    assert code == 1
    assert out[:-1] == [f"docs/x.md:{line}: unknown flag --no-such-flag for `specrl bench engine`"]
    assert out[-1].startswith("docs_check: 1 problem (")


def test_unknown_flag_in_a_table_cell_is_reported(tree, capsys):
    line = append(tree / "README.md", "| `specrl serve [--backend native\\|vllm] [--bogus X]` | serve |")
    code, out = check(tree, capsys)
    assert code == 1 and out[:-1] == [f"README.md:{line}: unknown flag --bogus for `specrl serve`"]


def test_unknown_subcommand_is_reported(tree, capsys):
    line = append(tree / "docs" / "x.md", "Then `specrl frobnicate --fast` and `specrl bench nothing`.")
    code, out = check(tree, capsys)
    assert code == 1
    assert out[0].startswith(f"docs/x.md:{line}: unknown command `specrl frobnicate` (known: ")
    assert out[1].startswith(f"docs/x.md:{line}: unknown command `specrl bench nothing` (known: ")
    assert len(out) == 3


def test_broken_link_and_anchor_are_reported(tree, capsys):
    link = append(tree / "docs" / "x.md", "See [gone](results/missing.md) and ![img](../plot.png).")
    anchor = append(tree / "docs" / "x.md", "And [there](../README.md#no-such-heading).")
    code, out = check(tree, capsys)
    assert code == 1
    assert out[:-1] == [f"docs/x.md:{link}: broken link results/missing.md: no such file or folder",
                        f"docs/x.md:{link}: broken link ../plot.png: no such file or folder",
                        f"docs/x.md:{anchor}: broken link ../README.md#no-such-heading: "
                        "no heading with anchor #no-such-heading in ../README.md"]


def test_stale_table_is_reported_and_write_fixes_it(tree, capsys):
    readme = tree / "README.md"
    readme.write_text(readme.read_text().replace("| 40.2 |", "| 41.0 |"))
    code, out = check(tree, capsys)
    stale = readme.read_text().splitlines().index(TABLE.splitlines()[2].replace("40.2", "41.0")) + 1
    assert code == 1 and out[:-1] == [f"README.md:{stale}: results table differs from docs/results/*.json "
                                      "(run python tools/results_table.py --write)"]

    assert results_table.main(["--root", str(tree), "--write"]) == 0
    assert readme.read_text() == README  # the block rewritten, the rest kept
    code, out = check(tree, capsys)
    assert code == 0, out


def test_new_report_needs_write(tree, capsys):
    report = dict(REPORT, date="2026-01-02", rows=[dict(REPORT["rows"][1], order=5)])
    (tree / "docs" / "results" / "2026-01-02-other.json").write_text(json.dumps(report))
    (tree / "docs" / "results" / "2026-01-02-other.md").write_text("# Other\n")
    assert check(tree, capsys)[0] == 1
    assert results_table.main(["--root", str(tree), "--write"]) == 0
    assert "[Test CPU, 2026-01-02](docs/results/2026-01-02-other.md)" in (tree / "README.md").read_text()
    assert check(tree, capsys)[0] == 0


def test_a_superseded_row_leaves_the_table_and_must_name_a_real_entry(tree, capsys):
    path = tree / "docs" / "results" / "2026-01-01-test-cpu.json"
    (tree / "docs" / "results" / "2026-01-02-other.md").write_text("# Other\n")
    path.write_text(json.dumps(dict(REPORT, rows=[dict(REPORT["rows"][0], superseded_by="2026-01-02-other"),
                                                  REPORT["rows"][1]])))
    assert results_table.main(["--root", str(tree)]) == 0
    table = capsys.readouterr().out
    assert "Engine, tok/s" in table and "Adapt, acceptance" not in table
    path.write_text(json.dumps(dict(REPORT, rows=[dict(REPORT["rows"][0], superseded_by="2026-01-09-none")])))
    assert results_table.main(["--root", str(tree)]) == 1
    assert "rows[0].superseded_by: no dated entry 2026-01-09-none.md" in capsys.readouterr().err


def test_malformed_report_is_one_clear_error(tree, capsys):
    path = tree / "docs" / "results" / "2026-01-01-test-cpu.json"
    path.write_text(json.dumps({"date": "2026-01-01", "machine": "Test CPU"}))
    assert results_table.main(["--root", str(tree)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        'results_table: error: docs/results/2026-01-01-test-cpu.json: rows: expected a non-empty list of '
        '{"order", "what", "result", "command"}, missing']
    code, out = check(tree, capsys)
    assert code == 1 and out[0].startswith("docs/results/2026-01-01-test-cpu.json:1: rows: expected ")


@pytest.mark.parametrize("row, field", [({"order": "10"}, "rows[0].order"), ({"what": ""}, "rows[0].what"),
                                        ({"command": None}, "rows[0].command")])
def test_bad_row_field_is_named(tree, capsys, row, field):
    path = tree / "docs" / "results" / "2026-01-01-test-cpu.json"
    path.write_text(json.dumps(dict(REPORT, rows=[dict(REPORT["rows"][0], **row)])))
    assert results_table.main(["--root", str(tree)]) == 1
    assert f"2026-01-01-test-cpu.json: {field}: expected " in capsys.readouterr().err


def test_write_without_markers_is_an_error(tree, capsys):
    readme = tree / "README.md"
    readme.write_text(readme.read_text().replace("<!-- results:end -->\n", ""))
    assert results_table.main(["--root", str(tree), "--write"]) == 1
    assert "README.md: needs one line <!-- results:begin -->" in capsys.readouterr().err
    assert check(tree, capsys)[1][0].startswith("README.md:1: needs one line <!-- results:begin -->")


def test_the_repository_docs_pass(capsys):
    """README.md and docs/ as committed: `make docs-check` runs this before pytest; here it also guards a bare
    `pytest` run (a renamed flag or file, a report edited without regenerating the table)."""
    code, out = check(TOOLS.parent, capsys)
    assert code == 0, "\n".join(out)
