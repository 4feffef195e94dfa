"""Plans as YAML files: readable at the top, exact all the way down.

A plan file starts with what a person wants to see: per device its budget,
the bytes placed there and the modules it runs (ranges like ``layers.0-11``),
then every cut with its bytes and the tied tensors. Below comes the full
placement (every graph node, parameter and buffer), which makes the file
exact: ``plan_from_yaml(plan_to_yaml(plan)) == plan``.

The writer emits each line itself (so that comments with human units sit next
to the exact integers); every key and value goes through PyYAML's emitter, so
any string survives. The reader uses ``yaml.safe_load``: a plan file cannot
run code. No torch needed.

>>> from fxsplit.plan import Cut, Plan
>>> plan = Plan(devices=("cpu:0", "cpu:1"), budgets={"cpu:0": 4096, "cpu:1": 4096},
...             placement={"x": "cpu:0", "l0": "cpu:0", "l1": "cpu:1", "output": "cpu:1"},
...             param_devices={"l0.weight": "cpu:0", "l1.weight": "cpu:1"},
...             device_bytes={"cpu:0": 1024, "cpu:1": 1024},
...             cuts=(Cut("l0", "cpu:0", "cpu:1", 64),), output_device="cpu:1",
...             modules={"cpu:0": ("l0",), "cpu:1": ("l1",)})
>>> print(plan_to_yaml(plan).split("# ----")[0].split("\\n", 3)[3].rstrip())  # doctest: +NORMALIZE_WHITESPACE
format: fxsplit-plan/1
fingerprint: null
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
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import yaml

from fxsplit.errors import SpecError
from fxsplit.plan import Cut, Plan
from fxsplit.ranges import summarize_modules
from fxsplit.units import format_size

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
        ValueError: the plan's budgets, bytes or reserves name devices that
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
        *([f"activations_not_counted: {k(plan.activations_not_counted)}"]
          if plan.activations_not_counted is not None else []),
        "devices:",
    ]
    for device in plan.devices:
        budget, used = plan.budgets[device], plan.device_bytes[device]
        share = f", {100 * used / budget:.1f}% of the budget" if budget else ""
        lines.append(f"  {k(device)}:")
        lines.append(f"    budget: {k(budget)}  # {format_size(budget)}")
        if device in plan.reserved:
            lines.append(f"    reserved: {k(plan.reserved[device])}  # {format_size(plan.reserved[device])} kept free")
        lines.append(f"    used: {k(used)}  # {format_size(used)}{share}")
        summary = summarize_modules(plan.modules.get(device, ()))
        lines.append(f"    modules: {_flow_list(summary)}  # summary, for reading")
    transfer = f"{len(plan.cuts)}, {format_size(plan.transfer_bytes)} per forward"
    lines.append(f"cuts:  # {transfer}" if plan.cuts else "cuts: []")
    for cut in plan.cuts:
        entry: dict[str, Any] = {"value": cut.producer, "from": cut.source, "to": cut.destination,
                                 "bytes": cut.nbytes, "kind": cut.kind}
        lines.append(f"- {_flow_map(entry)}  # {format_size(cut.nbytes)}")
    lines.append("tied:" if plan.tied else "tied: []")
    for group in plan.tied:
        copies = [c.destination for c in plan.cuts if c.kind == "parameter" and c.producer in group]
        entry = {"names": list(group), "device": plan.param_devices.get(group[0]), "copied_to": copies}
        note = "copied each forward" if copies else "kept together"
        lines.append(f"- {_flow_map(entry)}  # {note}")
    lines.append("# ---- full placement (exact; the summary above is derived from it) ----")
    lines.append("modules:" if plan.modules else "modules: {}")
    for device, paths in plan.modules.items():
        lines.append(f"  {k(device)}:" + ("" if paths else " []"))
        lines.extend(f"  - {k(path)}" for path in paths)
    lines.extend(_block_map("placement", {n: k(d) for n, d in plan.placement.items()}))
    lines.extend(_block_map("param_devices", {n: k(d) for n, d in plan.param_devices.items()}))
    lines.extend(_block_map("tensors", {n: k(t) for n, t in plan.tensors.items()}))
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
            raise ValueError(f"plan.{what} must have one entry per device {list(plan.devices)} (got {list(mapping)})")
    if not set(plan.reserved) <= known:
        extra = sorted(set(plan.reserved) - known)
        raise ValueError(f"plan.reserved names devices not in {list(plan.devices)}: {extra}")


def plan_from_yaml(text: str) -> Plan:
    """Read a plan file written by :func:`plan_to_yaml`.

    Raises:
        SpecError: not YAML, not a plan file, or a field of the wrong type;
            every such problem is listed.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise SpecError(f"plan file is not valid YAML: {error}") from None
    reader = _Reader(data)
    plan = reader.plan()
    if reader.problems:
        listed = "\n  ".join(reader.problems)
        raise SpecError(f"not a readable fxsplit plan ({len(reader.problems)} problems):\n  {listed}")
    assert plan is not None
    return plan


class _Reader:
    """Pulls typed fields out of loaded YAML, collecting every problem."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self.problems: list[str] = []

    def field(self, mapping: Any, key: str, check: Callable[[Any], bool], what: str, where: str = "") -> Any:
        if not isinstance(mapping, dict) or key not in mapping:
            self.problems.append(f"{where}{key}: missing")
            return None
        value = mapping[key]
        if not check(value):
            self.problems.append(f"{where}{key}: must be {what} (got {value!r})")
            return None
        return value

    def plan(self) -> Plan | None:
        data = self.data
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            self.problems.append(f"format: must be {FORMAT!r} (got {found!r}); is this a plan file made by fxsplit?")
            return None
        get = self.field
        devices_data = get(data, "devices", lambda v: isinstance(v, dict) and bool(v), "device -> budget, used") or {}
        budgets: dict[str, int] = {}
        used: dict[str, int] = {}
        reserved: dict[str, int] = {}
        for device, entry in devices_data.items():
            where = f"devices[{device!r}]."
            if not isinstance(device, str):
                self.problems.append(f"{where[:-1]}: device names must be strings (quote them)")
            budgets[device] = get(entry, "budget", _is_int, "a byte count", where)
            used[device] = get(entry, "used", _is_int, "a byte count", where)
            if isinstance(entry, dict) and "reserved" in entry:
                reserved[device] = get(entry, "reserved", _is_int, "a byte count", where)
        cuts = tuple(self.cut(i, c) for i, c in enumerate(get(data, "cuts", _is_list, "a list") or []))
        tied = [get(g, "names", _is_str_list, "a list of names", f"tied[{i}].")
                for i, g in enumerate(get(data, "tied", _is_list, "a list") or [])]
        modules = get(data, "modules", lambda v: _is_map(v, _is_str_list), "device -> list of module paths") or {}
        if self.problems:
            return None
        return Plan(
            devices=tuple(devices_data),
            budgets=budgets,
            placement=dict(get(data, "placement", lambda v: _is_map(v, _is_str), "node -> device") or {}),
            param_devices=dict(get(data, "param_devices", lambda v: _is_map(v, _is_str), "name -> device") or {}),
            device_bytes=used,
            cuts=cuts,  # type: ignore[arg-type]
            output_device=get(data, "output_device", _is_str, "a device name"),
            trace=get(data, "trace", _is_str, "'fx' or 'export'"),
            objective=get(data, "objective", _is_str, "an objective name"),
            modules={d: tuple(m) for d, m in modules.items()},
            fingerprint=get(data, "fingerprint", lambda v: v is None or _is_str(v), "a string or null"),
            tensors=dict(get(data, "tensors", lambda v: _is_map(v, _is_str), "name -> 'dtype[shape]'") or {}),
            tied=tuple(tuple(g) for g in tied if g is not None),
            reserved=reserved,
            dtype=get(data, "dtype", lambda v: v is None or _is_str(v), "a dtype name or null"),
            leaf_modules=tuple(get(data, "leaf_modules", _is_str_list, "a list of strings") or ()),
            memory={d: dict(row) for d, row in (get(data, "memory", lambda v: _is_map(v, lambda r: _is_map(
                r, _is_int)), "device -> {component: bytes}") or {}).items()},
            dynamic_shapes=get(data, "dynamic_shapes", lambda v: v is None or v in ("batch", "all", "custom"),
                               "batch, all, custom or null") if "dynamic_shapes" in data else None,
            activations_not_counted=get(data, "activations_not_counted", lambda v: v is None or _is_str(v),
                                        "a reason (text) or null") if "activations_not_counted" in data else None,
        )

    def cut(self, index: int, entry: Any) -> Cut | None:
        where = f"cuts[{index}]."
        get = self.field
        values = (
            get(entry, "value", _is_str, "a node or parameter name", where),
            get(entry, "from", _is_str, "a device", where),
            get(entry, "to", _is_str, "a device", where),
            get(entry, "bytes", lambda v: v is None or _is_int(v), "a byte count or null", where),
            get(entry, "kind", _is_str, "a cut kind", where),
        )
        return Cut(*values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_list(value: Any) -> bool:
    return isinstance(value, list)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_map(value: Any, check: Callable[[Any], bool]) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and check(v) for k, v in value.items())
