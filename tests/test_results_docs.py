"""The measurements kept in docs/results/: dated entries, each indexed, none named by the occasion it was taken on.

A figure is worth keeping when a reader can tell when, on which CPU and with which command it was measured; "session
19" says none of that, so the tree outside tests/ must not number anything by occasion.
"""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
OCCASION = re.compile(r"[Ss]ession [0-9]")
ENTRY_NAME = re.compile(r"^\d{4}-\d{2}-\d{2}-[a-z0-9]+(-[a-z0-9]+)*\.md$")
HEADER_FIELDS = ("- **Machine**:", "- **Recorded in**:", "- **Commands**:")


def _project_files(root: Path) -> list[Path]:
    """The files git tracks or would track (build outputs, .venv and egg-info are ignored)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return [root / name for name in listed if (root / name).is_file()]


def occasion_numbered(files: list[Path], root: Path) -> list[str]:
    """`path:line` of every line outside tests/ that numbers something by occasion ("session 19")."""
    hits = []
    for path in files:
        relative = path.relative_to(root)
        if relative.parts[0] == "tests":
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary files (PNGs, built extensions)
        hits += [f"{relative}:{n}" for n, line in enumerate(text.splitlines(), 1) if OCCASION.search(line)]
    return hits


def test_nothing_outside_tests_is_numbered_by_occasion():
    assert occasion_numbered(_project_files(ROOT), ROOT) == []


def test_the_occasion_scan_finds_a_planted_line_and_skips_tests(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "docs" / "notes.md").write_text("fine\nmeasured in Session 7 on a Xeon\n")
    (tmp_path / "tests" / "test_x.py").write_text("# session 3 is allowed here\n")
    assert occasion_numbered(_project_files(tmp_path), tmp_path) == ["docs/notes.md:2"]


def test_every_dated_entry_is_named_by_date_and_machine_and_says_how_it_was_measured():
    entries = [p for p in RESULTS.glob("*.md") if p.name != "README.md"]
    assert len(entries) >= 10
    for entry in entries:
        assert ENTRY_NAME.match(entry.name), entry.name
        text = entry.read_text()
        assert text.startswith("# "), entry.name
        for field in HEADER_FIELDS:
            assert field in text, f"{entry.name} lacks {field}"
        assert re.search(r"`[0-9a-f]{7,40}`", text), f"{entry.name} names no commit"


def test_the_index_lists_every_entry_and_nothing_else():
    index = (RESULTS / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+\.md)\)", index))
    entries = {p.name for p in RESULTS.glob("*.md") if p.name != "README.md"}
    assert linked == entries
