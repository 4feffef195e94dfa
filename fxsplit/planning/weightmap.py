"""Plans whose weights a device map places: the ops go around them, where they copy the fewest bytes.

:func:`fxsplit.plan` reads a device map from ``device_map=`` (a spec's
``device_map:``, ``fxsplit plan --device-map``, :func:`fxsplit.from_device_map`),
or from ``pins=`` when those cannot be op pins but place every weight
(:func:`pins_as_device_map`). :func:`plan_device_map` makes the plan: two
placements of the ops, the one that copies fewer bytes per forward kept.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx

from fxsplit.callsite import user_stacklevel
from fxsplit.cost.build import GraphCosts, named_tensors
from fxsplit.errors import BudgetError, FxsplitWarning, SpecError
from fxsplit.memory.model import MemoryModel
from fxsplit.options import Budgets, Options
from fxsplit.planning.build import make_plan
from fxsplit.planning.devicemap import (
    free_readers,
    pin_readers,
    place_ops,
    read_device_map,
    value_homes,
    with_weight_homes,
    writer_pins,
)
from fxsplit.planning.plan import Plan
from fxsplit.planning.rules import budget_overruns

__all__ = ["device_map_homes", "pins_as_device_map", "plan_device_map", "refuse_with_map", "within_budgets"]

_UNLIMITED = 1 << 62


def device_map_homes(
    model: torch.nn.Module,
    device_map: Mapping[Any, Any],
    devices: Sequence[str],
    locate: Callable[..., str] | None = None,
    where: str = "device_map",
) -> dict[str, str]:
    """:func:`~fxsplit.planning.devicemap.read_device_map`, and every device it names among ``devices``.

    ``locate(where, key)`` says where an entry was written (a spec's line), for messages.

    Raises:
        SpecError: as ``read_device_map``; or the map names a device the budgets lack.
    """
    at = (lambda key: locate(where, key)) if locate is not None else None
    homes = read_device_map(model, {str(k): v for k, v in device_map.items()}, where=at)
    missing = [d for d in dict.fromkeys(homes.values()) if d not in devices]
    if missing:
        raise SpecError(
            f"{where} puts weights on {', '.join(map(repr, missing))}, which the budgets do not name "
            f"(they name {', '.join(map(repr, devices))}); add a budget for each"
        )
    return homes


def pins_as_device_map(
    model: torch.nn.Module,
    pins: Mapping[Any, Any],
    devices: Sequence[str],
    error: SpecError,
    options: Options,
    locate: Callable[..., str] | None = None,
) -> dict[str, str]:
    """``pins`` that fail as op pins (``error``), read as a device map: tensor name -> device.

    Pins are a device map when every key is ``""`` or names a module,
    parameter or buffer of ``model`` (no glob, no graph node), and together
    they place every parameter (buffers they leave out go beside their
    readers, as with ``device_map``). Then a :class:`FxsplitWarning`
    says so; otherwise ``error`` is raised, with why the map reading fails
    too when the keys are all names of the model.
    """
    keys = [str(key) for key in pins]
    known = {name for name, _ in model.named_modules(remove_duplicate=False)}
    known.update(name for name, _, _ in named_tensors(model))
    if not all(key in known for key in keys):
        raise error
    try:
        homes = device_map_homes(model, pins, devices, locate, "pins")
        refuse_with_map(options, "pins read as a device map")
    except SpecError as map_error:
        raise SpecError(
            f"{error}\nread as a device map (where the weights live) instead, the pins fail too: {map_error}"
        ) from None
    first = str(error).splitlines()[-1].strip()
    warnings.warn(
        f"pins read as a device map: as op pins they fail ({first}); every parameter and buffer goes where the "
        "longest key naming it or its module puts it, and the ops go where they copy the fewest bytes; pass the "
        "map as device_map= (or fxsplit.from_device_map, or a spec's device_map:) to say so without this warning",
        FxsplitWarning,
        stacklevel=user_stacklevel(),
    )
    return homes


def refuse_with_map(options: Options, what: str = "device_map") -> None:
    """Options a device map cannot combine with, refused.

    Raises:
        SpecError: naming them.
    """
    refused = [
        name
        for name, value in (
            ("pins", options.pins if what == "device_map" else None),
            ("together", list(options.together)),
            ("pipeline", options.pipeline),
            ("contiguous", options.contiguous),
            ("offload", options.offload),
        )
        if value
    ]
    if options.chosen_objective != "min_transfer":
        refused.append(f"objective={options.chosen_objective!r}")
    if refused:
        raise SpecError(
            f"{what} places the weights and the ops go where they copy the fewest bytes; it does not combine "
            f"with {', '.join(refused)}: drop them, or plan without the device map"
        )


def plan_device_map(
    costs: GraphCosts,
    graph_module: torch.fx.GraphModule,
    memory: MemoryModel,
    homes: Mapping[str, str],
    budgets: Budgets,
    *,
    output_device: str | None,
    trace: str,
) -> Plan:
    """The plan with every tensor where ``homes`` puts it, within ``budgets``.

    Two placements of the ops, the one whose plan copies fewer bytes per
    forward kept (the first on a tie): every op that reads weights where
    most of its weight bytes live, the others where they copy least
    (:func:`~fxsplit.planning.devicemap.place_ops`); and, from there, the
    readers free too, so that a small weight may be copied to its
    activations instead (:func:`~fxsplit.planning.devicemap.free_readers`).

    Raises:
        BudgetError: what the plan puts on a device exceeds its budget.
    """
    devices = list(budgets.devices)
    rule = place_ops(costs.problem, pin_readers(costs, homes, devices), len(devices))
    writers = writer_pins(costs, homes, devices)
    free = free_readers(costs.problem, value_homes(costs, homes, devices), rule.op_devices, len(devices), writers)
    unlimited = Budgets(dict.fromkeys(devices, _UNLIMITED))
    plans = []
    for solution in (rule, free):
        made = make_plan(
            costs, graph_module, solution, unlimited, output_device=output_device, trace=trace, objective="min_transfer"
        )
        plans.append(with_weight_homes(made, costs, graph_module, homes))
    made = min(plans, key=lambda p: p.copied_bytes)
    return within_budgets(dataclasses.replace(made, memory=memory.usage(made)), budgets)


def within_budgets(made: Plan, budgets: Budgets) -> Plan:
    """``made`` with ``budgets`` recorded.

    Raises:
        BudgetError: a device needs more than its budget less its reserve: which, and by how much.
    """
    made = dataclasses.replace(made, budgets=dict(budgets.limits), reserved=dict(budgets.reserved))
    over = budget_overruns(made)
    if over:
        raise BudgetError(
            "the device map does not fit the budgets: "
            + "; ".join(map(str, over))
            + "; raise those budgets or move modules off those devices in the map"
        )
    return made
