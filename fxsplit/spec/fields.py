"""Validating a loaded spec's fields one by one, collecting every problem with its YAML path.

:class:`FieldChecker` records problems; :func:`read_devices`, :func:`read_pins`,
:func:`read_together` and :func:`read_offload` read the fields with structure of their own, and
:func:`spec_device` a device name (with a suggestion for names torch does not know).
"""

from __future__ import annotations

import difflib
import os
from functools import partial
from typing import Any, Callable, Collection

from fxsplit.errors import SpecError
from fxsplit.options import MAX_PREFETCH, STORAGE_TIERS, Offload
from fxsplit.reserve import Headroom, parse_headroom
from fxsplit.spec.schema import DEVICE_KEYS, OFFLOAD_KEYS
from fxsplit.units import format_size, parse_size
from fxsplit.yamlfile import Problem, YamlPath, line_of
from fxsplit.yamlfile import short_repr as _short

__all__ = [
    "FieldChecker",
    "describe",
    "module_key",
    "read_devices",
    "read_offload",
    "read_pins",
    "read_together",
    "spec_device",
]


class FieldChecker:
    """Validates loaded YAML field by field, collecting every problem."""

    def __init__(self, lines: dict[YamlPath, int], problems: list[Problem]) -> None:
        self.lines = lines
        self.problems = problems

    def problem(self, path: YamlPath, message: str) -> None:
        self.problems.append(Problem(path, line_of(path, self.lines), message))

    def attempt(self, path: YamlPath, parse: Callable[[], Any]) -> Any:
        """``parse()``, or None after recording its SpecError at ``path``."""
        try:
            return parse()
        except SpecError as error:
            self.problem(path, str(error))
            return None

    def unknown_keys(self, mapping: dict[Any, Any], valid: tuple[str, ...], path: YamlPath) -> None:
        for key in mapping:
            if key not in valid:
                close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(valid)}"
                self.problem((*path, key), f"unknown key; {hint}")

    def choice(self, value: Any, choices: Any, path: YamlPath) -> str | None:
        if value in choices:
            return str(value)
        close = difflib.get_close_matches(str(value), list(choices), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        self.problem(path, f"must be one of {', '.join(choices)} (got {_short(value)}){hint}")
        return None

    def string_list(self, value: Any, path: YamlPath, what: str) -> tuple[str, ...]:
        """A list of non-empty strings (``what`` names one item, for messages)."""
        if not isinstance(value, list):
            example = f" (write [{value}])" if isinstance(value, str) else ""
            self.problem(path, f"must be a list, each item a {what} (got {describe(value)}){example}")
            return ()
        good = []
        for i, item in enumerate(value):
            if isinstance(item, str) and item:
                good.append(item)
            else:
                self.problem((*path, i), f"must be a {what}, as a string (got {describe(item)})")
        return tuple(good)


def describe(value: Any) -> str:
    """``"nothing"`` or ``"int 3"``: a value's kind and short repr, for messages."""
    return "nothing" if value is None else f"{type(value).__name__} {_short(value)}"


_DEVICE_TYPES = ("cuda", "cpu", "mps", "xpu", "hpu", "mtia")


def spec_device(value: Any) -> str:
    """:func:`~fxsplit.devices.normalize_device`, with a short message and a suggestion for names torch does not know.

    >>> spec_device("gpu:1")
    Traceback (most recent call last):
    ...
    fxsplit.errors.SpecError: unknown device 'gpu:1'; did you mean 'cuda:1'? (devices look like cuda:0, cpu, cpu:1)
    """
    from fxsplit.devices import normalize_device  # loads torch: importing the spec does not

    try:
        return normalize_device(value)
    except SpecError as error:
        if not isinstance(value, str) or "is not a device" not in str(error):
            raise
    kind, colon, index = value.strip().partition(":")
    kind = kind.lower()
    if kind in _DEVICE_TYPES:  # a known type with a bad index: suggesting the same name would not help
        raise SpecError(f"unknown device {_short(value)}: the index after '{kind}:' must be a whole number >= 0")
    close = ["cuda"] if kind in ("gpu", "nvidia") else difflib.get_close_matches(kind, _DEVICE_TYPES, n=1)
    hint = f"did you mean '{close[0]}{colon}{index}'? " if close else ""
    raise SpecError(f"unknown device {_short(value)}; {hint}(devices look like cuda:0, cpu, cpu:1)") from None


def module_key(key: Any) -> str | None:
    """Module paths in YAML keys: ``0`` (an int) is the module named ``"0"``."""
    if isinstance(key, str) and key:
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    return None


def read_devices(check: FieldChecker, value: Any, present: bool) -> tuple[dict[str, int], dict[str, Headroom]]:
    """``devices``: budgets in bytes and the reserves named under each device, in the order written."""
    budgets: dict[str, int] = {}
    reserve: dict[str, Headroom] = {}
    if not present:
        return budgets, reserve
    if not isinstance(value, dict) or not value:
        check.problem(
            ("devices",),
            f"must map each device to its budget, like {{cuda:0: 20GiB, cuda:1: 20GiB}} (got {describe(value)})",
        )
        return budgets, reserve
    for key, entry in value.items():
        path: YamlPath = ("devices", key)
        name = check.attempt(path, partial(spec_device, key))
        if name is None:
            continue
        if name in budgets:
            check.problem(path, f"names device '{name}' a second time")
            continue
        budget: Any = entry
        if isinstance(entry, dict):
            check.unknown_keys(entry, DEVICE_KEYS, path)
            if "budget" not in entry:
                check.problem(path, "needs a budget, like {budget: 20GiB, reserve: 10%}")
                continue
            budget = entry["budget"]
            if "reserve" in entry:
                room = check.attempt((*path, "reserve"), partial(parse_headroom, entry["reserve"]))
                if room is not None:
                    reserve[name] = room
            path = (*path, "budget")
        size = check.attempt(path, partial(parse_size, budget, what="budget"))
        if size is not None:
            budgets[name] = size
            if name in reserve and reserve[name].of(size) >= size and size:
                check.problem(
                    (*path[:2], "reserve"),
                    f"reserve {reserve[name]} leaves nothing of the budget "
                    f"{format_size(size)}; reserve less or raise the budget",
                )
    return budgets, reserve


def read_pins(
    check: FieldChecker, value: Any, devices: dict[str, int], field: str = "pin", listed: Collection[str] = ()
) -> dict[str, str]:
    """``pin``: module path or glob -> device, which must be among ``devices`` when those are given
    (``listed``: devices written under ``devices`` whose entry has a problem of its own, reported there).

    ``field="device_map"``: module or tensor name (``""``: the whole model) -> device, as Accelerate writes it.
    """
    pins: dict[str, str] = {}
    names = "module paths or globs" if field == "pin" else "module or tensor names"
    if not isinstance(value, dict):
        example = "{lm_head: cuda:1}" if field == "pin" else "{model.embed: 0, model.layers: 1}"
        check.problem((field,), f"must map {names} to devices, like {example} (got {describe(value)})")
        return pins
    for key, device in value.items():
        path: YamlPath = (field, key)
        pattern = "" if key == "" else module_key(key)  # '': the whole model, in a device map (pins may be one)
        if pattern is None:
            check.problem(
                path,
                f"a {'pin' if field == 'pin' else 'device_map'}'s key must be a "
                f"{'module path or glob' if field == 'pin' else 'module or tensor name'}; quote paths that look "
                f"like numbers (got {_short(key)})",
            )
            continue
        name = check.attempt(path, partial(spec_device, device))
        if name is None:
            continue
        if devices and name not in devices and name in listed:
            continue  # its entry under devices has a problem, reported there
        if devices and name not in devices:
            verb = "pins to" if field == "pin" else "puts weights on"
            check.problem(
                path,
                f"{verb} '{name}', which is not under devices ({', '.join(devices)}); "
                f"add it there or {'pin to' if field == 'pin' else 'use'} one of those",
            )
            continue
        pins[pattern] = name
    return pins


def read_together(check: FieldChecker, value: Any) -> tuple[tuple[str, ...], ...]:
    """``together``: groups of module paths or globs whose ops must share a device."""
    if not isinstance(value, list):
        check.problem(
            ("together",), f"must be a list of groups, like [[encoder.embed, decoder.embed]] (got {describe(value)})"
        )
        return ()
    groups = []
    for i, group in enumerate(value):
        items = check.string_list(group, ("together", i), "module path or glob")
        if isinstance(group, list) and not group:
            check.problem(("together", i), "an empty group; list the modules that must share a device")
        if items:
            groups.append(items)
    return tuple(groups)


def read_offload(check: FieldChecker, value: Any, folder: str | None) -> Offload | None:
    """``offload``: the host and disk budgets for weights the devices cannot hold, ``dir`` and ``prefetch``.

    A relative ``dir`` (after ``~`` is expanded) is taken inside ``folder``,
    the spec file's folder (None: a spec given as text or a mapping; it stays
    as written, relative to the working directory).
    """
    path: YamlPath = ("offload",)
    if isinstance(value, Offload):  # from a mapping built in Python
        return value
    if not isinstance(value, dict):
        sized = isinstance(value, (str, int)) and not isinstance(value, bool) and len(str(value)) <= 20
        hint = f"; for host memory write {{host: {value}}}" if sized else ""
        check.problem(
            path,
            f"must map host, disk, dir and prefetch, like {{host: 16GiB, disk: 100GiB, dir: offload/}} "
            f"(got {describe(value)}){hint}",
        )
        return None
    before = len(check.problems)
    check.unknown_keys(value, OFFLOAD_KEYS, path)
    unknown = len(check.problems) > before
    sizes: dict[str, int] = {}
    for tier in STORAGE_TIERS:
        if value.get(tier) is not None:
            size = check.attempt((*path, tier), partial(parse_size, value[tier], what=f"{tier} budget"))
            if size is not None:
                sizes[tier] = size
    if all(value.get(tier) is None for tier in STORAGE_TIERS) and not unknown:  # else the unknown key says it
        check.problem(path, "needs a host or disk budget, like {host: 16GiB} or {disk: 100GiB, dir: offload/}")
    where = value.get("dir")
    if where is not None and (not isinstance(where, str) or not where.strip()):
        quote = "; quote it: YAML reads yes, no, on and off as true or false" if isinstance(where, bool) else ""
        check.problem((*path, "dir"), f"must be a directory path, as a string (got {describe(where)}){quote}")
    elif where is None and value.get("disk") is not None:
        check.problem((*path, "disk"), "needs dir: the directory the stored weights are written to, like dir: offload/")
    prefetch = value.get("prefetch")
    if prefetch is not None and (
        isinstance(prefetch, bool) or not isinstance(prefetch, int) or not 0 <= prefetch <= MAX_PREFETCH
    ):
        check.problem(
            (*path, "prefetch"),
            f"must be a whole number from 0 to {MAX_PREFETCH}, the ops ahead a streamed weight is copied "
            f"(got {describe(prefetch)})",
        )
    if len(check.problems) > before:
        return None
    if where is not None:
        where = os.path.expanduser(where)
        where = os.path.join(folder, where) if folder else where
    made: Offload | None = check.attempt(path, partial(Offload, **sizes, dir=where, prefetch=prefetch))
    return made
