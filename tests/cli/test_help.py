"""`specrl --help`: every command once, one line each, under its group's heading, in the groups' order."""

import os
import subprocess
import sys

from specrl.apps.cli import COMMAND_GROUPS, build_parser, command_listing, commands_of

BASELINE_COMMANDS = {"fetch-model", "generate", "up", "rl", "eval-policy", "serve", "export-drafter", "train-drafter",
                     "bench", "admin"}


def _help(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "specrl.apps.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def _sections(text: str) -> list[tuple[str, list[str]]]:
    """The help's headings ("Serve:") and the lines indented under each, in order."""
    sections = []
    for line in text.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            sections.append((line[:-1], []))
        elif line.startswith("  ") and sections:
            sections[-1][1].append(line)
    return sections


def test_help_lists_every_command_once_under_its_group_in_order():
    proc = _help("--help")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "usage: specrl [-h] <command> ..."
    commands = commands_of(build_parser())
    sections = [(heading, body) for heading, body in _sections(proc.stdout) if heading != "options"]
    assert [heading for heading, _ in sections] == [heading for heading, _ in COMMAND_GROUPS]
    listed = []
    for (heading, body), (_, names) in zip(sections, COMMAND_GROUPS):
        assert [line.split()[0] for line in body] == list(names), heading
        for line in body:  # one line each, its text the command's own help=
            name = line.split()[0]
            assert line.split(None, 1)[1] == commands[name]
            listed.append(name)
    assert sorted(listed) == sorted(commands) and len(listed) == len(set(listed))


def test_no_command_prints_the_same_help_and_fails():
    proc = _help()
    assert proc.returncode == 2
    assert proc.stdout == _help("--help").stdout


def test_the_groups_table_names_exactly_the_registered_commands():
    """A command registered but not grouped (or grouped but gone) fails here."""
    grouped = [name for _, names in COMMAND_GROUPS for name in names]
    assert len(grouped) == len(set(grouped)), "a command in two groups"
    assert set(grouped) == set(commands_of(build_parser()))
    assert BASELINE_COMMANDS <= set(grouped)  # scripts and tests call these by name


def test_a_command_missing_from_the_table_is_listed_under_other_not_hidden():
    listing = command_listing({"serve": "serve it", "new-thing": "does something new"}, (("Serve", ("serve",)),))
    assert listing == "Serve:\n  serve      serve it\n\nOther:\n  new-thing  does something new"


def test_a_commands_own_help_is_unchanged():
    proc = _help("serve", "--help")
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: specrl serve [-h]") and "--max-batch" in proc.stdout
    proc = _help("bench", "engine", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: specrl bench engine [-h]")
