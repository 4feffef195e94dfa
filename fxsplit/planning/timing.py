"""Time for planning: seconds per op on each device (:func:`op_timing`) and the stage times a plan gets
(:func:`timing_record`, kept in :attr:`Plan.timing <fxsplit.planning.plan.Plan.timing>`).

Op seconds are estimated from each op's FLOPs and bytes (:mod:`fxsplit.cost.compute`) on the
device's speed (:class:`~fxsplit.hardware.Hardware`), or measured (``profile=True``). A training
step adds each op's backward (:attr:`~fxsplit.cost.compute.Work.train_flops` and ``train_nbytes``: a
product's gradients, weight gradients, batch statistics; see :mod:`fxsplit.cost.compute`) and counts each copy
twice (the value forward, its gradient back).
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.fx

from fxsplit.callsite import user_stacklevel
from fxsplit.cost.build import GraphCosts
from fxsplit.cost.compute import op_seconds, op_work
from fxsplit.errors import FxsplitWarning
from fxsplit.hardware import Hardware, Link
from fxsplit.options import Options, PipelineConfig
from fxsplit.partition.problem import PartitionProblem
from fxsplit.partition.throughput import Timing, stage_times
from fxsplit.planning.plan import Plan
from fxsplit.planning.stagecopies import allreduce_seconds, held_by_stages, reduced_gradients, without_weight_copies

__all__ = [
    "PROFILE_REPEATS",
    "TRAINING_COPIES",
    "measure_ops",
    "op_timing",
    "timing_for",
    "copied_problem",
    "timing_record",
    "wants_timing",
]

PROFILE_REPEATS = 5  # runs of the graph per device with profile=True; each op's time is its median
TRAINING_COPIES = 2.0  # a training step's copies per cut: the value forward and its gradient back


def op_timing(
    graph_module: torch.fx.GraphModule,
    ops: Sequence[torch.fx.Node],
    devices: Sequence[str],
    hardware: Hardware,
    *,
    dtype: torch.dtype | None = None,
    training: bool = False,
    measured: Mapping[str, Sequence[float]] | None = None,
    measured_links: Mapping[tuple[str, str], Link] | None = None,
) -> Timing:
    """Seconds of every op of ``ops`` on every device of ``devices``, and the links between them.

    ``measured``: device -> seconds per op, measured (``profile=True``), used instead of the estimate
    for the devices it names; ``measured_links``: (source, destination) -> measured link, used instead
    of ``hardware``'s for the pairs it names.
    """
    work = op_work(graph_module, ops, dtype=dtype)
    if work.unsized and not (measured is not None and all(device in measured for device in devices)):
        _warn_unsized([ops[index] for index in work.unsized])
    rows = []
    for device in devices:
        if measured is not None and device in measured:  # with training, measured forward and backward
            rows.append(np.asarray(measured[device], dtype=np.float64))
        else:
            rows.append(op_seconds(work, hardware.speed(device), training=training))
    found = measured_links or {}
    links = [[found.get((a, b)) or hardware.link(a, b) for b in devices] for a in devices]
    timing = Timing(
        np.stack(rows) if rows else np.zeros((0, len(ops))),
        np.array([[link.bandwidth for link in row] for row in links]),
        np.array([[link.latency for link in row] for row in links]),
    )
    return timing.scaled(1.0, TRAINING_COPIES) if training else timing


def timing_for(
    options: Options,
    graph_module: torch.fx.GraphModule,
    ops: Sequence[torch.fx.Node],
    devices: Sequence[str],
    *,
    dtype: str | None,
    training: bool,
    inputs: tuple[tuple[Any, ...] | None, Mapping[str, Any] | None] = (None, None),
    largest_copy: int = 0,
    seen: dict[tuple[Any, ...], float] | None = None,
) -> Timing | None:
    """The op times ``options`` plan with (:func:`op_timing`), or None when the plan is not made for time
    (:func:`wants_timing`). With ``profile``, measured on each device (:func:`measure_ops`) fed ``inputs``
    (positional and keyword example inputs, as traced), and each link measured with a copy of
    ``largest_copy`` bytes, the largest value the plan may copy (:func:`~fxsplit.cost.linkprofile.profile_links`).
    ``seen``: the times measured for this graph before it was rewritten (ops of one name, target and output shape
    keep their first time, so that plans of the graph before and after are compared on the same numbers); the
    new ones are added to it."""
    objective = options.chosen_objective
    if not wants_timing(objective, options.pipeline, options.hardware, options.profile):
        return None
    measured = measure_ops(graph_module, ops, devices, *inputs, training=training) if options.profile else None
    if measured is not None and seen is not None:
        measured = _as_first_seen(measured, ops, seen)
    links = None
    if options.profile:
        from fxsplit.cost.linkprofile import profile_links

        links = profile_links(devices, largest_copy)
    hardware = Hardware.coerce(options.hardware)
    _warn_unused_hardware(hardware, devices)
    return op_timing(
        graph_module,
        ops,
        devices,
        hardware,
        dtype=getattr(torch, dtype) if dtype else None,
        training=training,
        measured=measured,
        measured_links=links,
    )


def _as_first_seen(
    measured: dict[str, list[float]], ops: Sequence[torch.fx.Node], seen: dict[tuple[Any, ...], float]
) -> dict[str, list[float]]:
    """``measured``, each op's time replaced by the one ``seen`` holds for it (same device, name, target and output
    shape, its sizes as written: a symbolic one has no hash), where it holds one; the rest added to ``seen``."""
    keys = [(op.name, str(op.target), tuple(map(str, getattr(op.meta.get("val"), "shape", ())))) for op in ops]
    found = {}
    for device, times in measured.items():
        row = []
        for key, value in zip(keys, times, strict=True):
            row.append(seen.setdefault((device, *key), value))
        found[device] = row
    return found


def _warn_unsized(ops: Sequence[torch.fx.Node]) -> None:
    named = ", ".join(repr(node.name) for node in ops[:5]) + (f" and {len(ops) - 5} more" if len(ops) > 5 else "")
    warnings.warn(
        f"the time of {len(ops)} op(s) is not estimated ({named}): their sizes depend on the values of the data (as "
        "the tokens a router sends to each expert), which the example inputs' shapes do not give, so they count 0 s "
        "and the stages are balanced without them; profile=True measures every op on the example inputs",
        FxsplitWarning,
        stacklevel=user_stacklevel(),
    )


def _warn_unused_hardware(hardware: Hardware, devices: Sequence[str]) -> None:
    """Warn about speeds or links given for a device the budgets do not name (a typo: they would not apply)."""
    kinds = {d.partition(":")[0] for d in devices}
    names = [*hardware.devices, *(end for pair in hardware.links for end in pair)]
    unused = sorted({n for n in names if n not in devices and n not in kinds})
    if unused:
        warnings.warn(
            FxsplitWarning(
                f"hardware names {', '.join(map(repr, unused))}, which no budget names (devices: "
                f"{', '.join(devices)}): those speeds and links are not used; name a device or a kind (cuda, cpu)"
            ),
            stacklevel=user_stacklevel(),
        )


def measure_ops(
    graph_module: torch.fx.GraphModule,
    ops: Sequence[torch.fx.Node],
    devices: Sequence[str],
    args: tuple[Any, ...] | None,
    kwargs: Mapping[str, Any] | None,
    *,
    training: bool = False,
) -> dict[str, list[float]]:
    """Device -> measured forward seconds per op (:func:`~fxsplit.cost.profile.profile_op_seconds`,
    :data:`PROFILE_REPEATS` runs): once for all the ``cpu:N`` devices, which share the CPU, on one thread (a
    logical CPU device stands for a core), and once per other device. With ``training``, each op's
    forward and backward."""
    from fxsplit.cost.profile import profile_op_seconds

    measured: dict[str, list[float]] = {}
    cpu: list[float] | None = None
    for device in devices:
        if device.split(":")[0] == "cpu":
            if cpu is None:
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                try:
                    cpu = profile_op_seconds(
                        graph_module, ops, args, dict(kwargs or {}), "cpu", repeats=PROFILE_REPEATS, backward=training
                    )
                finally:
                    torch.set_num_threads(threads)
            measured[device] = cpu
        else:
            measured[device] = profile_op_seconds(
                graph_module, ops, args, dict(kwargs or {}), device, repeats=PROFILE_REPEATS, backward=training
            )
    return measured


def copied_problem(options: Options, problem: PartitionProblem, weight_values: Sequence[int]) -> PartitionProblem:
    """The problem whose copies are those the run makes, as every objective and the time estimate see it:
    ``problem``, or, for stages that each hold the weights they read (:func:`fxsplit.pipeline_stages`),
    ``problem`` without any weight copy (:func:`~fxsplit.planning.stagecopies.without_weight_copies`)."""
    return without_weight_copies(problem, weight_values) if held_by_stages(options.pipeline) else problem


def timing_record(
    plan: Plan,
    costs: GraphCosts,
    problem: PartitionProblem,
    timing: Timing,
    options: Options,
    trainable: Mapping[str, int] | None = None,
    rows: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """What :attr:`Plan.timing` holds for ``plan``: each device's compute and received-copy seconds.

    For stages that each hold the weights they read (:func:`fxsplit.pipeline_stages`), no weight copy is
    charged (``"stage_copies": True``) and, in training, ``"allreduce"`` names each ``trainable`` parameter
    read on several devices with its holders, gradient bytes and the seconds of its all-reduce per step
    (:func:`~fxsplit.planning.stagecopies.allreduce_seconds`); ``rows``: row parameters of split ops -> the
    weight whose rows they hold, whose holders they join.
    """
    index = {device: k for k, device in enumerate(plan.devices)}
    op_devices = [plan.placement[op.name] for op in costs.ops]
    problem = copied_problem(options, problem, costs.weight_values)
    stages = stage_times(problem, [index[d] for d in op_devices], timing)
    pipeline = options.pipeline
    training = options.mode == "training"
    record: dict[str, Any] = {
        "source": "profile" if options.profile else "estimate",
        "chunks": pipeline.chunks if isinstance(pipeline, PipelineConfig) else None,
        "training": training,
        "stages": {d: {"compute": c, "copies": x} for d, (c, x) in zip(plan.devices, stages, strict=True)},
    }
    if not held_by_stages(pipeline):
        return record
    record["stage_copies"] = True
    if training:
        weights = [(w.names[0], w.nbytes, i) for w, i in zip(costs.weights, costs.weight_values, strict=True)]
        reduced = reduced_gradients(problem, weights, trainable or {}, op_devices, plan.devices, rows)
        for entry in reduced.values():
            ring = [index[d] for d in entry["devices"]]
            links = [_untrained_link(timing, a, b) for a, b in zip(ring, ring[1:] + ring[:1], strict=True)]
            entry["seconds"] = allreduce_seconds(entry["nbytes"], links)
        record["allreduce"] = reduced
    return record


def _untrained_link(timing: Timing, source: int, destination: int) -> Link:
    """The link of one copy from device ``source`` to ``destination``: a training step's ``timing`` charges each
    copy :data:`TRAINING_COPIES` times (:func:`op_timing`), which an all-reduce, once per step, is not."""
    bandwidth, latency = timing.bandwidth[source, destination], timing.latency[source, destination]
    return Link(float(bandwidth) * TRAINING_COPIES, float(latency) / TRAINING_COPIES)


def wants_timing(objective: str, pipeline: Any, hardware: Any, profile: bool) -> bool:
    """Whether a plan gets time estimates: a time objective, a pipeline, or hardware or profiling asked for."""
    from fxsplit.partition.throughput import TIME_OBJECTIVES

    return objective in TIME_OBJECTIVES or pipeline is not None or hardware is not None or profile
