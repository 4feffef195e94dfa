"""Reading a spec: :func:`load_spec` takes a file, YAML text or a mapping and returns a validated :class:`Spec`."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any, Mapping

from fxsplit.errors import SpecError
from fxsplit.hardware import Hardware
from fxsplit.optimizer import OptimizerSettings
from fxsplit.options import DYNAMIC_SHAPES, MODES, OBJECTIVES, OPTIMIZERS, TRACE_MODES, PipelineConfig
from fxsplit.reserve import parse_headroom
from fxsplit.spec.dtype import DTYPES
from fxsplit.spec.fields import FieldChecker, read_devices, read_offload, read_pins, read_together, spec_device
from fxsplit.spec.schema import SPEC_KEYS, Spec, SpecProblems
from fxsplit.yamlfile import MAX_SPEC_BYTES, Problem, YamlPath, YamlProblems, format_path, load_yaml, read_limited
from fxsplit.yamlfile import short_repr as _short

__all__ = ["load_device_map", "load_spec"]


def load_spec(source: str | os.PathLike[str] | Mapping[str, Any] | Spec) -> Spec:
    """Read and validate a spec from a file path, YAML text, or an already-loaded mapping.

    A string is a path when it names an existing file or ends in ``.yaml`` /
    ``.yml`` without a newline; otherwise it is YAML text. A spec may hold
    at most 1 MiB (a larger file is refused before it is read) and no YAML
    aliases (``*name``); see :mod:`fxsplit.yamlfile`. A relative ``offload``
    ``dir`` in a spec file is relative to the file's folder.

    Raises:
        SpecProblems: (a :class:`SpecError`, so also a ``ValueError``) listing
            every problem with its YAML path and line.
    """
    if isinstance(source, Spec):
        return source
    if isinstance(source, Mapping):
        return _validate(dict(source), "<spec>", {})
    text, name, folder = _read(source)
    try:
        data, lines, problems = load_yaml(text, "spec", name)
    except YamlProblems as error:
        raise SpecProblems(name, list(error.problems)) from None
    return _validate(data, name, lines, problems, folder)


def load_device_map(path: str | os.PathLike[str]) -> Spec:
    """A device map file (JSON or YAML: module or tensor name -> device, as Accelerate writes it), read as
    a spec holding only ``device_map``: its problems come with the file's lines.

    Raises:
        SpecProblems: every problem, each with its line.
    """
    name = str(Path(path))
    try:
        data, lines, problems = load_yaml(read_limited(path, "device map", MAX_SPEC_BYTES), "device map", name)
    except YamlProblems as error:
        raise SpecProblems(name, list(error.problems)) from None
    lines = {("device_map", *key): line for key, line in lines.items()}
    return _validate({"device_map": data}, name, lines, problems)


def _read(source: str | os.PathLike[str]) -> tuple[str, str, str | None]:
    """The text, the name for messages, and the file's folder (``""``: the working directory; None: YAML text)."""
    looks_like_path = (
        isinstance(source, str)
        and "\n" not in source
        and (source.endswith((".yaml", ".yml")) or os.path.isfile(source))
    )
    if isinstance(source, os.PathLike) or looks_like_path:
        name = str(Path(source))
        return read_limited(source, "spec", MAX_SPEC_BYTES), name, os.path.dirname(name)
    if not isinstance(source, str):
        raise SpecError(f"a spec must be a file path, YAML text or a mapping (got {type(source).__name__})")
    return source, "<spec>", None


def _listed_devices(value: Any) -> set[str]:
    """The device names written under ``devices``, valid entries or not."""
    listed = set()
    for key in value if isinstance(value, dict) else ():
        try:
            listed.add(spec_device(key))
        except SpecError:
            continue
    return listed


def _validate(
    data: Any,
    source: str,
    lines: dict[YamlPath, int],
    problems: list[Problem] | None = None,
    folder: str | None = None,
) -> Spec:
    check = FieldChecker(lines, list(problems or []))
    if not isinstance(data, dict):
        what = "empty" if data is None else f"a {type(data).__name__}"
        check.problem((), f"a spec must be a mapping with keys like devices, pin, trace (it is {what})")
        raise SpecProblems(source, check.problems)
    check.unknown_keys(data, SPEC_KEYS, ())
    devices, reserve = read_devices(check, data.get("devices"), "devices" in data)
    default_reserve = None
    if "reserve" in data:
        default_reserve = check.attempt(("reserve",), lambda: parse_headroom(data["reserve"]))
    listed = _listed_devices(data.get("devices"))
    pins = read_pins(check, data.get("pin"), devices, listed=listed) if "pin" in data else {}
    device_map = read_pins(check, data["device_map"], devices, "device_map", listed) if "device_map" in data else None
    clashing = [key for key in ("pin", "together", "pipeline", "contiguous", "offload") if data.get(key)]
    if "device_map" in data and clashing:
        check.problem(
            ("device_map",),
            f"places the weights (the ops go where they copy least), so it does not combine with "
            f"{', '.join(clashing)}: drop them, or the device_map",
        )
    together = read_together(check, data["together"]) if "together" in data else ()
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
        if isinstance(optimizer, dict):  # settings: {name: adamw, fused: true}
            valid = check.attempt(("optimizer",), partial(OptimizerSettings.coerce, optimizer))
            optimizer = optimizer if valid else None
        elif isinstance(optimizer, bool) or not isinstance(optimizer, (str, int)):
            check.problem(
                ("optimizer",),
                f"must be one of {', '.join(OPTIMIZERS)}, settings ({{name: adamw, fused: true}}) or bytes per "
                f"parameter element (got {_short(optimizer)})",
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
    offload = read_offload(check, data["offload"], folder) if "offload" in data else None
    hardware = check.attempt(("hardware",), partial(Hardware.coerce, data["hardware"])) if "hardware" in data else None
    profile = data.get("profile")
    if profile is not None and not isinstance(profile, bool):
        check.problem(("profile",), f"must be true or false (got {_short(profile)})")
        profile = None
    accumulate = data.get("accumulate_grads")
    if accumulate is not None and not isinstance(accumulate, bool):
        check.problem(("accumulate_grads",), f"must be true or false (got {_short(accumulate)})")
        accumulate = None
    replicate = data.get("replicate")
    if replicate is not None and not isinstance(replicate, bool):
        check.problem(("replicate",), f"must be true or false (got {_short(replicate)})")
        replicate = None
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
        device_map=device_map,
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
        accumulate_grads=accumulate,
        dynamic_shapes=dynamic,
        offload=offload,
        hardware=hardware,
        profile=profile,
        replicate=replicate,
        source=source,
        lines=dict(lines),
    )
