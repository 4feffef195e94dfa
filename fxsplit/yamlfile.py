"""The YAML files fxsplit reads (specs and plans): safe, bounded, with the line of every key.

Both kinds of file are read here, with PyYAML's safe loader (a file can never
build Python objects or run code), and refused early when reading them could
take long or eat memory:

* a file larger than its limit (:data:`MAX_SPEC_BYTES`, :data:`MAX_PLAN_BYTES`),
  told from the file's size before it is read;
* an alias (``*name``): a few hundred bytes of nested aliases expand into
  billions of values, and neither kind of file needs one;
* values nested deeper than :data:`MAX_DEPTH` levels.

Every problem is a :class:`Problem` (YAML path, line, message); values quoted
in messages go through :func:`short_repr`, so that a message stays short
whatever the file holds.

>>> data, lines, problems = load_yaml("a:\\n  b: [1, 2]\\n", "spec")
>>> data, lines[("a", "b", 1)], problems
({'a': {'b': [1, 2]}}, 2, [])
>>> load_yaml("a: &x [1]\\nb: *x\\n", "spec")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
fxsplit.yamlfile.YamlProblems: <spec>: 1 problem:
  <spec>:2: <top>: alias *x: ...
"""

from __future__ import annotations

import os
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fxsplit.errors import SpecError
from fxsplit.units import format_size

__all__ = [
    "MAX_DEPTH",
    "MAX_PLAN_BYTES",
    "MAX_SPEC_BYTES",
    "Problem",
    "YamlPath",
    "YamlProblems",
    "format_path",
    "line_of",
    "load_yaml",
    "read_limited",
    "short_repr",
]

YamlPath = tuple[Any, ...]

MAX_SPEC_BYTES = 1 << 20  # a spec is a few KiB: devices, pins, options
MAX_PLAN_BYTES = 8 << 20  # a plan lists every graph node and tensor: ~60 bytes each
MAX_DEPTH = 32  # specs and plans nest 4 levels
_MAX_MESSAGE = 500  # characters of one problem's message
_MAX_LISTED = 50  # problems shown in an error message (all are kept in .problems)

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlong = 40
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = _SHORT.maxfrozenset = 6
_SHORT.maxdict = 4
_SHORT.maxlevel = 3


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to a few dozen characters, in time that does not grow with ``value``.

    >>> short_repr("x" * 1000)
    "'xxxxxxxxxxxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxxxxxxxxxxxx'"
    >>> short_repr({"a": [1, 2, 3, 4, 5, 6, 7, 8]})
    "{'a': [1, 2, 3, 4, 5, 6, ...]}"
    """
    return _SHORT.repr(value)


def format_path(path: YamlPath) -> str:
    """``("devices", "cuda:1")`` -> ``devices['cuda:1']``; ``("together", 0, 1)`` -> ``together[0][1]``."""
    if not path:
        return "<top>"
    head, *rest = path
    return _clip(str(head), 60) + "".join(f"[{p}]" if isinstance(p, int) else f"[{short_repr(p)}]" for p in rest)


def line_of(path: YamlPath, lines: dict[YamlPath, int]) -> int | None:
    """The line of ``path``, else of the nearest enclosing path that has one."""
    while path and path not in lines:
        path = path[:-1]
    return lines.get(path)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a file: where (YAML path and line) and what."""

    path: YamlPath
    line: int | None
    message: str

    def render(self, source: str) -> str:
        where = f"{source}:{self.line}" if self.line else source
        return f"{where}: {format_path(self.path)}: {_clip(self.message, _MAX_MESSAGE)}"


class YamlProblems(SpecError):
    """A file with problems; ``problems`` lists each, the message shows them (the first 50)."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = tuple(problems)
        count = f"{len(problems)} problem" + ("s" if len(problems) != 1 else "")
        shown = [p.render(source) for p in problems[:_MAX_LISTED]]
        if len(problems) > _MAX_LISTED:
            shown.append(f"... and {len(problems) - _MAX_LISTED} more")
        super().__init__(f"{source}: {count}:\n  " + "\n  ".join(shown))


def read_limited(path: str | os.PathLike[str], what: str, limit: int) -> str:
    """The text of the file at ``path``, refused unread when it holds more than ``limit`` bytes.

    Raises:
        SpecError: the file cannot be read, is too large, or is not UTF-8.
    """
    try:
        with Path(path).open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > limit:
                raise SpecError(_too_large(what, str(path), f"{format_size(size)} ({size} bytes)", limit))
            data = handle.read(limit + 1)  # a pipe or device may say size 0
    except OSError as error:
        raise SpecError(f"cannot read {what} file '{path}': {error.strerror or error}") from None
    if len(data) > limit:
        raise SpecError(_too_large(what, str(path), f"more than {format_size(limit)}", limit))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise SpecError(
            f"{what} file '{path}' is not UTF-8 text (byte {error.start} is {data[error.start]:#04x}); save it as UTF-8"
        ) from None


def _too_large(what: str, source: str, size: str, limit: int) -> str:
    return (
        f"{what} file '{source}' is {size}; a {what} file may hold at most {format_size(limit)} "
        f"({limit} bytes), so this is not one (check the path)"
    )


def load_yaml(
    text: str, what: str, source: str | None = None, limit: int | None = None
) -> tuple[Any, dict[YamlPath, int], list[Problem]]:
    """``(data, YAML path -> line, problems)`` of one YAML document; ``what`` is ``"spec"`` or ``"plan"``.

    Problems that do not stop reading (a duplicate key, a key that is not a
    scalar) are returned; the rest are raised.

    Raises:
        YamlProblems: not YAML, too large, an alias, nested too deep, or a tag
            that would build a Python object; says where.
    """
    source = source or f"<{what}>"
    limit = limit if limit is not None else (MAX_PLAN_BYTES if what == "plan" else MAX_SPEC_BYTES)
    size = len(text) if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))  # bytes >= characters
    if size > limit:
        raise YamlProblems(
            source,
            [
                Problem(
                    (),
                    None,
                    f"the text is at least {format_size(size)} ({size} "
                    f"bytes); a {what} may hold at most {format_size(limit)} ({limit} bytes)",
                )
            ],
        )
    loader = _LineLoader(text, what)
    try:
        return loader.load(), loader.lines, loader.problems
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line = mark.line + 1 if mark else None
        problem = str(error.problem or error)
        if isinstance(error, _Refused):
            raise YamlProblems(source, [Problem((), line, problem)]) from None
        if "could not determine a constructor" in problem:
            problem += f" ({what}s are read with a safe loader: no Python objects, no code)"
        raise YamlProblems(source, [Problem((), line, f"not valid YAML: {_clip(problem, 200)}")]) from None
    except yaml.YAMLError as error:
        raise YamlProblems(source, [Problem((), None, f"not valid YAML: {_clip(str(error), 200)}")]) from None
    finally:
        loader.dispose()


class _Refused(yaml.MarkedYAMLError):
    """Valid YAML that fxsplit does not read (an alias, too deep)."""


class _LineLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing aliases and deep nesting, recording the line of every key and item."""

    def __init__(self, stream: str, what: str) -> None:
        super().__init__(stream)
        self.what = what
        self.depth = 0
        self.lines: dict[YamlPath, int] = {}
        self.problems: list[Problem] = []

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(
                problem=f"alias *{_clip(str(event.anchor), 40)}: a {self.what} file takes no YAML aliases "
                "(a few nested aliases can expand into billions of values); write the value out",
                problem_mark=event.start_mark,
            )
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _Refused(
                    problem=f"values nested more than {MAX_DEPTH} levels deep; a {self.what} file nests a few levels",
                    problem_mark=self.peek_event().start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def load(self) -> Any:
        node = self.get_single_node()
        return None if node is None else self.build(node, ())

    def build(self, node: yaml.Node, path: YamlPath) -> Any:
        self.lines.setdefault(path, node.start_mark.line + 1)
        if node.tag not in (self.DEFAULT_MAPPING_TAG, self.DEFAULT_SEQUENCE_TAG):
            return self.construct_object(node, deep=True)  # scalars, and tagged nodes: the safe constructor decides
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
            result: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if not isinstance(key, (str, int, float, bool)) and key is not None:
                    self.problems.append(Problem(path, line, f"a key must be a plain scalar (got {short_repr(key)})"))
                    continue
                key_path: YamlPath = (*path, key)  # a name: mypy reads d[(*a, b)] as 3.11-only syntax
                if key in result:
                    self.problems.append(Problem(key_path, line, "duplicate key; YAML would keep only the last"))
                self.lines[key_path] = line
                result[key] = self.build(value_node, key_path)
            return result
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*path, i)) for i, item in enumerate(node.value)]
        return self.construct_object(node, deep=True)
