"""Partition specs: a YAML file that says what a split should be, validated strictly.

A spec names the devices and their budgets, headroom to keep free, pins, groups
of modules that must share a device, and how to trace and plan. It is loaded
with a safe YAML loader (a spec can never run code), and *every* problem is
reported at once, each with its YAML path and line (a file too large, or with a
YAML alias, is refused at once: see :mod:`fxsplit.yamlfile`)::

    specs/mine.yaml:3: devices['cuda:1']: budget '10 GiBs' has unknown unit 'GiBs'; ...
    specs/mine.yaml:6: pinn: unknown key; did you mean 'pin'?

>>> spec = load_spec('''
... devices:
...   cpu:0: 300KiB
...   cpu:1: {budget: 300KiB, reserve: 10%}
... pin: {"2": cpu:1}
... dtype: bf16
... ''')
>>> spec.devices, spec.pins, spec.dtype
({'cpu:0': 307200, 'cpu:1': 307200}, {'2': 'cpu:1'}, 'bfloat16')
>>> spec.reserve_for("cpu:1").of(307200)
30720
>>> load_spec("devices: {cpu:0: 1GiB}\\nobjectiv: balanced")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
fxsplit.spec.SpecProblems: <spec>: 1 problem:
  <spec>:2: objectiv: unknown key; did you mean 'objective'?
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping

from fxsplit.devices import normalize_device
from fxsplit.errors import SpecError
from fxsplit.options import DYNAMIC_SHAPES, MODES, OBJECTIVES, OPTIMIZERS, TRACE_MODES, PipelineConfig
from fxsplit.units import format_size, parse_size
from fxsplit.yamlfile import (
    MAX_SPEC_BYTES,
    Problem,
    YamlPath,
    YamlProblems,
    format_path,
    line_of,
    load_yaml,
    read_limited,
)
from fxsplit.yamlfile import short_repr as _short

__all__ = [
    "DTYPES",
    "Headroom",
    "Problem",
    "Spec",
    "SpecProblems",
    "load_spec",
    "merge_spec",
    "parse_headroom",
    "planning_dtype",
    "reserve_bytes",
    "spec_device",
]

DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}  # fmt: skip
SPEC_KEYS = (
    "devices",
    "reserve",
    "pin",
    "together",
    "leaf_modules",
    "trace",
    "output_device",
    "objective",
    "dtype",
    "pipeline",
    "contiguous",
    "mode",
    "optimizer",
    "dynamic_shapes",
)
DEVICE_KEYS = ("budget", "reserve")
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")


class SpecProblems(YamlProblems):
    """A spec with problems; ``problems`` lists each, the message shows them (the first 50)."""


@dataclass(frozen=True)
class Headroom:
    """Memory to keep free on a device: a byte count plus a fraction of the budget."""

    nbytes: int = 0
    fraction: float = 0.0

    def of(self, budget: int) -> int:
        """Bytes held back from ``budget``."""
        return self.nbytes + int(budget * self.fraction)

    def __str__(self) -> str:
        parts = [format_size(self.nbytes)] if self.nbytes else []
        parts += [f"{100 * self.fraction:g}%"] if self.fraction else []
        return " + ".join(parts) or "0 B"


def parse_headroom(value: Any, *, what: str = "reserve", share_of: str = "the budget") -> Headroom:
    """``"2GiB"``, ``2147483648``, ``"10%"`` or ``0.1`` (both of the budget) as a :class:`Headroom`.

    A float is always a fraction, as in :func:`fxsplit.auto_budgets`: bytes
    are an int or a size string.

    Raises:
        SpecError: not a size, a percentage below 100, or a fraction below 1.
    """
    if isinstance(value, Headroom):
        return value
    if isinstance(value, float):
        if not 0 <= value < 1:
            raise SpecError(
                f"{what} {value!r} is a float, which means a fraction of {share_of} from 0 to below 1 "
                "(0.1 is '10%'); for bytes write an int or a size like '100MiB'"
            )
        return Headroom(fraction=value)
    if isinstance(value, str) and "%" in value:
        match = _PERCENT.match(value)
        if match is None or float(match.group(1)) >= 100:
            raise SpecError(
                f"{what} {_short(value)} is not a percentage of {share_of} from 0% to below 100%, like '10%'"
            )
        return Headroom(fraction=float(match.group(1)) / 100)
    return Headroom(nbytes=parse_size(value, what=what))


@dataclass(frozen=True)
class Spec:
    """A validated partition spec. Fields left out of the file are empty or None.

    Attributes:
        devices: device -> budget in bytes, in stage order.
        reserve: device -> headroom named under that device.
        default_reserve: headroom for every device without its own.
        pins: module path or glob -> device.
        together: groups of module patterns whose ops must share a device.
        leaf_modules: module paths or class names fx must not trace into.
        trace: ``"auto"``, ``"fx"`` or ``"export"``.
        output_device: where outputs are returned.
        objective: ``"min_transfer"`` or ``"balanced"``.
        dtype: plan as if floating tensors had this dtype (``"bfloat16"``).
        pipeline: micro-batch pipelining (``{chunks: 4, checkpoint: except_last}``), or None.
        contiguous: keep each device's ops one consecutive run, in device order (None: the default, False).
        mode: what the budgets must hold: ``"inference"``, ``"training"`` or ``"weights"``.
        optimizer: optimizer state counted in training (``"adam"``, ``"sgd"``, ... or bytes per parameter).
        dynamic_shapes: input sizes a torch.export split keeps variable: ``"batch"`` or ``"all"``.
        source: the file name, for messages.
        lines: YAML path -> line number, for messages that come later.
    """

    devices: dict[str, int] = field(default_factory=dict)
    reserve: dict[str, Headroom] = field(default_factory=dict)
    default_reserve: Headroom | None = None
    pins: dict[str, str] = field(default_factory=dict)
    together: tuple[tuple[str, ...], ...] = ()
    leaf_modules: tuple[str, ...] = ()
    trace: str | None = None
    output_device: str | None = None
    objective: str | None = None
    dtype: str | None = None
    pipeline: PipelineConfig | None = None
    contiguous: bool | None = None
    mode: str | None = None
    optimizer: str | int | None = None
    dynamic_shapes: str | None = None
    source: str = "<spec>"
    lines: dict[YamlPath, int] = field(default_factory=dict, compare=False, repr=False)

    def reserve_for(self, device: str) -> Headroom:
        """The headroom ``device`` keeps: its own, else the spec-wide one, else none."""
        return self.reserve.get(device) or self.default_reserve or Headroom()

    def locate(self, path: YamlPath) -> str:
        """``"file.yaml:7: pin['lm_head']"`` for messages about a spec entry."""
        line = self.lines.get(path)
        return f"{self.source}:{line}: {format_path(path)}" if line else f"{self.source}: {format_path(path)}"

    def options(self) -> dict[str, Any]:
        """The spec as keyword options of :func:`fxsplit.fxsplit` (only what it sets; no budgets, no reserve)."""
        found: dict[str, Any] = {}
        if self.pins:
            found["pins"] = dict(self.pins)
        if self.together:
            found["together"] = self.together
        if self.leaf_modules:
            found["leaf_modules"] = self.leaf_modules
        for name in (
            "trace",
            "output_device",
            "objective",
            "dtype",
            "pipeline",
            "contiguous",
            "mode",
            "optimizer",
            "dynamic_shapes",
        ):
            if getattr(self, name) is not None:
                found[name] = getattr(self, name)
        return found


def reserve_bytes(reserve: Any, budgets: Mapping[str, int]) -> dict[str, int]:
    """Bytes to hold back on each device: ``reserve`` is a size, ``"N%"`` or a mapping device -> either.

    A device with a budget of 0 holds nothing, so nothing is held back
    there (its usable budget is 0, never negative).

    Raises:
        SpecError: a bad size, a device without a budget, or a reserve that
            leaves nothing of a non-zero budget.
    """
    if reserve is None:
        return {}
    if isinstance(reserve, Mapping):
        rooms: dict[str, Headroom] = {}
        for key, value in reserve.items():
            device = normalize_device(key)
            if device not in budgets:
                raise SpecError(f"reserve names '{device}', which has no budget (devices: {', '.join(budgets)})")
            rooms[device] = parse_headroom(value, what=f"reserve of '{device}'")
    else:
        room = parse_headroom(reserve)
        rooms = {device: room for device in budgets}
    held = {device: rooms[device].of(budget) if device in rooms and budget else 0 for device, budget in budgets.items()}
    for device, nbytes in held.items():
        if budgets[device] and nbytes >= budgets[device]:
            raise SpecError(
                f"reserve {rooms[device]} of '{device}' leaves nothing of its budget "
                f"{format_size(budgets[device])}; reserve less or raise the budget"
            )
    return held


def planning_dtype(value: Any) -> str | None:
    """Canonical name of a planning dtype: ``"bf16"`` or ``torch.bfloat16`` -> ``"bfloat16"``.

    Raises:
        SpecError: not a floating dtype fxsplit plans for.
    """
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    if name not in DTYPES:
        raise SpecError(f"dtype must be one of {', '.join(DTYPES)} (got {_short(value)})")
    return DTYPES[name]


def merge_spec(spec: Spec, budgets: Any, options: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Budgets and options from ``spec``, overridden by what the caller passed explicitly.

    Explicit ``budgets`` replace the spec's devices (their reserves apply to
    devices of the same name); an explicit ``reserve`` replaces the spec's.
    """
    merged = {**spec.options(), **options}
    chosen = budgets if budgets is not None else (dict(spec.devices) or None)
    if "reserve" not in options and chosen is not None and (spec.reserve or spec.default_reserve):
        merged["reserve"] = {key: spec.reserve_for(_device_or_key(key)) for key in chosen}
    return chosen, merged


def _device_or_key(key: Any) -> Any:
    try:
        return normalize_device(key)
    except SpecError:
        return key


def load_spec(source: str | os.PathLike[str] | Mapping[str, Any] | Spec) -> Spec:
    """Read and validate a spec from a file path, YAML text, or an already-loaded mapping.

    A string is a path when it names an existing file or ends in ``.yaml`` /
    ``.yml`` without a newline; otherwise it is YAML text. A spec may hold
    at most 1 MiB (a larger file is refused before it is read) and no YAML
    aliases (``*name``); see :mod:`fxsplit.yamlfile`.

    Raises:
        SpecProblems: (a :class:`SpecError`, so also a ``ValueError``) listing
            every problem with its YAML path and line.
    """
    if isinstance(source, Spec):
        return source
    if isinstance(source, Mapping):
        return _validate(dict(source), "<spec>", {})
    text, name = _read(source)
    try:
        data, lines, problems = load_yaml(text, "spec", name)
    except YamlProblems as error:
        raise SpecProblems(name, list(error.problems)) from None
    return _validate(data, name, lines, problems)


def _read(source: str | os.PathLike[str]) -> tuple[str, str]:
    looks_like_path = (
        isinstance(source, str)
        and "\n" not in source
        and (source.endswith((".yaml", ".yml")) or os.path.isfile(source))
    )
    if isinstance(source, os.PathLike) or looks_like_path:
        return read_limited(source, "spec", MAX_SPEC_BYTES), str(Path(source))
    if not isinstance(source, str):
        raise SpecError(f"a spec must be a file path, YAML text or a mapping (got {type(source).__name__})")
    return source, "<spec>"


class _Checker:
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
            self.problem(path, f"must be a list, each item a {what} (got {_kind(value)}){example}")
            return ()
        good = []
        for i, item in enumerate(value):
            if isinstance(item, str) and item:
                good.append(item)
            else:
                self.problem((*path, i), f"must be a {what}, as a string (got {_kind(item)})")
        return tuple(good)


def _kind(value: Any) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {_short(value)}"


_DEVICE_TYPES = ("cuda", "cpu", "mps", "xpu", "hpu", "mtia")


def spec_device(value: Any) -> str:
    """:func:`normalize_device`, with a short message and a suggestion for names torch does not know.

    >>> spec_device("gpu:1")
    Traceback (most recent call last):
    ...
    fxsplit.errors.SpecError: unknown device 'gpu:1'; did you mean 'cuda:1'? (devices look like cuda:0, cpu, cpu:1)
    """
    try:
        return normalize_device(value)
    except SpecError as error:
        if not isinstance(value, str) or "is not a device" not in str(error):
            raise
    kind, colon, index = value.strip().partition(":")
    kind = kind.lower()
    close = ["cuda"] if kind in ("gpu", "nvidia") else difflib.get_close_matches(kind, _DEVICE_TYPES, n=1)
    hint = f"did you mean '{close[0]}{colon}{index}'? " if close else ""
    raise SpecError(f"unknown device {_short(value)}; {hint}(devices look like cuda:0, cpu, cpu:1)") from None


def _module_key(key: Any) -> str | None:
    """Module paths in YAML keys: ``0`` (an int) is the module named ``"0"``."""
    if isinstance(key, str) and key:
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    return None


def _validate(data: Any, source: str, lines: dict[YamlPath, int], problems: list[Problem] | None = None) -> Spec:
    check = _Checker(lines, list(problems or []))
    if not isinstance(data, dict):
        what = "empty" if data is None else f"a {type(data).__name__}"
        check.problem((), f"a spec must be a mapping with keys like devices, pin, trace (it is {what})")
        raise SpecProblems(source, check.problems)
    check.unknown_keys(data, SPEC_KEYS, ())
    devices, reserve = _devices(check, data.get("devices"), "devices" in data)
    default_reserve = None
    if "reserve" in data:
        default_reserve = check.attempt(("reserve",), lambda: parse_headroom(data["reserve"]))
    pins = _pins(check, data.get("pin"), devices) if "pin" in data else {}
    together = _together(check, data["together"]) if "together" in data else ()
    leaves = (
        check.string_list(data["leaf_modules"], ("leaf_modules",), "module path or class name")
        if ("leaf_modules" in data)
        else ()
    )
    trace = check.choice(data["trace"], TRACE_MODES, ("trace",)) if "trace" in data else None
    objective = check.choice(data["objective"], OBJECTIVES, ("objective",)) if "objective" in data else None
    dtype = None
    if "dtype" in data:
        name = check.choice(data["dtype"], DTYPES, ("dtype",))
        dtype = DTYPES[name] if name else None
    contiguous = data.get("contiguous")
    if contiguous is not None and not isinstance(contiguous, bool):
        check.problem(("contiguous",), f"must be true or false (got {_short(contiguous)})")
        contiguous = None
    pipeline = None
    if "pipeline" in data:
        pipeline = check.attempt(("pipeline",), partial(PipelineConfig.coerce, data["pipeline"]))
    mode = check.choice(data["mode"], MODES, ("mode",)) if "mode" in data else None
    optimizer = data.get("optimizer")
    if optimizer is not None:
        if isinstance(optimizer, bool) or not isinstance(optimizer, (str, int)):
            check.problem(
                ("optimizer",),
                f"must be one of {', '.join(OPTIMIZERS)} or bytes per parameter element (got {_short(optimizer)})",
            )
            optimizer = None
        elif isinstance(optimizer, str):
            optimizer = check.choice(optimizer, OPTIMIZERS, ("optimizer",))
        elif optimizer < 0:
            check.problem(("optimizer",), f"bytes per parameter element must be 0 or more (got {optimizer})")
            optimizer = None
        if optimizer is not None and ("mode" not in data or mode not in (None, "training")):
            check.problem(("optimizer",), "only counts with mode: training (add it, or drop the optimizer)")
    dynamic = None
    if "dynamic_shapes" in data:
        dynamic = check.choice(data["dynamic_shapes"], DYNAMIC_SHAPES, ("dynamic_shapes",))
    output = None
    if "output_device" in data:
        output = check.attempt(("output_device",), lambda: spec_device(data["output_device"]))
    if check.problems:
        raise SpecProblems(source, sorted(check.problems, key=lambda p: (p.line or 0, format_path(p.path))))
    return Spec(
        devices=devices,
        reserve=reserve,
        default_reserve=default_reserve,
        pins=pins,
        together=together,
        leaf_modules=leaves,
        trace=trace,
        output_device=output,
        objective=objective,
        dtype=dtype,
        pipeline=pipeline,
        contiguous=contiguous,
        mode=mode,
        optimizer=optimizer,
        dynamic_shapes=dynamic,
        source=source,
        lines=dict(lines),
    )


def _devices(check: _Checker, value: Any, present: bool) -> tuple[dict[str, int], dict[str, Headroom]]:
    budgets: dict[str, int] = {}
    reserve: dict[str, Headroom] = {}
    if not present:
        return budgets, reserve
    if not isinstance(value, dict) or not value:
        check.problem(
            ("devices",),
            f"must map each device to its budget, like {{cuda:0: 20GiB, cuda:1: 20GiB}} (got {_kind(value)})",
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


def _pins(check: _Checker, value: Any, devices: dict[str, int]) -> dict[str, str]:
    pins: dict[str, str] = {}
    if not isinstance(value, dict):
        check.problem(
            ("pin",), f"must map module paths or globs to devices, like {{lm_head: cuda:1}} (got {_kind(value)})"
        )
        return pins
    for key, device in value.items():
        path: YamlPath = ("pin", key)
        pattern = _module_key(key)
        if pattern is None:
            check.problem(
                path,
                f"a pin's key must be a module path or glob; quote paths that look like numbers (got {_short(key)})",
            )
            continue
        name = check.attempt(path, partial(spec_device, device))
        if name is None:
            continue
        if devices and name not in devices:
            check.problem(
                path,
                f"pins to '{name}', which is not under devices ({', '.join(devices)}); "
                "add it there or pin to one of those",
            )
            continue
        pins[pattern] = name
    return pins


def _together(check: _Checker, value: Any) -> tuple[tuple[str, ...], ...]:
    if not isinstance(value, list):
        check.problem(
            ("together",), f"must be a list of groups, like [[encoder.embed, decoder.embed]] (got {_kind(value)})"
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
