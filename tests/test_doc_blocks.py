"""The ``pipeloom`` commands the documentation shows run as written.

Oracle: the pages themselves. Every ``pipeloom ...`` line in a fenced block of README.md and
docs/*.md is either run here (in a scratch folder, ``examples/`` beside it, files a block shows with
``$ cat FILE`` written first) or named in :data:`SKIPPED` with the reason. A command succeeds (exit
0) unless the lines it shows start with ``pipeloom: error:``: then it must fail with exactly that
line. Shown output is compared where it is stable: JSON objects as values, table lines verbatim.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeloom.cli import main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SKIPPED = {
    "pipeloom profile ": "profiles a model with torch (tens of seconds)",
    "pipeloom plan --costs costs.json": "needs the costs.json a profile writes",
    "pipeloom plan --costs gpt_cpu_b1.json": "needs two measured cost tables",
    "pipeloom trace ": "needs a trace folder written by a torchrun training run",
    "pipeloom plan --model benchmarks/": "reads a config from the repository's benchmarks/data/configs (the command "
                                        "runs in tests/plan/cluster/test_runtime_plan.py)",
    "pipeloom search --placement NAME": "a synopsis (NAME, D, M are placeholders)",
    "pipeloom search --problem problem.json --microbatches M": "a synopsis (M, L, C are placeholders)",
    "pipeloom search --placement mshape --ranks 8 --microbatches 128": "a benchmark run (--time-limit 10)",
    "pipeloom search --placement linear --ranks 32": "a benchmark run (--time-limit 30)",
}
"""Commands not run, by the start of their text, with the reason."""

STALE: dict[str, str] = {}
"""Blocks whose shown output the code no longer prints: the page needs updating (strict: once it is, the
entry must go)."""


@dataclass
class Command:
    page: str
    line: int
    text: str
    shown: list[str]
    """The lines the page shows after the command, up to the next command or the block's end."""
    files: dict[str, str]
    """Files the block showed before the command (``$ cat FILE`` and its lines)."""


def _blocks(path: Path):
    """(first line number, lines) of each fenced block of ``path`` that is not Python or JSON."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = None
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            if start is None:
                start, language = number, line[3:].strip()
            else:
                if language not in ("python", "json", "toml", "yaml"):
                    yield start + 1, lines[start:number - 1]
                start = None


def _commands() -> list[Command]:
    found = []
    for page in PAGES:
        for first, lines in _blocks(page):
            files: dict[str, str] = {}
            current = None
            i = 0
            while i < len(lines):
                line = lines[i]
                text = line[2:] if line.startswith("$ ") else line if line.startswith("pipeloom ") else None
                if text is None:
                    if current is not None:
                        current.shown.append(line)
                    i += 1
                    continue
                number = first + i
                while text.endswith("\\") and i + 1 < len(lines):  # a continued command line
                    i += 1
                    text = text[:-1] + lines[i].strip()
                i += 1
                current = None
                if text.startswith("cat "):
                    name, body = text[4:].strip(), []
                    while i < len(lines) and not lines[i].startswith("$ "):
                        body.append(lines[i])
                        i += 1
                    files[name] = "\n".join(body) + "\n"
                elif text.startswith("pipeloom "):
                    current = Command(str(page.relative_to(ROOT)), number, text.split("  #")[0].strip(), [],
                                      dict(files))
                    found.append(current)
    return found


COMMANDS = _commands()
RUN = [command for command in COMMANDS if not any(command.text.startswith(key) for key in SKIPPED)]


def test_the_pages_show_commands_and_every_skip_is_used():
    assert len(RUN) >= 8, [command.text for command in RUN]
    for key in SKIPPED:
        assert any(command.text.startswith(key) for command in COMMANDS), f"{key!r} skipped but not in the docs"


@pytest.mark.parametrize("command", RUN, ids=[f"{c.page}:{c.line}" for c in RUN])
def test_a_documented_command_runs_as_shown(command, tmp_path, monkeypatch, capsys, request):
    where = f"{command.page}:{command.line}"
    if where in STALE:
        request.applymarker(pytest.mark.xfail(reason=STALE[where], strict=True))
    for name, text in command.files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "120")
    code = main(shlex.split(command.text)[1:])
    out, err = capsys.readouterr()
    shown = [line.rstrip() for line in command.shown if line.strip()]
    if shown and shown[0].startswith("pipeloom: error:"):
        assert code != 0 and out == "", err
        assert err.strip().splitlines() == shown[:1]
        return
    assert code == 0, err
    if not shown:
        return
    if shown[0].startswith("{"):  # a JSON object, wrapped on the page
        expected = json.loads(" ".join(shown[:_json_end(shown)]))
        assert json.loads(out) == expected
        return
    actual = {line.rstrip() for line in out.splitlines()}
    missing = [line for line in shown if line not in actual and not _varies(line)]
    assert not missing, f"{command.page}:{command.line} shows lines the command does not print:\n" + "\n".join(
        missing)


def _json_end(lines: list[str]) -> int:
    """How many of ``lines`` the shown JSON object spans (up to its closing brace)."""
    depth = 0
    for count, line in enumerate(lines, 1):
        depth += line.count("{") - line.count("}")
        if depth == 0:
            return count
    return len(lines)


def _varies(line: str) -> bool:
    """Lines that differ between runs or machines: timings, written files, elisions."""
    return bool(re.search(r"seconds|\bwrote\b|\.\.\.|…|\(open it in", line))
