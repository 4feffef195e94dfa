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
* a replica (:attr:`~fxsplit.planning.plan.Plan.replicas`) is of a resident tensor the forward does not
  write, on budgeted devices other than its home;
* each cut goes from one device to another, once per value and destination,
  with a known kind.

:func:`plan_problems` lists them (no torch needed); :mod:`fxsplit.planning.yamlio`
reports them for plan files, :mod:`fxsplit.planning.apply` before a plan is
applied, and :func:`fxsplit.check.verify_plan` as invariants.

The budget rule is :func:`budget_overruns`, the one place it is written: what
a device needs (its parameters and buffers plus the rest of its memory row:
gradients, optimizer state, activations) must fit its budget less its reserve.
:func:`fxsplit.memory.fit_budgets` plans until it holds, ``verify_plan`` checks
it on the plan's own numbers, and ``apply`` / ``check_plan`` with the model's own
tensors (a file whose numbers were edited is no proof).

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

from dataclasses import dataclass
from typing import Callable, Mapping

from fxsplit.errors import PlanMismatchError
from fxsplit.options import STORAGE_TIERS, Budgets, usable_bytes
from fxsplit.planning.fingerprint import fingerprint_of
from fxsplit.planning.plan import CUT_KINDS, Cut, Plan
from fxsplit.units import format_size
from fxsplit.yamlfile import Problem, YamlPath, YamlProblems, line_of, short_repr

__all__ = ["Overrun", "PlanProblems", "budget_overruns", "device_needs", "plan_problems", "validate_plan"]

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
    _streamed_problems(plan, problem)
    _replica_problems(plan, problem)
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
        if name not in plan.tensors and name not in plan.constants:
            problem(("param_devices", name), f"{short_repr(name)} is not listed under tensors (nor constants)")
    for name in plan.tensors:
        if name not in plan.param_devices:
            problem(("tensors", name), f"{short_repr(name)} has no device in param_devices")


def _device_problems(plan: Plan, problem: _Report) -> None:
    """Everything is placed on the plan's own devices."""
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
    for what, sizes in (("budget", plan.budgets), ("used", plan.device_bytes), ("reserved", plan.reserved)):
        for device, nbytes in sizes.items():
            if nbytes < 0:
                problem(("devices", device, what), f"{what} of {short_repr(device)} is negative ({nbytes} bytes)")
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


def _stream_problems(plan: Plan, index: int, cut: Cut, problem: _Report) -> None:
    """A stream cut copies a weight the plan stores off the devices, from where it is stored, to a device."""
    name = short_repr(cut.producer)
    stored = plan.streamed.get(cut.producer)
    if stored is None:
        problem(("cuts", index), f"streams {name}, which streamed does not list (it is resident)")
    elif cut.source != stored:
        problem(("cuts", index), f"streams {name} from {short_repr(cut.source)} but streamed stores it in {stored!r}")
    if cut.destination not in plan.devices:
        problem(("cuts", index), f"streams {name} to {short_repr(cut.destination)}, which has no budget")


def _streamed_problems(plan: Plan, problem: _Report) -> None:
    """Streamed weights are tensors of the plan, stored in a known tier."""
    for name, tier in plan.streamed.items():
        if tier not in STORAGE_TIERS:
            problem(("streamed", name), f"stores {short_repr(name)} in {short_repr(tier)}, not one of {STORAGE_TIERS}")
        if name not in plan.param_devices:
            problem(("streamed", name), f"{short_repr(name)} has no device in param_devices")
    if plan.streamed and plan.stored_bytes.get("disk") and not plan.offload.get("dir"):
        problem(("offload", "dir"), "weights are stored on disk but the plan names no offload dir")


def _replica_problems(plan: Plan, problem: _Report) -> None:
    """Replicas are of resident, read-only tensors of the plan, on other budgeted devices, each once."""
    for name, replica in plan.replicas.items():
        where = ("replicas", name)
        home = plan.param_devices.get(name)
        if home is None:
            problem(where, f"{short_repr(name)} has no device in param_devices")
        if name in plan.streamed or name in plan.mutated:
            why = "streamed from offload storage" if name in plan.streamed else "written in place by the forward"
            problem(where, f"{short_repr(name)} is {why}, so it cannot be held on several devices")
        for device in replica.devices:
            if device not in plan.devices or device == home:
                what = "its home" if device == home else "not one of the devices"
                problem(where, f"replicates {short_repr(name)} on {short_repr(device)}, {what}")
        if not replica.devices or len(set(replica.devices)) != len(replica.devices) or replica.nbytes < 0:
            problem(where, f"replica of {short_repr(name)} needs distinct devices and bytes >= 0 (got {replica})")


def _cut_problems(plan: Plan, problem: _Report) -> None:
    """Each cut goes between two known devices, with a known kind and size.

    A value may be cut to one device more than once: again after each write to the tensor it shares storage
    with (the copy taken before would miss it); whether the cuts are those the placement implies is checked
    against the graph (:func:`fxsplit.planning.apply.check_plan`).
    """
    known = set(plan.devices) | {plan.output_device}
    for index, cut in enumerate(plan.cuts):
        name = short_repr(cut.producer)
        if cut.kind == "stream":
            _stream_problems(plan, index, cut, problem)
            continue
        if cut.source == cut.destination:
            problem(("cuts", index), f"cut of {name} goes from {short_repr(cut.source)} to itself")
        if cut.source not in known or cut.destination not in known:
            problem(
                ("cuts", index),
                f"cut of {name} names an unknown device ({short_repr(cut.source)} -> {short_repr(cut.destination)})",
            )
        if cut.kind not in CUT_KINDS:
            problem(("cuts", index), f"cut of {name} has unknown kind {short_repr(cut.kind)}")
        if cut.nbytes is not None and cut.nbytes < 0:
            problem(("cuts", index), f"cut of {name} has negative size {cut.nbytes}")


_REST = {
    "grads": "gradients",
    "optimizer": "optimizer state",
    "stage_copies": "the stage's own copies of weights kept on other devices",
    "activations_peak": "activations peak",
    "optimizer_step": "what optimizer.step() adds",
    "streaming": "streaming buffers",
}


def device_needs(plan: Plan, weights: Mapping[str, int] | None = None) -> dict[str, int]:
    """Bytes each device of ``plan`` needs: parameters and buffers plus the rest of its memory row.

    The rest is ``memory[d]["total"]`` less its ``params`` and ``buffers``
    (0 without a memory row), so for a plan as fxsplit made it this is the
    memory total, or ``device_bytes`` when the plan has no breakdown.

    Args:
        plan: the plan.
        weights: device -> bytes of parameters and buffers placed there, as
            counted from the model (default: the plan's ``device_bytes``).
    """
    held = plan.device_bytes if weights is None else weights
    return {d: held.get(d, 0) + _rest(plan, d) for d in plan.devices}


def _rest(plan: Plan, device: str) -> int:
    row = plan.memory.get(device, {})
    return max(0, row.get("total", 0) - row.get("params", 0) - row.get("buffers", 0))


@dataclass(frozen=True)
class Overrun:
    """A device that needs more than it may hold (its budget less its reserve).

    Attributes:
        device: the device.
        weights: bytes of parameters and buffers placed there.
        rest: bytes of the rest of its memory (gradients, optimizer state,
            activations), 0 without a memory breakdown.
        rest_is: what ``rest`` holds, in words (``"activations peak"``).
        usable: bytes it may hold.
        budget: its full budget.
        reserved: bytes held back from the budget.
    """

    device: str
    weights: int
    rest: int
    rest_is: str
    usable: int
    budget: int
    reserved: int
    unbudgeted: bool = False  # the budgets it was held to do not name the device

    @property
    def needs(self) -> int:
        """Bytes the device needs in all."""
        return self.weights + self.rest

    @property
    def excess(self) -> int:
        """Bytes over what it may hold."""
        return self.needs - self.usable

    def __str__(self) -> str:
        held = f"{format_size(self.weights)} ({self.weights} bytes) of parameters and buffers"
        if self.rest:
            held += f" and {format_size(self.rest)} of {self.rest_is}, "
            held += f"{format_size(self.needs)} ({self.needs} bytes) in all,"
        if self.unbudgeted:
            return (
                f"{short_repr(self.device)} holds {held} but has no budget in the budgets given, so it may hold "
                "nothing: give it a budget, or plan again without it"
            )
        limit = format_size(self.usable)
        if self.reserved:
            limit += f" (its budget {format_size(self.budget)} less {format_size(self.reserved)} reserved)"
        return (
            f"{short_repr(self.device)} holds {held} but may hold {limit}: "
            f"over by {format_size(self.excess)} ({self.excess} bytes)"
        )


def budget_overruns(
    plan: Plan, weights: Mapping[str, int] | None = None, budgets: Budgets | None = None
) -> list[Overrun]:
    """The devices of ``plan`` that need more (:func:`device_needs`) than their budget less their reserve.

    Args:
        plan: the plan.
        weights: bytes of parameters and buffers per device, from the model
            (default: the plan's ``device_bytes``).
        budgets: budgets to hold the plan to (default: its own, ``plan.budgets``
            less ``plan.reserved``; a device without a budget there is another
            rule's problem and skipped). A device ``budgets`` leaves out may
            hold nothing.
    """
    limits = plan.budgets if budgets is None else budgets.limits
    reserves = plan.reserved if budgets is None else budgets.reserved
    found = []
    for device, needs in device_needs(plan, weights).items():
        if budgets is None and device not in limits:
            continue
        budget, reserved = limits.get(device, 0), reserves.get(device, 0)
        usable = usable_bytes(budget, reserved)
        if needs > usable:
            rest = _rest(plan, device)
            missing = budgets is not None and device not in limits
            found.append(Overrun(device, needs - rest, rest, _rest_is(plan, device), usable, budget, reserved, missing))
    return found


def _rest_is(plan: Plan, device: str) -> str:
    row = plan.memory.get(device, {})
    named = [words for key, words in _REST.items() if row.get(key)]
    return " and ".join([", ".join(named[:-1]), named[-1]] if len(named) > 1 else named) or "other memory"
