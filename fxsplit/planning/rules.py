"""What a plan must say about itself to be used: the rules every plan file and applied plan meets.

A plan is data a person can edit, so before a saved plan is used it is held to
the rules a plan made by fxsplit always meets. Each broken rule is a
:class:`~fxsplit.yamlfile.Problem` at the plan file's YAML path:

* its ``fingerprint`` is the one its ``tensors`` and ``tied`` groups give
  (an edited structure or fingerprint shows);
* it names every tensor it places: ``param_devices`` and ``tensors`` list the
  same names, so ``tensors`` is empty only for a model without any;
* it uses only its own devices: nodes on a budgeted device or the output
  device, tensors, bytes, modules, memory rows and reserves on budgeted ones;
* the names of a tied group (one tensor) share one device;
* each device's bytes fit its budget, and each cut goes from one device to
  another, once per value and destination, with a known kind.

:func:`plan_problems` lists them (no torch needed); :mod:`fxsplit.planning.yamlio`
reports them for plan files, :mod:`fxsplit.planning.apply` before a plan is
applied, and :func:`fxsplit.check.verify_plan` as invariants.

>>> from fxsplit.planning.plan import Plan
>>> plan = Plan(devices=("cpu:0",), budgets={"cpu:0": 64}, placement={}, param_devices={"w": "cpu:1"},
...             device_bytes={"cpu:0": 0}, cuts=(), output_device="cpu:0", fingerprint="sha256:0")
>>> for problem in plan_problems(plan):
...     print(problem.render("<plan>"))  # doctest: +ELLIPSIS
<plan>: fingerprint: is 'sha256:0' but the plan's tensors and tied groups give 'sha256:...'; ...
<plan>: tensors: is empty but param_devices places 1 tensor(s); ...
<plan>: param_devices['w']: 'w' is placed on 'cpu:1', which has no budget (devices: cpu:0)
"""

from __future__ import annotations

from typing import Callable

from fxsplit.errors import PlanMismatchError
from fxsplit.planning.fingerprint import fingerprint_of
from fxsplit.planning.plan import CUT_KINDS, Plan
from fxsplit.yamlfile import Problem, YamlPath, YamlProblems, line_of, short_repr

__all__ = ["PlanProblems", "plan_problems", "validate_plan"]

_REMAKE = "make the plan again with fxsplit.plan (or `fxsplit plan`)"


class PlanProblems(YamlProblems, PlanMismatchError):
    """A plan (file) that breaks the rules of :mod:`fxsplit.planning.rules`: a SpecError and a PlanMismatchError."""


def validate_plan(plan: Plan, source: str = "<plan>", lines: dict[YamlPath, int] | None = None) -> None:
    """Raise :class:`PlanProblems` listing every rule ``plan`` breaks, by line (``lines``: YAML path -> line)."""
    problems = plan_problems(plan)
    if problems:
        where = lines or {}
        located = [Problem(p.path, line_of(p.path, where), p.message) for p in problems]
        raise PlanProblems(source, sorted(located, key=lambda p: p.line or 0))


def plan_problems(plan: Plan) -> list[Problem]:
    """Every rule ``plan`` breaks, in the order of its file, each at its YAML path (no lines)."""
    found: list[Problem] = []

    def problem(path: YamlPath, message: str) -> None:
        found.append(Problem(path, None, message))

    _record_problems(plan, problem)
    _device_problems(plan, problem)
    _tied_problems(plan, problem)
    _cut_problems(plan, problem)
    return found


_Report = Callable[[YamlPath, str], None]


def _record_problems(plan: Plan, problem: _Report) -> None:
    """The recorded structure: fingerprint, and ``tensors`` naming what ``param_devices`` places."""
    expected = fingerprint_of(plan.tensors, plan.tied)
    if plan.fingerprint != expected:
        problem(
            ("fingerprint",),
            f"is {short_repr(plan.fingerprint)} but the plan's tensors and tied groups give "
            f"{expected!r}; the plan was edited or damaged: {_REMAKE}",
        )
    if plan.param_devices and not plan.tensors:
        problem(
            ("tensors",),
            f"is empty but param_devices places {len(plan.param_devices)} tensor(s); a plan "
            f"records the name, dtype and shape of every tensor it places: {_REMAKE}",
        )
        return
    for name in plan.param_devices:
        if name not in plan.tensors:
            problem(("param_devices", name), f"{short_repr(name)} is not listed under tensors")
    for name in plan.tensors:
        if name not in plan.param_devices:
            problem(("tensors", name), f"{short_repr(name)} has no device in param_devices")


def _device_problems(plan: Plan, problem: _Report) -> None:
    """Everything is placed on the plan's own devices, and each device's bytes fit its budget."""
    budgeted = set(plan.devices)
    listing = ", ".join(plan.devices)
    for name, device in plan.placement.items():
        if device not in budgeted and device != plan.output_device:
            problem(
                ("placement", name),
                f"node {short_repr(name)} is placed on {short_repr(device)}, which is "
                f"neither a budget device ({listing}) nor the output device",
            )
    for name, device in plan.param_devices.items():
        if device not in budgeted:
            problem(
                ("param_devices", name),
                f"{short_repr(name)} is placed on {short_repr(device)}, which has no budget (devices: {listing})",
            )
    for device in plan.devices:
        if device not in plan.budgets:
            problem(("devices", device), f"{short_repr(device)} has no budget")
    for what, keys in (
        ("budgets", plan.budgets),
        ("device_bytes", plan.device_bytes),
        ("modules", plan.modules),
        ("memory", plan.memory),
        ("reserved", plan.reserved),
    ):
        for device in keys:
            if device not in budgeted:
                problem(
                    ("devices", device) if what in ("budgets", "device_bytes", "reserved") else (what, device),
                    f"{what} names {short_repr(device)}, which is not one of the devices ({listing})",
                )
    for device, used in plan.device_bytes.items():
        budget = plan.budgets.get(device)
        if budget is not None and used > budget:
            problem(
                ("devices", device, "used"), f"{short_repr(device)} holds {used} bytes, over its budget of {budget}"
            )


def _tied_problems(plan: Plan, problem: _Report) -> None:
    """Each tied group names tensors of the plan, all on one device."""
    for index, group in enumerate(plan.tied):
        unknown = [name for name in group if name not in plan.tensors]
        if unknown:
            problem(("tied", index), f"names {', '.join(map(short_repr, unknown[:5]))}, not listed under tensors")
        homes = {name: plan.param_devices[name] for name in group if name in plan.param_devices}
        if len(set(homes.values())) > 1:
            where = ", ".join(f"{short_repr(name)} on {short_repr(device)}" for name, device in homes.items())
            problem(
                ("tied", index),
                f"tied names are one tensor, so they share one device, but param_devices puts "
                f"{where}; give them one device",
            )


def _cut_problems(plan: Plan, problem: _Report) -> None:
    """Each cut goes between two known devices, once per value and destination, with a known kind and size."""
    known = set(plan.devices) | {plan.output_device}
    seen: set[tuple[str, str]] = set()
    for index, cut in enumerate(plan.cuts):
        name = short_repr(cut.producer)
        if cut.source == cut.destination:
            problem(("cuts", index), f"cut of {name} goes from {short_repr(cut.source)} to itself")
        if (cut.producer, cut.destination) in seen:
            problem(("cuts", index), f"{name} is cut to {short_repr(cut.destination)} more than once")
        seen.add((cut.producer, cut.destination))
        if cut.source not in known or cut.destination not in known:
            problem(
                ("cuts", index),
                f"cut of {name} names an unknown device ({short_repr(cut.source)} -> {short_repr(cut.destination)})",
            )
        if cut.kind not in CUT_KINDS:
            problem(("cuts", index), f"cut of {name} has unknown kind {short_repr(cut.kind)}")
        if cut.nbytes is not None and cut.nbytes < 0:
            problem(("cuts", index), f"cut of {name} has negative size {cut.nbytes}")
