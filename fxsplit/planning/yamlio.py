"""Plans as YAML files: readable at the top, exact all the way down.

A plan file starts with what a person wants to see: per device its budget,
the bytes placed there and the modules it runs (ranges like ``layers.0-11``),
then every cut with its bytes and the tied tensors. Below comes the full
placement (every graph node, parameter and buffer), which makes the file
exact: ``plan_from_yaml(plan_to_yaml(plan)) == plan``.

The writer emits each line itself (so that comments with human units sit next
to the exact integers); every key and value goes through PyYAML's emitter, so
any string survives. The reader uses PyYAML's safe loader with limits (at
most 8 MiB, no aliases: :mod:`fxsplit.yamlfile`), so a plan file cannot run
code or take long to read, and then holds the plan to the rules of
:mod:`fxsplit.planning.rules` (fingerprint, tensors, devices, tied groups, cuts),
reporting every problem at once. No torch needed.

>>> from fxsplit.planning.fingerprint import fingerprint_of
>>> from fxsplit.planning.plan import Cut, Plan
>>> tensors = {"l0.weight": "float32[16, 16]", "l1.weight": "float32[16, 16]"}
>>> plan = Plan(devices=("cpu:0", "cpu:1"), budgets={"cpu:0": 4096, "cpu:1": 4096},
...             placement={"x": "cpu:0", "l0": "cpu:0", "l1": "cpu:1", "output": "cpu:1"},
...             param_devices={"l0.weight": "cpu:0", "l1.weight": "cpu:1"},
...             device_bytes={"cpu:0": 1024, "cpu:1": 1024},
...             cuts=(Cut("l0", "cpu:0", "cpu:1", 64),), output_device="cpu:1",
...             modules={"cpu:0": ("l0",), "cpu:1": ("l1",)},
...             tensors=tensors, fingerprint=fingerprint_of(tensors, ()))
>>> print(plan_to_yaml(plan).split("# ----")[0].split("\\n", 3)[3].rstrip())  # doctest: +NORMALIZE_WHITESPACE
format: fxsplit-plan/1
fingerprint: sha256:a197f7e97c988ec6
trace: fx
objective: min_transfer
dtype: null
output_device: cpu:1
leaf_modules: []
devices:
  cpu:0:
    budget: 4096  # 4.00 KiB
    used: 1024  # 1.00 KiB, 25.0% of the budget
    modules: [l0]  # summary, for reading
  cpu:1:
    budget: 4096  # 4.00 KiB
    used: 1024  # 1.00 KiB, 25.0% of the budget
    modules: [l1]  # summary, for reading
cuts:  # 1, 64 B per forward
- {value: l0, from: 'cpu:0', to: 'cpu:1', bytes: 64, kind: activation}  # 64 B
tied: []
>>> plan_from_yaml(plan_to_yaml(plan)) == plan
True
>>> edited = plan_to_yaml(plan).replace("l1.weight: cpu:1", "l1.weight: cpu:7")
>>> plan_from_yaml(edited.replace("sha256:a1", "sha256:b1"), "plan.yaml")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
fxsplit.planning.rules.PlanProblems: plan.yaml: 2 problems:
  plan.yaml:5: fingerprint: is 'sha256:b197f7e97c988ec6' but the plan's tensors and tied groups give ...
  plan.yaml:36: param_devices['l1.weight']: 'l1.weight' is placed on 'cpu:7', which has no budget (devices: ...)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import yaml

from fxsplit.errors import SpecError
from fxsplit.planning.plan import Cut, Plan, Replica, RowSplit
from fxsplit.planning.ranges import summarize_modules
from fxsplit.planning.rules import validate_plan
from fxsplit.planning.timetable import TIME_RECORD_SHAPE, is_time_record
from fxsplit.planning.yamlshapes import (
    MEMORY_SHAPE,
    REPLICAS_SHAPE,
    SPLITS_SHAPE,
    is_int,
    is_list,
    is_map,
    is_memory,
    is_offload,
    is_replicas,
    is_splits,
    is_str,
    is_str_list,
)
from fxsplit.units import format_size
from fxsplit.yamlfile import Problem, YamlPath, YamlProblems, line_of, load_yaml, short_repr

__all__ = ["FORMAT", "plan_from_yaml", "plan_to_yaml"]

FORMAT = "fxsplit-plan/1"
_WIDE = float("inf")


def _dump(value: Any, **style: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=_WIDE, sort_keys=False, **style)
    text = text.rstrip("\n")
    return text[: -len("\n...")] if text.endswith("\n...") else text


_BREAKS = ("\n", "\r", "\x85", "\u2028", "\u2029")  # what YAML reads as line breaks


def _one_line(value: Any) -> str:
    """``value`` as YAML on one line: double-quoted (breaks escaped) when another style would break lines."""
    text = _dump(value)
    return text if not any(b in text for b in _BREAKS) else _dump(value, default_style='"')


def _flow_list(items: Iterable[Any]) -> str:
    return _one_line(list(items))


def _flow_map(pairs: dict[str, Any]) -> str:
    return _one_line(pairs)


def plan_to_yaml(plan: Plan) -> str:
    """Write ``plan`` as YAML: summary and cuts first, the full placement below.

    Raises:
        SpecError: the plan's budgets, bytes or reserves name devices that
            are not among ``plan.devices``.
    """
    _check_devices(plan)
    k = _one_line
    lines = [
        "# fxsplit plan: what goes where. Above the dashed line: for reading (sizes in bytes, units in",
        "# comments); below it: the full placement. Apply with fxsplit.apply(model, Plan.from_yaml(text))",
        "# or `fxsplit code MODEL --plan FILE`; check with `fxsplit check MODEL --plan FILE`.",
        f"format: {FORMAT}",
        f"fingerprint: {k(plan.fingerprint)}",
        f"trace: {k(plan.trace)}",
        f"objective: {k(plan.objective)}",
        f"dtype: {k(plan.dtype)}",
        f"output_device: {k(plan.output_device)}",
        f"leaf_modules: {_flow_list(plan.leaf_modules)}",
        *([f"dynamic_shapes: {k(plan.dynamic_shapes)}"] if plan.dynamic_shapes else []),
        *(
            [f"activations_not_counted: {k(plan.activations_not_counted)}"]
            if plan.activations_not_counted is not None
            else []
        ),
        *([f"memory_counts: {k(plan.memory_counts)}"] if plan.memory_counts is not None else []),
        "devices:",
    ]
    for device in plan.devices:
        budget, used = plan.budgets[device], plan.device_bytes[device]
        share = f", {100 * used / budget:.1f}% of the budget" if budget else ""  # parameters and buffers
        lines.append(f"  {k(device)}:")
        lines.append(f"    budget: {k(budget)}  # {format_size(budget)}")
        if device in plan.reserved:
            lines.append(f"    reserved: {k(plan.reserved[device])}  # {format_size(plan.reserved[device])} kept free")
        streamed = f"; {format_size(plan.streamed_into(device))} streamed in per forward" if plan.streamed else ""
        lines.append(f"    used: {k(used)}  # {format_size(used)}{share}{streamed}")
        summary = summarize_modules(plan.modules.get(device, ()))
        lines.append(f"    modules: {_flow_list(summary)}  # summary, for reading")
    transfer = f"{len(plan.cuts)}, {format_size(plan.transfer_bytes)} per forward"
    if plan.streamed:
        transfer += f" between devices, {format_size(plan.stream_bytes)} streamed from offload storage"
    lines.append(f"cuts:  # {transfer}" if plan.cuts else "cuts: []")
    for cut in plan.cuts:
        entry: dict[str, Any] = {
            "value": cut.producer,
            "from": cut.source,
            "to": cut.destination,
            "bytes": cut.nbytes,
            "kind": cut.kind,
        }
        lines.append(f"- {_flow_map(entry)}  # {format_size(cut.nbytes)}")
    lines.append("tied:" if plan.tied else "tied: []")
    for group in plan.tied:
        copies = [c.destination for c in plan.cuts if c.kind == "parameter" and c.producer in group]
        entry = {"names": list(group), "device": plan.param_devices.get(group[0]), "copied_to": copies}
        held = sorted({d for name in group if name in plan.replicas for d in plan.replicas[name].devices})
        stages = bool(copies) and bool(plan.timing) and bool(plan.timing.get("stage_copies"))
        note = (
            "held by each stage that reads it (stages one per process)"
            if stages
            else "copied each forward"
            if copies
            else f"replicated on {', '.join(held)}"
            if held
            else "kept together"
        )
        lines.append(f"- {_flow_map(entry)}  # {note}")
    if plan.replicas:
        lines.append("replicas:  # read-only tensors held on more devices than their home (no copy per forward)")
    for name, replica in plan.replicas.items():
        entry = {"devices": list(replica.devices), "nbytes": replica.nbytes}
        lines.append(f"  {k(name)}: {_flow_map(entry)}  # {format_size(replica.nbytes)} on each")
    if plan.row_splits:  # op -> row bounds of its pieces (pipeline_stages)
        splits = {op: _flow_map({"weight": r.weight, "bounds": list(r.bounds)}) for op, r in plan.row_splits.items()}
        lines.extend(_block_map("row_splits", splits))
    if plan.offload:
        stored = ", ".join(f"{t} {format_size(n)}" for t, n in plan.stored_bytes.items())
        lines.append(f"offload: {_flow_map(dict(plan.offload))}  # stored: {stored or 'nothing'}")
        lines.append(f"stored_bytes: {_flow_map(dict(plan.stored_bytes))}")
    if plan.timing:
        lines.append(f"timing: {_flow_map(dict(plan.timing))}  # seconds per stage: compute, copies received")
    lines.append("# ---- full placement (exact; the summary above is derived from it) ----")
    lines.append("modules:" if plan.modules else "modules: {}")
    for device, paths in plan.modules.items():
        lines.append(f"  {k(device)}:" + ("" if paths else " []"))
        lines.extend(f"  - {k(path)}" for path in paths)
    lines.extend(_block_map("placement", {n: k(d) for n, d in plan.placement.items()}))
    lines.extend(_block_map("param_devices", {n: k(d) for n, d in plan.param_devices.items()}))
    lines.extend(_block_map("tensors", {n: k(t) for n, t in plan.tensors.items()}))
    if plan.constants:
        lines.extend(_block_map("constants", {n: k(t) for n, t in plan.constants.items()}))
    if plan.mutated:
        lines.extend(_block_map("mutated", {n: k(b) for n, b in plan.mutated.items()}))
    if plan.streamed:
        lines.extend(_block_map("streamed", {n: k(t) for n, t in plan.streamed.items()}))
    lines.append("memory:" if plan.memory else "memory: {}")
    for device, row in plan.memory.items():
        lines.append(f"  {k(device)}: {{{', '.join(f'{k(part)}: {int(size)}' for part, size in row.items())}}}")
    return "\n".join(lines) + "\n"


def _block_map(name: str, rendered: dict[str, str]) -> list[str]:
    if not rendered:
        return [f"{name}: {{}}"]
    return [f"{name}:"] + [f"  {_one_line(key)}: {value}" for key, value in rendered.items()]


def _check_devices(plan: Plan) -> None:
    known = set(plan.devices)
    for what, mapping in (("budgets", plan.budgets), ("device_bytes", plan.device_bytes)):
        if set(mapping) != known:
            raise SpecError(f"plan.{what} must have one entry per device {list(plan.devices)} (got {list(mapping)})")
    if not set(plan.reserved) <= known:
        extra = sorted(set(plan.reserved) - known)
        raise SpecError(f"plan.reserved names devices not in {list(plan.devices)}: {extra}")


def plan_from_yaml(text: str, source: str = "<plan>") -> Plan:
    """Read a plan file written by :func:`plan_to_yaml` and hold it to the rules of :mod:`fxsplit.planning.rules`.

    The text may hold at most 8 MiB and no YAML aliases (see
    :mod:`fxsplit.yamlfile`). ``source`` names the file in messages.

    Raises:
        SpecError: not YAML, not a plan file, or fields of the wrong type:
            a :class:`~fxsplit.yamlfile.YamlProblems` listing every such
            problem with its YAML path and line.
        PlanProblems: (a SpecError and a PlanMismatchError) the plan breaks
            rules a plan made by fxsplit meets (an edited fingerprint, tensors
            left out, a device without a budget, tied names on two devices);
            lists every one.
    """
    data, lines, problems = load_yaml(text, "plan", source)
    reader = _Reader(lines, problems)
    plan = reader.plan(data)
    if plan is None or reader.problems:
        raise YamlProblems(source, reader.problems)
    validate_plan(plan, source, lines)
    return plan


_Check = Callable[[Any], bool]


class _Reader:
    """Pulls typed fields out of loaded YAML, collecting every problem at its YAML path."""

    def __init__(self, lines: dict[YamlPath, int], problems: list[Problem]) -> None:
        self.lines = lines
        self.problems = list(problems)

    def problem(self, path: YamlPath, message: str) -> None:
        self.problems.append(Problem(path, line_of(path, self.lines), message))

    def field(self, mapping: Any, key: str, check: _Check, what: str, where: YamlPath = ()) -> Any:
        if not isinstance(mapping, dict) or key not in mapping:
            self.problem((*where, key), "missing")
            return None
        value = mapping[key]
        if not check(value):
            self.problem((*where, key), f"must be {what} (got {short_repr(value)})")
            return None
        return value

    def optional(self, mapping: dict[str, Any], key: str, check: _Check, what: str, where: YamlPath = ()) -> Any:
        return self.field(mapping, key, check, what, where) if key in mapping else None

    def plan(self, data: Any) -> Plan | None:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            self.problem(
                ("format",), f"must be {FORMAT!r} (got {short_repr(found)}); is this a plan file made by fxsplit?"
            )
            return None
        get = self.field
        devices = get(data, "devices", lambda v: isinstance(v, dict) and bool(v), "device -> budget, used") or {}
        budgets, used, reserved = self.devices(devices)
        cuts = tuple(self.cut(i, c) for i, c in enumerate(get(data, "cuts", is_list, "a list") or []))
        tied = [
            get(g, "names", is_str_list, "a list of names", ("tied", i))
            for i, g in enumerate(get(data, "tied", is_list, "a list") or [])
        ]
        modules = get(data, "modules", lambda v: is_map(v, is_str_list), "device -> list of module paths") or {}
        fields = {
            "placement": dict(get(data, "placement", lambda v: is_map(v, is_str), "node -> device") or {}),
            "param_devices": dict(get(data, "param_devices", lambda v: is_map(v, is_str), "name -> device") or {}),
            "output_device": get(data, "output_device", is_str, "a device name"),
            "trace": get(data, "trace", is_str, "'fx' or 'export'"),
            "objective": get(data, "objective", is_str, "an objective name"),
            "fingerprint": get(data, "fingerprint", lambda v: v is None or is_str(v), "a string or null"),
            "tensors": dict(get(data, "tensors", lambda v: is_map(v, is_str), "name -> 'dtype[shape]'") or {}),
            "dtype": get(data, "dtype", lambda v: v is None or is_str(v), "a dtype name or null"),
            "leaf_modules": tuple(get(data, "leaf_modules", is_str_list, "a list of strings") or ()),
            "memory": {d: dict(row) for d, row in (get(data, "memory", is_memory, MEMORY_SHAPE) or {}).items()},
            "dynamic_shapes": self.optional(
                data,
                "dynamic_shapes",
                lambda v: v is None or v in ("batch", "all", "custom"),
                "batch, all, custom or null",
            ),
            "activations_not_counted": self.optional(
                data, "activations_not_counted", lambda v: v is None or is_str(v), "a reason (text) or null"
            ),
            "memory_counts": self.optional(data, "memory_counts", lambda v: v is None or is_str(v), "text or null"),
            "streamed": dict(self.optional(data, "streamed", lambda v: is_map(v, is_str), "name -> tier") or {}),
            "offload": dict(self.optional(data, "offload", is_offload, "{host, disk, dir, prefetch}") or {}),
            "mutated": dict(self.optional(data, "mutated", lambda v: is_map(v, is_int), "name -> bytes") or {}),
            "constants": dict(
                self.optional(data, "constants", lambda v: is_map(v, is_str), "name -> 'dtype[shape]'") or {}
            ),
            "stored_bytes": dict(
                self.optional(data, "stored_bytes", lambda v: is_map(v, is_int), "tier -> bytes") or {}
            ),
            "replicas": {
                name: Replica(tuple(entry["devices"]), entry["nbytes"])
                for name, entry in (self.optional(data, "replicas", is_replicas, REPLICAS_SHAPE) or {}).items()
            },
            "timing": dict(self.optional(data, "timing", is_time_record, TIME_RECORD_SHAPE) or {}),
            "row_splits": {
                op: RowSplit(entry["weight"], tuple(entry["bounds"]))
                for op, entry in (self.optional(data, "row_splits", is_splits, SPLITS_SHAPE) or {}).items()
            },
        }
        known = {"format", "devices", "cuts", "tied", "modules", *fields}
        for key in [key for key in data if key not in known]:
            self.problem((key,), f"unknown key; a plan file has {', '.join(sorted(known))}")
        groups: list[Any] = data["tied"] if isinstance(data.get("tied"), list) else []
        for i, group in enumerate(groups):  # the summary's device of a tied group is its tensor's
            names: Any = group.get("names") if isinstance(group, dict) else None
            device, first = (group.get("device"), names[0]) if isinstance(names, list) and names else (None, None)
            home = fields["param_devices"].get(first)
            if device is not None and home is not None and device != home:
                self.problem(("tied", i, "device"), f"is {device!r} but param_devices puts {first!r} on {home!r}")
        if self.problems:
            return None
        return Plan(
            devices=tuple(devices),
            budgets=budgets,
            device_bytes=used,
            reserved=reserved,
            cuts=cuts,  # type: ignore[arg-type]
            tied=tuple(tuple(g) for g in tied if g is not None),
            modules={d: tuple(m) for d, m in modules.items()},
            **fields,
        )

    def devices(self, entries: dict[Any, Any]) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """``(budgets, bytes used, bytes reserved)`` per device, from the ``devices`` mapping."""
        budgets: dict[str, int] = {}
        used: dict[str, int] = {}
        reserved: dict[str, int] = {}
        for device, entry in entries.items():
            where = ("devices", device)
            if not isinstance(device, str):
                self.problem(where, "device names must be strings (quote them)")
            budgets[device] = self.field(entry, "budget", is_int, "a byte count", where)
            used[device] = self.field(entry, "used", is_int, "a byte count", where)
            if isinstance(entry, dict) and "reserved" in entry:
                reserved[device] = self.field(entry, "reserved", is_int, "a byte count", where)
        return budgets, used, reserved

    def cut(self, index: int, entry: Any) -> Cut | None:
        where = ("cuts", index)
        get = self.field
        values = (
            get(entry, "value", is_str, "a node or parameter name", where),
            get(entry, "from", is_str, "a device", where),
            get(entry, "to", is_str, "a device", where),
            get(entry, "bytes", lambda v: v is None or is_int(v), "a byte count or null", where),
            get(entry, "kind", is_str, "a cut kind", where),
        )
        return Cut(*values)
