"""Plan from an Accelerate ``device_map``: the weights where the map says, the ops where they copy least.

:func:`from_device_map` is :func:`fxsplit.plan` with ``device_map=``, its values
translated and its budgets sized when none are given: :mod:`fxsplit.planning.devicemap`
reads the map, :mod:`fxsplit.planning.weightmap` places the ops.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from fxsplit.api import trace_and_plan
from fxsplit.errors import SpecError
from fxsplit.options import Budgets
from fxsplit.planning.devicemap import map_devices, read_device_map
from fxsplit.planning.plan import Plan
from fxsplit.planning.rules import device_needs
from fxsplit.planning.weightmap import within_budgets
from fxsplit.validate import require_module, unwrapped

__all__ = ["from_device_map"]

_REFUSED = ("pins", "device_map", "together", "pipeline", "contiguous", "objective", "spec")
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
    an unused head) are fine: only weights are placed. The ops go where the
    fewest bytes are copied, reading a weight on another device costing its
    bytes (:func:`~fxsplit.planning.weightmap.plan_device_map`); the same as
    ``fxsplit.plan(model, budgets, device_map=...)``. ``plan.param_devices`` is the map's placement,
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
        **options: the options of :func:`fxsplit.plan` but ``pins``, ``device_map``,
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
    model = unwrapped(model)
    require_module(model)
    refused = [name for name in _REFUSED if name in options]
    if refused:
        raise SpecError(
            f"from_device_map does not take {', '.join(refused)}: the device map places the weights; "
            "use fxsplit.plan for these options"
        )
    homes = read_device_map(model, device_map, devices)
    if budgets is None:  # each device of the map, in order of appearance; sized once the plan is made
        order = list(dict.fromkeys(map_devices(device_map, devices).values()))
        made = trace_and_plan(model, dict.fromkeys(order, _UNLIMITED), example_inputs, {**options, "device_map": homes})
        return within_budgets(made.plan, _default_budgets(made.plan, options.get("reserve")))
    return trace_and_plan(model, budgets, example_inputs, {**options, "device_map": homes}).plan


def _default_budgets(made: Plan, reserve: Any) -> Budgets:
    needs = device_needs(made)
    limits = {d: max(1, -(-(needs[d] * 5 // 4) // _MIB)) * _MIB for d in made.devices}
    return Budgets.parse(limits, reserve)
