"""Plan a traced graph: its costs, memory and op times, the partition under the budgets, the plan.

:func:`plan_graph` is everything :func:`fxsplit.plan` does once the model is
traced, for the graph as it is when called: planning may rewrite the graph
(:mod:`fxsplit.planning.rowsplits` splits a linear op's rows) and plan it again.
:class:`GraphPlanning` holds what the call was given, parsed once.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from fxsplit.check import verify_plan
from fxsplit.cost.build import GraphCosts, build_problem
from fxsplit.cost.constraints import explain_infeasible_pins, refuse_split_writes
from fxsplit.errors import BudgetError
from fxsplit.memory.charge import memory_model
from fxsplit.memory.model import MemoryModel, MemorySpec
from fxsplit.options import Budgets, Offload, Options, PipelineConfig
from fxsplit.partition.milp import without_milp
from fxsplit.partition.outputs import with_output_reader, with_output_seconds, without_output_reader
from fxsplit.partition.problem import PartitionProblem
from fxsplit.partition.solve import Partition, partition
from fxsplit.partition.throughput import Timing
from fxsplit.planning.build import make_plan, output_values
from fxsplit.planning.fingerprint import Structure, record_origin
from fxsplit.planning.offload import fit_or_offload
from fxsplit.planning.plan import Plan
from fxsplit.planning.replicas import try_replicas
from fxsplit.planning.rowsplits import shard_sources
from fxsplit.planning.stagecopies import held_copies_error
from fxsplit.planning.timing import copied_problem, timing_for, timing_record
from fxsplit.planning.weightmap import plan_device_map
from fxsplit.tracing.capture import Traced
from fxsplit.tracing.dynamic import describe as describe_dynamic
from fxsplit.tracing.gradmode import region_spans

__all__ = ["GraphPlanning", "Planned", "plan_graph"]


@dataclass
class Planned:
    """What :func:`fxsplit.api.trace_and_plan` made: the traced graph, its costs, the plan, and the options used."""

    traced: Traced
    costs: GraphCosts
    plan: Plan
    options: Options | None = None
    memory: MemoryModel | None = None
    timing: Timing | None = None  # each op's seconds, when the plan was made for time


@dataclass(frozen=True)
class GraphPlanning:
    """What a plan of a traced graph is made from, parsed once by :mod:`fxsplit.api`.

    Attributes:
        model: the user's model (not changed).
        traced: its traced graph.
        options: the parsed options.
        budgets: the parsed budgets; ``devices`` in their order.
        output_device: where the outputs go, or None (the last op's device).
        dtype: the planning dtype's name, or None.
        leaves: the leaf modules, as given.
        pins: module pattern or node -> device; ``together``: groups of patterns that share a device;
            ``locate``: where a pattern came from (for errors).
        homes: every weight's device when a device map fixes them, else None.
        inputs: the example inputs (positional, keyword), one micro-batch of them with a pipeline.
        measured: with ``profile=True``, each op's measured seconds, kept across plans of a rewritten graph
            (:func:`~fxsplit.planning.timing.timing_for`'s ``seen``).
        as_traced: the model was cast to ``dtype`` before it was traced (a checkpoint fills it): its tensors count
            at the dtypes traced, which are the split's (a float32 rotary table, :mod:`fxsplit.checkpoint.cast`; a
            loss's float32 logits), not all at ``dtype``; also when :func:`fxsplit.plan` traced the model as it runs
            at ``dtype`` (:class:`~fxsplit.checkpoint.cast.PlanningCast`: a meta model cast, meta stand-ins for
            real weights).
        given: the model's structure before such a cast (the plan records it: :mod:`fxsplit.planning.fingerprint`),
            None when the model is planned as it is.
    """

    model: torch.nn.Module
    traced: Traced
    options: Options
    budgets: Budgets
    output_device: str | None
    dtype: str | None
    leaves: Sequence[Any]
    pins: Mapping[str, str]
    together: Sequence[Sequence[str]]
    locate: Any
    homes: Mapping[str, str] | None
    inputs: tuple[Any, Mapping[str, Any] | None]
    measured: dict[tuple[Any, ...], float] = field(default_factory=dict)
    as_traced: bool = False
    given: Structure | None = None

    @property
    def devices(self) -> list[str]:
        return list(self.budgets.devices)


def plan_graph(job: GraphPlanning) -> Planned:
    """The plan of ``job.traced``'s graph as it is now (costs, memory, op times, partition, plan)."""
    traced, options, model = job.traced, job.options, job.model
    float_dtype = getattr(torch, job.dtype) if job.dtype and not job.as_traced else None  # sizes as if of dtype
    costs = build_problem(
        traced.graph_module,
        model,
        device_index={d: i for i, d in enumerate(job.devices)},
        pins=job.pins,
        together=job.together,
        dtype=float_dtype,
    )
    refuse_split_writes(costs.problem, job.devices)
    memory, uncounted = memory_model(
        MemorySpec.coerce(options.mode, options.optimizer), traced, costs, model, float_dtype
    )
    chunks = options.pipeline.chunks if isinstance(options.pipeline, PipelineConfig) else 1
    if memory.spec.training and memory.profile is not None and (options.accumulate_grads or chunks > 1):
        memory = dataclasses.replace(memory, accumulating=True)
    if isinstance(options.pipeline, PipelineConfig):  # the profile is one micro-batch's
        pipeline = options.pipeline
        memory = dataclasses.replace(memory, chunks=pipeline.chunks, checkpoint=str(pipeline.checkpoint))
        memory = dataclasses.replace(memory, processes=pipeline.processes, return_outputs=pipeline.return_outputs)
    problem = memory.problem()
    if options.pipeline is not None:  # stages interleave, so no cut inside a grad-mode region (unless pins put
        pinned = problem.pinned  # one there: then the stages refuse the plan, naming the region)
        regions = [
            (lo, hi)
            for lo, hi in region_spans(costs.ops)
            if len({pinned.get(op) for op in range(lo, hi + 1)} - {None}) < 2
        ]
        problem = dataclasses.replace(problem, together=problem.together + tuple(regions)) if regions else problem
    timing = timing_for(
        options,
        traced.graph_module,
        costs.ops,
        job.devices,
        dtype=job.dtype,
        training=memory.spec.training,
        inputs=job.inputs,
        largest_copy=max((value.nbytes for value in problem.values), default=0) if options.profile else 0,
        seen=job.measured,
    )
    splitter = _Splitter(job, costs, timing)
    if job.homes is not None:  # the map fixes every weight's device: no replicas
        made = plan_device_map(
            costs,
            traced.graph_module,
            memory,
            job.homes,
            job.budgets,
            output_device=job.output_device,
            trace=traced.method,
        )
    else:
        made = fit_or_offload(
            memory, job.budgets, splitter.solver(problem), Offload.coerce(options.offload), traced.graph_module
        )
        if options.replicate and splitter.objective == "min_transfer" and not options.pipeline:  # if they pay
            with without_milp():  # a partition for each replica set tried: the heuristics alone
                made = try_replicas(made, memory, job.budgets, traced.graph_module, problem, splitter.solver)
    if made.memory:  # what the rows count, in words: the mode, the optimizer and its step
        made = dataclasses.replace(made, memory_counts=memory.counts(made))
    dynamic = describe_dynamic(options.dynamic_shapes) if traced.method == "export" else None
    made = record_origin(made, model, job.dtype, job.leaves, dynamic, traced.graph_module, given=job.given)
    if uncounted is not None:
        made = dataclasses.replace(made, activations_not_counted=uncounted)
    if timing is not None:
        rows = shard_sources(traced.graph_module, model)
        made = dataclasses.replace(
            made, timing=timing_record(made, costs, problem, timing, options, memory.trainable, rows)
        )
    if options.check:
        verify_plan(made, traced.graph_module, model)
    return Planned(traced, costs, made, options, memory, timing)


class _Splitter:
    """Partitions of one graph's problem under given caps (a device's bytes), and the plans made of them."""

    def __init__(self, job: GraphPlanning, costs: GraphCosts, timing: Timing | None) -> None:
        self.job, self.costs, self.timing = job, costs, timing
        self.objective = job.options.chosen_objective
        self.contiguous = job.options.contiguous or job.options.pipeline is not None
        # Out of stage order, the partitioner also places where the outputs are returned, counting their copies
        # (:mod:`fxsplit.partition.outputs`). A given output device pins that, unless pins on later devices
        # (pins keep the devices' order) or a device outside the plan (it gets every output) leave it fixed.
        out = job.output_device
        index = job.devices.index(out) if out in job.devices else None
        fixed = out is not None and (index is None or index < max(costs.problem.pinned.values(), default=0))
        self.outputs = output_values(costs, job.traced.graph_module) if not self.contiguous and not fixed else []
        self.output_index = index

    def split(self, problem: PartitionProblem, caps: Sequence[int]) -> Partition:
        """The partition of ``problem`` under ``caps``, as the run copies values; a refusal says why."""
        job = self.job
        seen = copied_problem(job.options, problem, self.costs.weight_values)  # the copies the run will make
        try:
            return self.place_ops(seen, caps)
        except BudgetError as error:
            better = explain_infeasible_pins(
                error,
                problem,
                list(caps),
                job.devices,
                job.pins,
                len(job.together),
                job.locate,
                contiguous=self.contiguous,
            ) or held_copies_error(seen, caps, job.devices, functools.partial(self.place_ops, caps=caps))
            if better is None:
                raise
            raise better from error

    def place_ops(self, seen: PartitionProblem, caps: Sequence[int]) -> Partition:
        if not self.outputs:
            return partition(
                seen,
                caps,
                objective=self.objective,
                device_names=self.job.devices,
                contiguous=self.contiguous,
                timing=self.timing,
            )
        found = self._with_outputs(seen, caps, self.output_index)
        if self.output_index is None and len(self.outputs) > 1:
            # several outputs, returned anywhere: also search with them returned on each device (pins keep the
            # devices' order), which the free search can miss: BERT's hidden states over 3 devices copied 38,528 B
            # free and 31,232 B returned on the first; T5's 73,728 B free and 51,640 B returned on the second
            for device in range(max(seen.pinned.values(), default=0), len(caps)):
                try:
                    given = self._with_outputs(seen, caps, device)
                except BudgetError:
                    continue
                if given.transfer_bytes < found.transfer_bytes:
                    found = given
        return found

    def _with_outputs(self, seen: PartitionProblem, caps: Sequence[int], device: int | None) -> Partition:
        """The partition of ``seen`` with the outputs' reader, on ``device`` (None: anywhere)."""
        found = partition(
            with_output_reader(seen, self.outputs, device),
            caps,
            objective=self.objective,
            device_names=self.job.devices,
            contiguous=self.contiguous,
            timing=with_output_seconds(self.timing),
        )
        return without_output_reader(found)

    def solve(self, problem: PartitionProblem, caps: Sequence[int]) -> Plan:
        """The plan of the partition of ``problem`` under ``caps``."""
        job = self.job
        return make_plan(
            self.costs,
            job.traced.graph_module,
            self.split(problem, caps),
            job.budgets,
            caps=caps,
            output_device=job.output_device,
            trace=job.traced.method,
            objective=self.objective,
            repartition=functools.partial(self.split, problem),
        )

    def solver(self, problem: PartitionProblem) -> Callable[[Sequence[int]], Plan]:
        return functools.partial(self.solve, problem)
