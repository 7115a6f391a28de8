"""The README's results table, made from the JSON reports in `docs/results/*.json`.

Each report sits beside a dated Markdown entry with the same stem (`2026-12-04-epyc.json` beside
`2026-12-04-epyc.md`) and holds `{"date", "machine", "rows": [{"order", "what", "result", "command"}]}`.
A row measured again later keeps its place in its report with `"superseded_by": "<the later entry's stem>"`
and leaves the table, whose rows are the current figures. The README keeps the table between
`<!-- results:begin -->` and `<!-- results:end -->`.

    python tools/results_table.py           # print the table
    python tools/results_table.py --write   # rewrite README.md's block in place
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("docs/results")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
HEADER = ["| What | Result | Measured on | Reproduce |", "|---|---|---|---|"]
ROW_FIELDS = {"order": int, "what": str, "result": str, "command": str}


class ResultsError(ValueError):
    """A report or README that cannot make the table; `path` and `line` say where, the message what."""

    def __init__(self, path: str, message: str, line: int = 1):
        super().__init__(f"{path}: {message}")
        self.path, self.line, self.message = path, line, message


def load_report(path: Path, root: Path) -> dict:
    """One report, validated: a bad file raises `ResultsError` naming the file and the field."""
    name = path.relative_to(root).as_posix()
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ResultsError(name, f"not JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})", exc.lineno) from None
    if not isinstance(report, dict):
        raise ResultsError(name, 'expected an object {"date", "machine", "rows"}')
    _text(name, report, "date", "date")
    try:
        datetime.date.fromisoformat(report["date"])
    except ValueError:
        raise ResultsError(name, f'date: expected YYYY-MM-DD, got "{report["date"]}"') from None
    _text(name, report, "machine", "machine")
    rows = report.get("rows")
    if not isinstance(rows, list) or not rows:
        got = "missing" if rows is None else f"got {json.dumps(rows)[:40]}"
        raise ResultsError(name, f'rows: expected a non-empty list of {{"order", "what", "result", "command"}}, {got}')
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ResultsError(name, f"rows[{i}]: expected an object, got {json.dumps(row)[:40]}")
        order = row.get("order")
        if not isinstance(order, int) or isinstance(order, bool):
            raise ResultsError(name, f"rows[{i}].order: expected an integer, got {json.dumps(order)}")
        for field in ("what", "result", "command"):
            _text(name, row, field, f"rows[{i}].{field}")
        if "superseded_by" in row:
            _text(name, row, "superseded_by", f"rows[{i}].superseded_by")
            if not (path.parent / f"{row['superseded_by']}.md").is_file():
                raise ResultsError(name, f"rows[{i}].superseded_by: no dated entry {row['superseded_by']}.md")
    entry = path.with_suffix(".md")
    if not entry.is_file():
        raise ResultsError(name, f"no dated entry {entry.relative_to(root).as_posix()} beside it")
    return report


def _text(name: str, obj: dict, key: str, field: str) -> None:
    value = obj.get(key)
    if not isinstance(value, str) or not value.strip() or "\n" in value:
        got = "missing" if key not in obj else f"got {json.dumps(value)[:40]}"
        raise ResultsError(name, f"{field}: expected a non-empty one-line string, {got}")


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def build_table(root: Path) -> list[str]:
    """The table's lines (header first), one row per report row not superseded, sorted by (order, what)."""
    rows = []
    for path in sorted((root / RESULTS).glob("*.json")):
        report = load_report(path, root)
        measured = f"[{cell(report['machine'])}, {report['date']}]({(RESULTS / path.stem).as_posix()}.md)"
        for row in (r for r in report["rows"] if "superseded_by" not in r):
            line = f"| {cell(row['what'])} | {cell(row['result'])} | {measured} | `{cell(row['command'])}` |"
            rows.append((row["order"], row["what"], line))
    return HEADER + [line for _, _, line in sorted(rows)]


def find_block(text: str, path: str = "README.md") -> tuple[int, int]:
    """Line indexes (0-based) of the begin and end markers; `ResultsError` when they are missing."""
    lines = text.splitlines()
    begins = [i for i, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        raise ResultsError(path, f"needs one line {BEGIN} and, after it, one line {END} around the results table")
    return begins[0], ends[0]


def write_block(root: Path) -> bool:
    """Rewrite README.md's block with the generated table; True when the file changed."""
    readme = root / "README.md"
    if not readme.is_file():
        raise ResultsError("README.md", f"not found under {root}")
    text = readme.read_text(encoding="utf-8")
    begin, end = find_block(text)
    lines = text.splitlines()
    new = "\n".join(lines[: begin + 1] + ["", *build_table(root), ""] + lines[end:]) + "\n"
    if new == text:
        return False
    readme.write_text(new, encoding="utf-8")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite README.md's results block in place")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: the parent of tools/)")
    args = parser.parse_args(argv)
    try:
        if args.write:
            changed = write_block(args.root)
            print(f"README.md: results table {'rewritten' if changed else 'already up to date'}")
        else:
            print("\n".join(build_table(args.root)))
    except ResultsError as exc:
        print(f"results_table: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
