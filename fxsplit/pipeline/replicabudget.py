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

from typing import Mapping, Sequence

import torch

from fxsplit.cost.build import model_tensors
from fxsplit.options import Budgets
from fxsplit.planning.plan import Plan
from fxsplit.planning.rules import Overrun, budget_overruns

__all__ = ["replica_bytes", "replica_overruns"]


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

    ``reserved``: what each device's budget holds back beside the replicas (default: the plan's reserve less
    the replicas' charge, as :func:`fxsplit.pipeline_stages` holds back room for them when it plans again).
    """
    held = replica_bytes(plan, model, modules, devices)
    extra = {device: _charged(plan, sum(names.values())) for device, names in held.items()}
    if not extra:
        return [], {}, {}
    weights = {d: plan.device_bytes.get(d, 0) + extra.get(d, 0) for d in plan.devices}
    if reserved is None:
        reserved = {d: max(0, n - extra.get(d, 0)) for d, n in plan.reserved.items()}
    limits = Budgets(plan.budgets, reserved=reserved)
    return budget_overruns(plan, weights, limits), held, extra


def _charged(plan: Plan, nbytes: int) -> int:
    """``nbytes`` of weights with what training keeps beside them (gradients, optimizer state), at the plan's rate."""
    rows = plan.memory.values()
    held = sum(row.get("params", 0) + row.get("buffers", 0) for row in rows)
    beside = sum(row.get("grads", 0) + row.get("optimizer", 0) for row in rows)
    return nbytes + (nbytes * beside // held if held else 0)
