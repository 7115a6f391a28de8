"""Check README.md and docs/**/*.md against the code: one `path:line: message` per problem.

- every `specrl ...` command in code (inline spans, fenced blocks) names real subcommands and flags
  of `specrl.apps.cli.build_parser()`;
- every relative link and image resolves to a file or folder, and `file.md#anchor` to a heading of it;
- README's results block equals what `tools/results_table.py` generates from docs/results/*.json.

    python tools/docs_check.py [--root DIR]     # exit 1 on any problem
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path
from urllib.parse import unquote

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_table import BEGIN, END, RESULTS, ROOT, ResultsError, build_table, find_block  # noqa: E402

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
# A code span: a run of backticks up to the same run; it may wrap lines but not cross a blank line.
SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:[^\n]|\n(?![ \t]*\n))+?)(?<!`)\1(?!`)")
# The command `specrl` then a word: not `specrl.apps`, `specrl/...`, `specrl_metric`, `specrl:`.
COMMAND = re.compile(r"(?<![\w.\-])specrl\s+(?=-|[A-Za-z])")
SHELL_END = re.compile(r"\s[|&;<>#]|\s\d>|;")  # a shell pipe, list, redirect or comment ends the command
WORD = re.compile(r"[a-z][a-z0-9-]*")
FLAG = re.compile(r"^[\[(\"']*(--?[A-Za-z][\w-]*)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>\n]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"
                  r"(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:[ \t]*(<[^>\n]*>|\S+)", re.MULTILINE)
HTML_LINK = re.compile(r"<(?:img|a)\s[^>]*?(?:src|href)=\"([^\"]+)\"")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")


class Doc:
    """One Markdown file split into code and prose, line numbers kept (1-based)."""

    def __init__(self, path: Path, root: Path):
        self.path, self.name = path, path.relative_to(root).as_posix()
        lines = path.read_text(encoding="utf-8").splitlines()
        self.code: list[tuple[int, str]] = []  # fenced lines, `\`-continued lines joined
        prose, fence, pending = [], None, None
        for number, line in enumerate(lines, 1):
            opened = FENCE.match(line)
            if fence is None and opened:
                fence = opened.group(1)
            elif fence is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            elif fence is not None:
                start, text = pending or (number, "")
                text += line
                pending = (start, text[:-1] + " ") if line.endswith("\\") else None
                if pending is None:
                    self.code.append((start, text))
            prose.append(line if fence is None and not opened else "")
        self.prose = "\n".join(prose)
        self.spans = [(m.start(2), m.group(2)) for m in SPAN.finditer(self.prose)]
        # Prose with the code spans blanked out (newlines kept): where links are looked for.
        self.text = SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), self.prose)

    def line_of(self, offset: int) -> int:
        return self.prose.count("\n", 0, offset) + 1


# ---- commands ---------------------------------------------------------------------------------
def commands(doc: Doc) -> list[tuple[int, str]]:
    """(line, words after `specrl`) of every command shown in code."""
    found = []
    places = [(doc.line_of(offset), text) for offset, text in doc.spans] + doc.code
    for line, text in places:
        for m in COMMAND.finditer(text):
            rest = text[m.end():].replace("\\|", "|")
            rest = SHELL_END.split(rest, maxsplit=1)[0].replace("\n", " ")
            found.append((line + text.count("\n", 0, m.start()), rest))
    return found


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def check_command(parser: argparse.ArgumentParser, rest: str) -> list[str]:
    """Problems of `specrl <rest>`: walk the subparsers by the leading words, then check each flag."""
    try:
        words = shlex.split(rest)
    except ValueError:  # an unbalanced quote in prose
        words = rest.split()
    path = ["specrl"]
    while words and (subs := subcommands(parser)) and WORD.fullmatch(words[0]):
        if words[0] not in subs:
            known = ", ".join(sorted(subs))
            return [f"unknown command `{' '.join(path)} {words[0]}` (known: {known})"]
        parser = subs[words[0]]
        path.append(words.pop(0))
    problems = []
    for word in words:
        flag = FLAG.match(word)
        if flag and flag.group(1) not in parser._option_string_actions:
            problems.append(f"unknown flag {flag.group(1)} for `{' '.join(path)}`")
    return problems


# ---- links ------------------------------------------------------------------------------------
def links(doc: Doc) -> list[tuple[int, str]]:
    """(line, target) of every link, image, reference definition and HTML src/href outside code."""
    found = []
    for pattern in (LINK, REFERENCE, HTML_LINK):
        found += [(m.start(1), m.group(1)) for m in pattern.finditer(doc.text)]
    return [(doc.line_of(offset), target) for offset, target in sorted(found)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lowercase, punctuation but `-`/`_` dropped, spaces to `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Doc) -> set[str]:
    """The anchors of a file's headings (ATX and setext), repeats numbered `-1`, `-2` as GitHub does."""
    lines, seen, found = doc.prose.splitlines(), {}, set()
    for i, line in enumerate(lines):
        atx = HEADING.match(line)
        setext = i > 0 and lines[i - 1].strip() and re.fullmatch(r" {0,3}(=+|-+)[ \t]*", line)
        text = atx.group(2) if atx else lines[i - 1] if setext else None
        if text is None or (setext and HEADING.match(lines[i - 1])):
            continue
        base = slug(text)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    found |= set(re.findall(r"<a\s[^>]*?(?:name|id)=\"([^\"]+)\"", doc.text))
    return found


def check_link(doc: Doc, root: Path, target: str, docs: dict[Path, Doc]) -> str | None:
    target = target[1:-1] if target.startswith("<") else target
    if not target or target.startswith("#") or SCHEME.match(target):
        return None
    where, _, anchor = target.partition("#")
    where = unquote(where.partition("?")[0])
    dest = (root / where.lstrip("/")) if where.startswith("/") else (doc.path.parent / where)
    if not dest.exists():
        return f"broken link {target}: no such file or folder"
    if anchor and dest.is_file() and dest.suffix == ".md":
        dest = dest.resolve()
        if dest not in docs:
            docs[dest] = Doc(dest, dest.parent)
        if unquote(anchor) not in anchors(docs[dest]):
            return f"broken link {target}: no heading with anchor #{anchor} in {where}"
    return None


# ---- results table ----------------------------------------------------------------------------
def check_results(root: Path) -> list[tuple[str, int, str]]:
    """README's block against the generated table; nothing to check without reports or markers."""
    readme = root / "README.md"
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    if not any((root / RESULTS).glob("*.json")) and BEGIN not in text and END not in text:
        return []
    try:
        table = build_table(root)
        begin, end = find_block(text)
    except ResultsError as exc:
        return [(exc.path, exc.line, exc.message)]
    lines = text.splitlines()
    block, first = lines[begin + 1:end], begin + 1
    while block and not block[0].strip():
        block, first = block[1:], first + 1
    while block and not block[-1].strip():
        block = block[:-1]
    if block == table:
        return []
    i = next((i for i, (a, b) in enumerate(zip(block, table)) if a != b), min(len(block), len(table)))
    return [("README.md", first + i + 1, f"results table differs from {RESULTS.as_posix()}/*.json "
             f"(run python tools/results_table.py --write)")]


# ---- main -------------------------------------------------------------------------------------
def check(root: Path) -> tuple[list[tuple[str, int, str]], str]:
    """All problems (path, line, message) under `root`, and a count of what was checked."""
    from specrl.apps.cli import build_parser

    parser = build_parser()
    paths = [p for p in [root / "README.md"] if p.is_file()] + sorted((root / "docs").rglob("*.md"))
    docs = {p.resolve(): Doc(p, root) for p in paths}
    problems, n_commands, n_links = [], 0, 0
    for doc in list(docs.values())[: len(paths)]:
        for line, rest in commands(doc):
            n_commands += 1
            problems += [(doc.name, line, message) for message in check_command(parser, rest)]
        for line, target in links(doc):
            n_links += 1
            message = check_link(doc, root, target, docs)
            if message:
                problems.append((doc.name, line, message))
    problems += check_results(root)
    return sorted(problems, key=lambda p: p[:2]), f"{len(paths)} files, {n_commands} commands, {n_links} links"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: the parent of tools/)")
    root = parser.parse_args(argv).root
    problems, checked = check(root)
    for path, line, message in problems:
        print(f"{path}:{line}: {message}")
    print(f"docs_check: {len(problems)} problem{'s' * (len(problems) != 1)} ({checked})" if problems
          else f"docs_check: ok ({checked})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
