"""Weights that each stage of a multi-process pipeline holds itself, as the time estimate charges them.

:func:`fxsplit.pipeline_stages` hands every rank a stage module holding its own copy of each
parameter, buffer and constant its ops read (:mod:`fxsplit.pipeline.stages`, ``relay=True``), so no
weight is sent from stage to stage; fxsplit's in-process pipeline (:mod:`fxsplit.pipeline.gpipe`)
instead sends a weight to every other stage that reads it, each micro-batch. This module is where the
planner learns the difference:

* :func:`held_by_stages`: whether the pipeline option says so (``PipelineConfig(processes=True)``, what
  ``pipeline_stages`` plans with); without it ``fxsplit.plan(pipeline=...)`` plans for the in-process
  run, whose copies are real.
* :func:`without_weight_copies`: the problem every objective and the time estimate see then: every
  weight value copies nothing (activations crossing stages are charged as before).
* :func:`reduced_gradients` and :func:`allreduce_seconds`: in training, each trainable parameter read on
  several stages has its copies' gradients summed once per step
  (:meth:`~fxsplit.pipeline.distributed.PipelineStages.reduce_tied_grads`, the same rule: a parameter
  that requires a gradient, held by more than one stage). A ring all-reduce of ``B`` bytes over ``k``
  holders sends and receives ``2 (k - 1) / k * B`` per holder in ``2 (k - 1)`` steps, so over the
  slowest link between holders it takes ``2 (k - 1) * (latency + B / (k * bandwidth))``: for two
  stages ``2 * latency + B / bandwidth``.

>>> from fxsplit.hardware import Link
>>> allreduce_seconds(3_000_000, [Link(3e9, 1e-5)] * 2)  # two holders: each sends and receives half twice
0.00102
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from fxsplit.errors import BudgetError
from fxsplit.hardware import Link
from fxsplit.options import PipelineConfig
from fxsplit.partition.problem import PartitionProblem
from fxsplit.partition.refine import device_loads
from fxsplit.partition.result import Partition
from fxsplit.units import format_size

__all__ = ["allreduce_seconds", "held_by_stages", "held_copies_error", "reduced_gradients", "without_weight_copies"]

ALLREDUCE_PASSES = 2  # a ring all-reduce: reduce-scatter, then all-gather


def held_by_stages(pipeline: Any) -> bool:
    """Whether ``pipeline`` (an ``Options.pipeline``) runs stages that each hold every weight their ops read."""
    return isinstance(pipeline, PipelineConfig) and pipeline.processes


def without_weight_copies(problem: PartitionProblem, weight_values: Sequence[int]) -> PartitionProblem:
    """``problem`` in which no weight (the values at ``weight_values``, -1 for unread ones) is ever copied:
    each device that reads one holds it (``held``: charged to every such device's budget)."""
    weights = {index for index in weight_values if index >= 0}
    values = tuple(
        value._replace(nbytes=0) if index in weights and value.nbytes else value
        for index, value in enumerate(problem.values)
    )
    return dataclasses.replace(problem, values=values, held=tuple(sorted(weights)))


def reduced_gradients(
    problem: PartitionProblem,
    weights: Sequence[tuple[str, int, int]],
    trainable: Mapping[str, int],
    op_devices: Sequence[str],
    devices: Sequence[str],
    rows: Mapping[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Canonical name -> ``{"devices": holders in stage order, "nbytes": gradient bytes}`` of each trainable
    parameter whose readers run on several devices.

    ``weights``: ``(canonical name, bytes, value index)`` of each weight (index -1: not read);
    ``trainable``: the names of the parameters that take a gradient; ``op_devices``: each op's device;
    ``rows``: the row parameters of split ops -> the weight whose rows they hold
    (:mod:`fxsplit.tracing.rowsplit`): their devices hold part of that weight, and its whole gradient is
    all-reduced over them and its other holders (:mod:`fxsplit.pipeline.tiedgrads`).
    """
    rows = rows or {}
    parts: dict[str, set[str]] = {}
    for name, _, index in weights:
        if index >= 0 and name in rows:
            parts.setdefault(rows[name], set()).update(op_devices[op] for op in problem.values[index].consumers)
    found: dict[str, dict[str, Any]] = {}
    for name, nbytes, index in weights:
        if index < 0 or name not in trainable or name in rows:
            continue
        readers = {op_devices[op] for op in problem.values[index].consumers} | parts.get(name, set())
        if len(readers) > 1:
            found[name] = {"devices": [d for d in devices if d in readers], "nbytes": nbytes}
    return found


def allreduce_seconds(nbytes: float, links: Sequence[Link]) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` among ``len(links)`` holders, the ring's ``links`` between them
    (the slowest sets the pace): ``2 (k - 1) * (latency + nbytes / (k * bandwidth))``."""
    holders = len(links)
    if holders < 2:
        return 0.0
    bandwidth = min(link.bandwidth for link in links)
    latency = max(link.latency for link in links)
    return ALLREDUCE_PASSES * (holders - 1) * (latency + nbytes / (holders * bandwidth))


def held_copies_error(
    problem: PartitionProblem,
    caps: Sequence[int],
    devices: Sequence[str],
    split: Callable[[PartitionProblem], Partition],
) -> BudgetError | None:
    """Why no split fits when stages hold their own copies (``problem.held``) but one fits without them: the
    error names the copies the split that fits without them would hold and the devices they overflow; None
    when nothing fits without them either (the partitioner's own message says why)."""
    if not problem.held:
        return None
    try:
        placed = split(dataclasses.replace(problem, held=()))
    except BudgetError:
        return None
    op_devices = placed.op_devices
    last = problem.num_ops - 1
    copies: dict[int, list[str]] = {}
    for index in problem.held:
        value = problem.values[index]
        if value.weight and value.consumers:
            home = op_devices[min(value.start, last)]
            for device in sorted({op_devices[op] for op in value.consumers} - {home}):
                copies.setdefault(device, []).append(f"{value.name} ({format_size(value.weight)})")
    loads = device_loads(problem, op_devices, len(caps))
    over = [
        f"'{devices[k]}' holds {format_size(load)} but may hold {format_size(caps[k])}: over by "
        f"{format_size(load - caps[k])} ({load - caps[k]} bytes)"
        for k, load in enumerate(loads)
        if load > caps[k]
    ]
    if not over:
        return None
    where = "; ".join(f"{devices[k]}: {', '.join(names)}" for k, names in sorted(copies.items()))
    return BudgetError(
        "stages run one per process (pipeline_stages) each hold their own copy of every weight they read, and no "
        f"split into stages in order fits with those copies. The split that fits without them gives these stages "
        f"copies of weights kept on another stage: {where}. With them, {'; '.join(over)}. Give those devices that "
        "much more budget, or pin the ops that read the weight to one stage (pins=)"
    )
