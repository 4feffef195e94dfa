"""Fenced blocks of the repository's Markdown, the markers that say how each is tested, and their comparison.

A marker is an HTML comment (invisible on GitHub) on the lines just above a fence; several may
stack. They are the whole vocabulary:

``<!-- not-run: REASON -->``
    The block is not executed here; the test suite reports it as skipped with REASON.
``<!-- needs: cuda:N -->`` / ``<!-- needs: no-cuda -->`` / ``<!-- needs: dot -->``
    Run only where N CUDA devices are visible / none is / Graphviz's ``dot`` is on the PATH;
    reported as skipped elsewhere.
``<!-- cuda-as-cpu -->``
    Run with every ``cuda:N`` in the block (and its setup) read as ``cpu:N`` (logical CPU devices), so a snippet
    written for GPUs runs anywhere with the same code path.
``<!-- setup: PYTHON -->``
    Python run (in the file's namespace) just before the block, e.g. to build the ``model`` a
    snippet takes as given. May span lines.
``<!-- output -->``
    The block quotes what the block before it printed; the test compares them. ``...`` stands
    for any text (doctest's ELLIPSIS); trailing spaces are ignored.
``<!-- file: PATH -->``
    The block quotes the file PATH that an earlier block wrote; ``...`` as above, and the quote
    may start and end anywhere in the file.

Languages: ``python`` runs in one namespace per Markdown file; ``bash``/``sh`` run each line as a
command; ``console`` runs each ``$ `` line and compares the lines below it with what it printed
(a ``<<'EOF'`` here-document takes the lines up to ``EOF`` as its input); ``yaml`` in a spec
document is read with :func:`fxsplit.load_spec`. A block in any other language, or a ``text``
or bare block, must carry ``output``, ``file:`` or ``not-run:``.
"""

from __future__ import annotations

import difflib
import doctest
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", "docs/*.md", "specs/*.md")
RUNNABLE = ("python", "bash", "sh", "console", "yaml")

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
_MARKER = re.compile(r"<!--\s*(?P<key>[\w-]+)(?::\s*(?P<value>.*?))?\s*-->", re.S)
_KEYS = ("not-run", "needs", "cuda-as-cpu", "setup", "output", "file")


@dataclass
class Block:
    """One fenced block: where it is, its language and text, and the markers above it."""

    path: str
    line: int
    lang: str
    text: str
    markers: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def quotes(self) -> bool:
        """It shows what something printed or wrote, rather than something to run."""
        return "output" in self.markers or "file" in self.markers


def documents() -> list[Path]:
    found: list[Path] = []
    for pattern in DOCUMENTS:
        found.extend(sorted(ROOT.glob(pattern)))
    return found


def parse(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, in order, each with the markers just above it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if not fence:
            index += 1
            continue
        indent = len(fence["indent"])
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        text = "\n".join(_dedent(line, indent) for line in lines[index + 1 : end])
        markers = _markers_above(lines, index, indent, name)
        blocks.append(Block(name, index + 1, fence["lang"], text + "\n", markers))
        index = end + 1
    return blocks


def _dedent(line: str, indent: int) -> str:
    """A line of a block fenced at ``indent`` spaces (inside a list item), without that indent."""
    return line[indent:] if line[:indent].strip() == "" else line.lstrip()


def _markers_above(lines: list[str], fence: int, indent: int, name: str) -> dict[str, str]:
    """Markers in the HTML comments right above line ``fence`` (blank lines between are allowed)."""
    start = fence
    while start > 0:
        above = lines[start - 1]
        if not above.strip():
            start -= 1
        elif above.rstrip().endswith("-->"):
            start -= 1
            while "<!--" not in lines[start]:
                start -= 1
        else:
            break
    found: dict[str, str] = {}
    for match in _MARKER.finditer("\n".join(_dedent(line, indent) for line in lines[start:fence])):
        key = match["key"]
        if key not in _KEYS:
            raise ValueError(f"{name}:{fence + 1}: unknown marker {key!r}; markers are {', '.join(_KEYS)}")
        found[key] = (match["value"] or "").strip()
    return found


def matches(expected: str, got: str) -> bool:
    """``got`` is ``expected`` up to ``...`` (any text) and trailing spaces."""
    want, have = _trim(expected), _trim(got)
    return doctest.OutputChecker().check_output(want, have, doctest.ELLIPSIS)


def contains(expected: str, text: str) -> bool:
    """``expected`` (with ``...`` as any text) occurs somewhere in ``text``."""
    return matches("..." + _trim(expected).rstrip("\n") + "...", text)


def difference(expected: str, got: str) -> str:
    diff = difflib.unified_diff(
        _trim(expected).splitlines(), _trim(got).splitlines(), "documented", "printed now", lineterm=""
    )
    return "\n".join(diff)


def _trim(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()) + "\n"


@dataclass
class Command:
    """One shell command of a ``console`` block and the output shown under it."""

    line: str
    expected: str


def console_commands(text: str) -> list[Command]:
    """Split a ``console`` block into ``$ `` commands (here-documents included) and their quoted outputs."""
    commands: list[Command] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if not line.startswith("$ "):
            raise ValueError(f"console block: output {line!r} comes before any '$ ' command")
        command = [line[2:]]
        heredoc = re.search(r"<<-?\s*'?(\w+)'?", line)
        index += 1
        if heredoc:
            while index < len(lines) and lines[index] != heredoc[1]:
                command.append(lines[index])
                index += 1
            command.append(heredoc[1])
            index += 1
        output = []
        while index < len(lines) and not lines[index].startswith("$ "):
            output.append(lines[index])
            index += 1
        commands.append(Command("\n".join(command), "\n".join(output)))
    return commands


def shell_commands(text: str) -> list[str]:
    """The commands of a ``bash`` block: its lines without comments and blank lines."""
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def with_cpus(text: str) -> str:
    """``cuda:N`` read as the logical CPU device ``cpu:N``."""
    return re.sub(r"\bcuda:(?=[\d{])", "cpu:", text)
