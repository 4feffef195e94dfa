"""Plan from an Accelerate ``device_map``: the weights where the map says, the ops where they copy least.

:func:`from_device_map` wires the stages as :func:`fxsplit.plan` does, with the
weights fixed: :mod:`fxsplit.planning.devicemap` reads the map and places the ops.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from fxsplit.api import trace_and_plan
from fxsplit.errors import BudgetError, SpecError
from fxsplit.options import Budgets
from fxsplit.planning.build import make_plan
from fxsplit.planning.devicemap import map_devices, pin_readers, place_ops, read_device_map, with_weight_homes
from fxsplit.planning.plan import Plan
from fxsplit.planning.rules import budget_overruns, device_needs
from fxsplit.validate import require_module

__all__ = ["from_device_map"]

_REFUSED = ("pins", "together", "pipeline", "contiguous", "objective", "spec")
_MIB = 1 << 20
_UNLIMITED = 1 << 62


def from_device_map(
    model: torch.nn.Module,
    device_map: Mapping[Any, Any],
    budgets: Any = None,
    *,
    example_inputs: Any = None,
    devices: Mapping[Any, Any] | None = None,
    **options: Any,
) -> Plan:
    """The plan that keeps every parameter and buffer where an Accelerate ``device_map`` puts it.

    The map's keys are module or tensor names (``""``: the whole model); the
    longest key naming a tensor or a module holding it places the tensor.
    Values are ints (``cuda:N``), strings (``"cuda:1"``, ``"cpu"``) or
    ``torch.device``. Modules that run no op of the graph (a tied embedding,
    an unused head) are fine: only weights are placed. Each op that reads
    weights runs where most of its weight bytes live; the other ops where the
    fewest bytes are copied. ``plan.param_devices`` is the map's placement,
    ``plan.transfer_bytes`` what it costs per forward; compare it with
    :func:`fxsplit.plan` under the same budgets. The model is not modified;
    :func:`fxsplit.apply` turns the plan into a split.

    Args:
        model: the module.
        device_map: module or tensor name -> device, as Accelerate writes it.
        budgets: device -> bytes or size string, in stage order, holding
            every device of the map. None: each device of the map in order of
            appearance, its budget what the plan needs there plus a quarter,
            rounded up to a MiB.
        example_inputs: as for :func:`fxsplit.plan`.
        devices: what the map's values mean, read before anything else,
            e.g. ``{0: "cpu:0", 1: "cpu:1"}`` to plan an Accelerate map on
            logical CPU devices.
        **options: the options of :func:`fxsplit.plan` but ``pins``,
            ``together``, ``pipeline``, ``contiguous``, ``objective`` and ``spec``.

    Raises:
        SpecError: the map leaves tensors out, names what the model lacks,
            offloads (``"disk"``), splits a tied tensor, or names a device
            the budgets lack; or a refused option.
        BudgetError: what the map puts on a device exceeds its budget.

    Example:
        >>> import torch, fxsplit
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
        >>> p = fxsplit.from_device_map(model, {"0": "cpu:0", "2": "cpu:1"}, example_inputs=(torch.randn(2, 64),))
        >>> p.param_devices
        {'0.bias': 'cpu:0', '0.weight': 'cpu:0', '2.bias': 'cpu:1', '2.weight': 'cpu:1'}
        >>> [(c.producer, c.destination, c.nbytes) for c in p.cuts]
        [('relu', 'cpu:1', 512)]
    """
    require_module(model)
    refused = [name for name in _REFUSED if name in options]
    if refused:
        raise SpecError(
            f"from_device_map does not take {', '.join(refused)}: the device map places the weights; "
            "use fxsplit.plan for these options"
        )
    homes = read_device_map(model, device_map, devices)
    order = list(dict.fromkeys(map_devices(device_map, devices).values()))
    given = Budgets.parse(budgets, options.get("reserve")) if budgets is not None else None
    if given is not None:
        missing = [d for d in order if d not in given.devices]
        if missing:
            raise SpecError(
                f"the device map puts weights on {', '.join(map(repr, missing))}, which the budgets do not name "
                f"(they name {', '.join(map(repr, given.devices))}); add a budget for each"
            )
        order = list(given.devices)
    planned = trace_and_plan(model, dict.fromkeys(order, _UNLIMITED), example_inputs, options)
    costs, traced = planned.costs, planned.traced
    solution = place_ops(costs.problem, pin_readers(costs, homes, order), len(order))
    chosen = planned.options.output_device if planned.options is not None else None
    made = make_plan(
        costs,
        traced.graph_module,
        solution,
        Budgets(dict.fromkeys(order, _UNLIMITED)),
        output_device=planned.plan.output_device if chosen is not None else None,
        trace=traced.method,
        objective="min_transfer",
    )
    record = {f: getattr(planned.plan, f) for f in ("fingerprint", "tensors", "tied", "dtype", "leaf_modules")}
    record.update(
        dynamic_shapes=planned.plan.dynamic_shapes, activations_not_counted=planned.plan.activations_not_counted
    )
    made = with_weight_homes(dataclasses.replace(made, **record), costs, traced.graph_module, homes)
    if planned.memory is not None:
        made = dataclasses.replace(made, memory=planned.memory.usage(made))
    return _within(made, given if given is not None else _default_budgets(made, options.get("reserve")))


def _default_budgets(made: Plan, reserve: Any) -> Budgets:
    needs = device_needs(made)
    limits = {d: max(1, -(-(needs[d] * 5 // 4) // _MIB)) * _MIB for d in made.devices}
    return Budgets.parse(limits, reserve)


def _within(made: Plan, budgets: Budgets) -> Plan:
    made = dataclasses.replace(made, budgets=dict(budgets.limits), reserved=dict(budgets.reserved))
    over = budget_overruns(made)
    if over:
        raise BudgetError(
            "the device map does not fit the budgets: "
            + "; ".join(map(str, over))
            + "; raise those budgets or move modules off those devices in the map"
        )
    return made
