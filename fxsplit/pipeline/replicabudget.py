"""Budgets with the weights a multi-process pipeline replicates: a stage holds every weight it reads.

:func:`fxsplit.pipeline_stages` hands each rank a stage module that holds its own
copy of every parameter and buffer its ops read (a tied embedding and head, a
buffer two stages read), where the plan counts each tensor once, on the device
of its first reader. :func:`replica_overruns` counts those copies on every
stage's device (with their gradients and optimizer state in training, at the
rate the plan's memory rows give the model's parameters) and returns the
devices that would then exceed their budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from fxsplit.cost.build import model_tensors
from fxsplit.options import Budgets, usable_bytes
from fxsplit.planning.plan import Plan
from fxsplit.planning.rules import Overrun, budget_overruns

if TYPE_CHECKING:
    from fxsplit.api import Planned

__all__ = ["charged_loads", "replica_bytes", "replica_overruns", "room_to_hold_back"]


def replica_bytes(
    plan: Plan, model: torch.nn.Module, modules: Sequence[torch.fx.GraphModule], devices: Sequence[str]
) -> dict[str, dict[str, int]]:
    """Stage device -> {model name -> bytes} of the weights its stage module holds that the plan keeps elsewhere.

    The stage modules share the model's tensors (before ``build_stage`` moves them), so each is named by identity.
    """
    names = {key: found[0][0] for key, found in model_tensors(model).items()}
    found: dict[str, dict[str, int]] = {}
    for device, module in zip(devices, modules, strict=True):
        for tensor in {id(t): t for t in [*module.parameters(), *module.buffers()]}.values():
            name = names.get(id(tensor))
            if name is not None and plan.param_devices.get(name, device) != device:
                found.setdefault(device, {})[name] = tensor.numel() * tensor.element_size()
    return found


def replica_overruns(
    plan: Plan,
    model: torch.nn.Module,
    modules: Sequence[torch.fx.GraphModule],
    devices: Sequence[str],
    reserved: Mapping[str, int] | None = None,
) -> tuple[list[Overrun], dict[str, dict[str, int]], dict[str, int]]:
    """The devices over budget once each stage (on ``devices``) holds its replicas, the replicas held, and the
    bytes charged for them per device (with their gradients and optimizer state in training).

    A plan made for stages (``PipelineConfig(processes=True)``) counts each stage's copies in its memory rows
    (``"stage_copies"``); only what a stage module holds beyond that is added. A plan whose rows do not (a file
    written before they did) gets the copies added to its rows.

    ``reserved``: what each device's budget holds back beside the replicas (default: the plan's reserve; for a
    plan whose rows do not count the copies, the plan's reserve less their charge, since the plans made then held
    back room for them in the reserve, which is lenient by up to that charge for a reserve of the user's own).
    """
    held = replica_bytes(plan, model, modules, devices)
    trainable = {found[0][0] for found in model_tensors(model).values() if found[1].requires_grad and not found[2]}
    extra = {
        device: sum(_charged(plan, nbytes, name in trainable) for name, nbytes in names.items())
        for device, names in held.items()
    }
    if not extra:
        return [], {}, {}
    counted = {d: row["stage_copies"] for d, row in plan.memory.items() if "stage_copies" in row}
    weights = {d: plan.device_bytes.get(d, 0) + max(0, extra.get(d, 0) - counted.get(d, 0)) for d in plan.devices}
    if reserved is None:
        reserved = plan.reserved if counted else {d: max(0, n - extra.get(d, 0)) for d, n in plan.reserved.items()}
    limits = Budgets(plan.budgets, reserved=reserved)
    return budget_overruns(plan, weights, limits), held, extra


def _charged(plan: Plan, nbytes: int, trainable: bool) -> int:
    """``nbytes`` of a weight with what training keeps beside it: for a parameter that takes a gradient, its
    gradient and optimizer state at the plan's rate per byte of gradient; nothing for a frozen parameter or a
    buffer (nor outside training, where no memory row holds gradients)."""
    if not trainable:
        return nbytes
    rows = plan.memory.values()
    grads = sum(row.get("grads", 0) for row in rows)
    beside = grads + sum(row.get("optimizer", 0) for row in rows)
    return nbytes + (nbytes * beside // grads if grads else 0)


def charged_loads(planned: Planned) -> dict[str, int]:
    """Device -> the bytes the partitioner charged it for ``planned``'s placement (its stages' own copies included:
    :meth:`~fxsplit.memory.model.MemoryModel.charged_loads`)."""
    assert planned.memory is not None
    return planned.memory.charged_loads(planned.plan)


def room_to_hold_back(
    planned: Planned, overruns: Sequence[Overrun], reserved: Mapping[str, int], room: Mapping[str, int]
) -> dict[str, int]:
    """Bytes to hold back on each device, beyond ``reserved``, when planning again after ``overruns``.

    The memory table a device overran by ``excess`` can count more than the partitioner charged (activations
    copied in, training state at the plan's rate), so lowering its cap by the excess alone may leave the same
    placement within it. The cap becomes what the partitioner charged that device less the excess (or the last
    room plus the excess, if more), which moves ops off it.
    """
    plan = planned.plan
    loads = charged_loads(planned)
    held = dict(room)
    for overrun in overruns:
        device = overrun.device
        usable = usable_bytes(plan.budgets.get(device, 0), reserved.get(device, 0))
        held[device] = max(held.get(device, 0) + overrun.excess, usable - loads[device] + overrun.excess)
    return {device: held.get(device, 0) for device in plan.devices}
