"""Export a split as per-stage modules for ``torch.distributed.pipelining``: one process per stage.

Every rank runs the same script (``torchrun --nproc-per-node N script.py``)::

    stages = fxsplit.pipeline_stages(model, budgets, example_inputs=(x,), chunks=4)
    stage = stages.build_stage(rank)               # a torch.distributed.pipelining.PipelineStage
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)   # or Schedule1F1B
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
    for x, y in data:
        optimizer.zero_grad()
        if rank == 0: schedule.step(x)             # the first stage takes the model's inputs
        elif rank == len(stages) - 1: schedule.step(target=y, losses=losses)
        else: schedule.step()
        stages.reduce_tied_grads(rank)             # every rank, every step, before optimizer.step()
        optimizer.step()

Stage ``i`` runs on ``plan.devices[i]`` (the budgets' order; rank ``i`` must
own that device). Stage 0 is called like the model; the last stage returns
what the model returns, which is what ``loss_fn(output, target)`` sees. The
stages in between take and return flat tuples of tensors: every value live
across a boundary, so a skip connection is handed on through the stages it
jumps over (``torch.distributed.pipelining`` talks to neighbours only).

Tied weights (one tensor read by ops on several stages, like tied input and
output embeddings) are *replicated*: each stage that reads the weight holds
its own copy (every rank builds the model the same way), and after backward
:meth:`PipelineStages.reduce_tied_grads` sums their gradients across those
ranks, so all copies get the gradient of the one tied weight and stay equal
under any deterministic optimizer. Sending the weight forward instead would
cost its size per micro-batch.

The model is not changed: its code, structure and hooks stay as they are.
The stage modules share its parameters; ``build_stage`` moves that stage's
weights to its device in place, like ``model.to()``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx

from fxsplit.callsite import user_stacklevel
from fxsplit.codegen.emitter import emit
from fxsplit.errors import BudgetError, FxsplitError, FxsplitWarning, SpecError
from fxsplit.options import PipelineConfig
from fxsplit.pipeline.batchstats import labelled, random_ops
from fxsplit.pipeline.gpipe import mixing_message, random_message
from fxsplit.pipeline.microbatch import argument_names, first_microbatch
from fxsplit.pipeline.replicabudget import replica_overruns, room_to_hold_back
from fxsplit.pipeline.stages import StageSpec, split_stages
from fxsplit.pipeline.tiedgrads import RowPiece, broadcast_held, held_weights, reduce_held, unalias_rows
from fxsplit.planning.plan import Plan
from fxsplit.planning.rules import Overrun
from fxsplit.tracing.modereads import MODE_READS, fixed_modes_message
from fxsplit.tracing.modulehooks import root_hooks_left_out
from fxsplit.units import format_size
from fxsplit.validate import unwrapped

__all__ = ["PipelineStages", "pipeline_stages"]


@dataclass
class PipelineStages:
    """The stages of a split, one ``nn.Module`` per rank.

    Attributes:
        plan: the plan that placed the ops; stage ``i`` runs on ``plan``'s
            ``i``-th device that has ops (``specs[i].device``).
        specs: per stage, the names of the values it takes and returns.
        modules: per stage, a ``GraphModule`` (``modules[i].code`` shows it). It
            reads its weights and, after stage 0, its inputs where they are: on
            its device once ``build_stage`` has moved it and the schedule has
            received them there (stage 0 moves the model's inputs itself). To
            chain them in one process, move each module to its device and each
            stage's outputs to the next one's.
        tied: qualified name of each weight that several stages hold -> those
            stages (their gradients are summed by :meth:`reduce_tied_grads`): whole,
            or, for a linear op whose rows the plan splits over stages
            (``plan.row_splits``), a parameter over some of its rows.
        chunks: the micro-batches per batch the stages were traced for.
    """

    plan: Plan
    specs: tuple[StageSpec, ...]
    modules: tuple[torch.fx.GraphModule, ...]
    tied: dict[str, tuple[int, ...]]
    chunks: int
    _paths: tuple[dict[str, str], ...] = ()
    _groups: dict[tuple[int, ...], Any] = field(default_factory=dict)
    _rows: tuple[dict[str, tuple[RowPiece, ...]], ...] = ()  # per stage: name -> the row pieces it holds

    def __len__(self) -> int:
        return len(self.modules)

    def __str__(self) -> str:
        """The plan's tables, each tied weight shown as the stages hold it: a replica per stage, no copy per forward."""
        lines = {old: new for old, new in zip(self.plan.tied_summary(), self._tied_lines(), strict=True)}
        text = "\n".join(lines.get(line, line) for line in str(self.plan).splitlines())
        sent = sum(c.nbytes or 0 for c in self.plan.cuts if c.kind == "parameter")
        if not self.plan.timing or self.plan.timing.get("stage_copies") or not sent:
            return text
        return text + (
            f"\ntime: estimated for a run in one process (a plan made by fxsplit.plan): its copies in include "
            f"{format_size(sent)} of weights these stages hold instead, and it has no gradient all-reduce; "
            "plan with pipeline=fxsplit.PipelineConfig(chunks, processes=True), or give pipeline_stages budgets, "
            "to estimate these stages"
        )

    def _tied_lines(self) -> list[str]:
        lines = []
        for group, line in zip(self.plan.tied, self.plan.tied_summary(), strict=True):
            holders = next((self.tied[name] for name in group if name in self.tied), None)
            if holders is not None:
                where = ", ".join(
                    f"{index} ({self.specs[index].device}{self._rows_held(index, group)})" for index in holders
                )
                copied = sum(c.nbytes or 0 for c in self.plan.cuts if c.kind == "parameter" and c.producer in group)
                unsent = f"; its {format_size(copied)} parameter cut counted above is not sent" if copied else ""
                line = (
                    f"tied: {' = '.join(group)}: replicated on stages {where}, gradients summed by "
                    f"reduce_tied_grads (no copy per forward{unsent})"
                )
            lines.append(line)
        return lines

    def __getitem__(self, index: int) -> torch.fx.GraphModule:
        return self.modules[index]

    def build_stage(self, index: int, *, device: Any = None, group: Any = None) -> Any:
        """Stage ``index`` as a ``torch.distributed.pipelining.PipelineStage``, its weights moved to its device.

        Args:
            index: the stage, normally this process's rank in ``group``.
            device: where it runs (default: ``specs[index].device``).
            group: the pipeline's process group (default: the world).
        """
        from torch.distributed.pipelining import PipelineStage

        require_tensor_output(self.modules[-1])  # on every rank, before any waits for the last
        target = torch.device(device if device is not None else self.specs[index].device)
        module = self.modules[index].to(target)
        return PipelineStage(module, index, len(self), target, group=group)

    def reduce_tied_grads(self, index: int, group: Any = None) -> None:
        """Sum the gradients of each tied weight over the ranks that hold it.

        Call it on every rank (it may create process groups, a collective
        call) after the schedule's step and before the optimizer's, with this
        rank's stage ``index``; ``group`` is the pipeline's process group, in
        which stage ``i`` is rank ``i`` (default: the world).
        """
        for name, holders in self.tied.items():
            handle = self._group(holders, group)
            if index in holders:
                reduce_held(self.modules[index], self._paths[index].get(name), self._pieces(index, name), handle)

    def sync_tied_weights(self, index: int, group: Any = None) -> None:
        """Copy each tied weight from its first holder of it whole to the others (when ranks built the model
        differently), rows to the stages that hold row pieces of it."""
        for name, holders in self.tied.items():
            handle = self._group(holders, group)
            if index in holders:
                source = self._global_rank(next(s for s in holders if name in self._paths[s]), group)
                broadcast_held(
                    self.modules[index], self._paths[index].get(name), self._pieces(index, name), source, handle
                )

    def _pieces(self, index: int, name: str) -> tuple[RowPiece, ...]:
        return self._rows[index].get(name, ()) if self._rows else ()

    def _rows_held(self, index: int, names: tuple[str, ...]) -> str:
        """``", rows 0-25152"`` when stage ``index`` holds row pieces (and not the whole) of the weight ``names``."""
        if any(name in self._paths[index] for name in names):
            return ""
        pieces = [piece for name in names for piece in self._pieces(index, name)]
        return ", rows " + ", ".join(f"{p.start}-{p.stop}" for p in pieces) if pieces else ""

    def _global_rank(self, stage: int, group: Any) -> int:
        import torch.distributed as dist

        return stage if group is None else dist.get_global_rank(group, stage)

    def _group(self, holders: tuple[int, ...], group: Any) -> Any:
        import torch.distributed as dist

        if holders not in self._groups:
            ranks = [self._global_rank(s, group) for s in holders]
            everyone = len(holders) == (dist.get_world_size(group) if group is not None else dist.get_world_size())
            self._groups[holders] = group if everyone else dist.new_group(ranks)
        return self._groups[holders]


def pipeline_stages(
    model: torch.nn.Module,
    plan_or_budgets: Plan | Mapping[Any, Any],
    *,
    example_inputs: Any,
    chunks: int = 1,
    return_outputs: bool = True,
    **options: Any,
) -> PipelineStages:
    """Split ``model`` into stages that ``torch.distributed.pipelining`` runs, one rank per stage.

    Args:
        model: the model; not modified (the stages share its weights, unmoved).
        plan_or_budgets: a :class:`Plan` (e.g. one made by ``fxsplit.plan``
            with the same ``pipeline`` chunks, or loaded from a file), or
            budgets to plan with, as for ``fxsplit.fxsplit``.
        example_inputs: one *batch* of positional inputs, as passed to
            ``schedule.step``; the model is traced on its first micro-batch.
        chunks: micro-batches per batch (the schedule's ``n_microbatches``).
        return_outputs: whether you call ``schedule.step`` so that it returns
            the outputs (its default): the last stage then keeps every
            micro-batch's outputs and their merged copy, which its budget must
            hold (``PipelineConfig.return_outputs``). Pass False with
            ``schedule.step(..., return_outputs=False)``.
        **options: as for ``fxsplit.fxsplit`` (``trace``, ``example_kwargs``,
            ``pins`` ...), except ``pipeline``. As there, ``mode`` defaults to
            ``"inference"``: pass ``mode="training"`` (and ``optimizer=``) when
            you train, so that the budgets hold gradients and optimizer state.

    Raises:
        FxsplitError: the plan cannot run as a sequence of stages, or a value
            that must cross processes is not a tensor.
        BudgetError: a device cannot hold its stage with the stage's own copy
            of each weight it reads that the plan keeps on another device (tied
            or shared weights: every rank holds one). Planned from budgets, the
            partitioner charges those copies to every stage that reads the weight
            (``PipelineConfig(processes=True)``) and each device's memory row
            counts them (``plan.memory[device]["stage_copies"]``), so this is
            raised when no split fits with them. Should a stage module still
            hold more than its row counts, the plan is made again (up to
            :data:`REPLAN_TRIES` times, with an ``FxsplitWarning``) holding back
            the excess there (``plan.reserved``).
        PlanMismatchError: a given plan does not describe this model's graph.
    """
    model = unwrapped(model)
    if "pipeline" in options:
        raise SpecError("pipeline_stages takes chunks=..., not pipeline=...")
    if options.get("profile") and not isinstance(plan_or_budgets, Plan) and _ranks() > 1:
        raise SpecError(
            "profile=True times the ops in each process, and the times differ from rank to rank, so the ranks would "
            "plan different stages: plan on one rank (fxsplit.plan(model, budgets, example_inputs=..., "
            "pipeline=chunks, profile=True)), share the plan (plan.to_yaml(), or "
            "torch.distributed.broadcast_object_list) and pass it to pipeline_stages on every rank"
        )
    if isinstance(plan_or_budgets, Plan) and plan_or_budgets.replicas:
        raise FxsplitError(
            f"the plan holds {', '.join(map(repr, plan_or_budgets.replicas))} on several devices (replicas), which "
            "only a split run in one process can read; pass budgets (pipelines are planned without replicas) or a "
            "plan made with pipeline=chunks or replicate=False"
        )
    first: tuple[list[Overrun], dict[str, dict[str, int]]] | None = None
    room: dict[str, int] = {}  # held back beyond the user's reserve, where the stages' copies came out over
    for attempt in range(REPLAN_TRIES + 1):
        if isinstance(plan_or_budgets, Plan):
            graph_module, plan = _apply(model, plan_or_budgets, example_inputs, chunks, options)
        else:
            from fxsplit.api import trace_and_plan

            try:
                pipeline = PipelineConfig(chunks, processes=True, return_outputs=return_outputs)
                planned = trace_and_plan(model, plan_or_budgets, example_inputs, {**options, "pipeline": pipeline})
            except FxsplitError:
                if first is None:
                    raise
                _refuse_replicas(plan, *first)  # what the first plan overflowed by, not why the re-plan failed
            graph_module, plan = planned.traced.graph_module, planned.plan
        stages = split_stages(emit(graph_module, plan), plan, relay=True)
        if not attempt:
            reserved = dict(plan.reserved)  # the user's reserve, resolved (a given plan's may hold replicas' room)
        given = isinstance(plan_or_budgets, Plan)
        devices = [spec.device for spec in stages.specs]
        overruns, held, _ = replica_overruns(plan, model, stages.modules, devices, None if given else reserved)
        first = first or (overruns, held)
        if not overruns:
            break
        if given or attempt == REPLAN_TRIES:
            _refuse_replicas(plan, *first)
        room = room_to_hold_back(planned, overruns, reserved, room)
        options = {**options, "reserve": {d: reserved.get(d, 0) + room[d] for d in plan.devices}}
    if first is not None and first[0]:
        _warn_replanned(plan, first[1])
    if root_hooks_left_out(model, plan.trace):
        warnings.warn(FxsplitWarning(_ROOT_HOOKS), stacklevel=user_stacklevel())
    if (mode_read := graph_module.meta.get(MODE_READS)) is not None:  # each rank runs its stage as traced
        warnings.warn(FxsplitWarning(fixed_modes_message(mode_read, "each stage")), stacklevel=user_stacklevel())
    mixing = mixing_message(graph_module, chunks, allow="filter this FxsplitWarning")
    if mixing:  # torch.distributed.pipelining runs each micro-batch on its own too, and joins outputs along dim 0
        warnings.warn(FxsplitWarning(mixing), stacklevel=user_stacklevel())
    drawn = [label for module in stages.modules for label in labelled(module, random_ops(module))]
    if drawn and chunks > 1:  # each rank draws per micro-batch, as fxsplit's own pipeline does
        warnings.warn(
            FxsplitWarning(random_message(drawn, chunks, allow="filter this FxsplitWarning")),
            stacklevel=user_stacklevel(),
        )
    unalias_rows(stages.modules, graph_module)
    holding = held_weights(model, stages.modules, graph_module)
    return PipelineStages(plan, stages.specs, stages.modules, holding.tied, chunks, holding.paths, _rows=holding.rows)


_ROOT_HOOKS = (
    "the model has hooks of its own (register_forward_hook, register_full_backward_hook, ...) that its graph lacks: "
    "the stages do not run them, since no rank calls the whole model; run what they do on the stages' outputs"
)
REPLAN_TRIES = 3  # plans made again, each holding back more where a stage with its copies came out over budget


def _warn_replanned(plan: Plan, held: dict[str, dict[str, int]]) -> None:
    copies = "; ".join(f"{d}: {', '.join(sorted(names))}" for d, names in held.items())
    room = ", ".join(f"{d} {format_size(n)}" for d, n in plan.reserved.items() if n)
    warnings.warn(
        f"pipeline_stages planned again so that each stage can hold its own copy of the tied weights it reads "
        f"({copies}): held back (plan.reserved) {room}",
        FxsplitWarning,
        stacklevel=user_stacklevel(),
    )


def _refuse_replicas(plan: Plan, overruns: list[Overrun], held: dict[str, dict[str, int]]) -> None:
    """Refuse stages whose own copies of the weights they read (tied, shared) overflow a budget the plan kept."""
    where = "; ".join(
        f"{device}: " + ", ".join(f"{name} ({format_size(n)})" for name, n in sorted(held[device].items()))
        for device in sorted(held, key=plan.devices.index)
    )
    raise BudgetError(
        "pipeline_stages gives every stage its own copy of each weight it reads, and the plan keeps these on "
        f"another stage's device: {where}. With them, " + "; ".join(map(str, overruns)) + ". Give those devices "
        "that much more budget, or pin the ops that read the weight to one stage (pins=)"
    )


def _ranks() -> int:
    """Processes of the default group, or 1 outside torch.distributed."""
    distributed = torch.distributed
    return distributed.get_world_size() if distributed.is_available() and distributed.is_initialized() else 1


def _apply(
    model: torch.nn.Module, plan: Plan, example_inputs: Any, chunks: int, options: Mapping[str, Any]
) -> tuple[torch.fx.GraphModule, Plan]:
    """Trace ``model`` as ``plan`` was traced, through apply's one checked re-trace path.

    The plan's rules, fingerprint, ``leaf_modules``, ``dtype`` and ``dynamic_shapes``, its budgets
    and its cuts are checked exactly as by :func:`fxsplit.apply`
    (:func:`fxsplit.planning.apply.checked_retrace`); only the example batch is cut to its first
    micro-batch first.
    """
    from fxsplit.planning.apply import checked_retrace

    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    args, kwargs = first_microbatch(example_inputs, options.get("example_kwargs"), chunks, (), argument_names(model))
    traced, _, _, plan = checked_retrace(
        model,
        plan,
        example_inputs=args,
        example_kwargs=kwargs,
        concrete_args=options.get("concrete_args"),
        leaf_modules=options.get("leaf_modules", ()),
        dynamic_shapes=options.get("dynamic_shapes"),
    )
    return traced.graph_module, plan


def require_tensor_output(graph_module: torch.fx.GraphModule) -> None:
    """Refuse a model whose output torch.distributed.pipelining's last stage cannot return: it takes a tensor
    or a flat tuple or list of tensors (what the schedule hands to ``loss_fn``), not a dict, a Hugging Face
    ``ModelOutput`` or a number; it would fail only in ``schedule.step``, on the last rank. (Stage modules
    chained by hand may return anything.)"""
    output = next(n for n in reversed(graph_module.graph.nodes) if n.op == "output")
    value = output.args[0]
    spec = getattr(getattr(graph_module.graph._codegen, "pytree_info", None), "out_spec", None)
    containers = (tuple, list, dict)
    if spec is not None and not spec.is_leaf():
        flat = spec.type in (tuple, list) and all(child.is_leaf() for child in spec.children())
        kind: type = spec.type
    else:
        kind = dict if isinstance(value, dict) else list if isinstance(value, list) else type(value)
        flat = not isinstance(value, containers) or (
            kind in (tuple, list) and not any(isinstance(v, containers) for v in value)
        )
    leaves = list(value) if isinstance(value, (tuple, list)) else [value]
    numbers = [v for v in leaves if not isinstance(v, torch.fx.Node) or _not_tensor(v)]
    if flat and not numbers:
        return
    what = f"a {kind.__name__}" if not flat else f"{len(numbers)} value(s) that are not tensors"
    raise FxsplitError(
        f"build_stage: the model returns {what}, but torch.distributed.pipelining's last stage must return "
        "a tensor or a flat tuple or list of tensors (what the schedule passes to loss_fn); wrap the model so "
        "that its forward returns the tensors the loss reads, e.g. `return self.model(ids, use_cache=False).logits`"
        " for a Hugging Face model"
    )


def _not_tensor(node: torch.fx.Node) -> bool:
    """Whether the traced value of ``node`` is known not to be a tensor (no recorded value: not known)."""
    value = node.meta.get("val", node.meta.get("tensor_meta"))
    return value is not None and not isinstance(value, torch.Tensor) and type(value).__name__ != "TensorMetadata"
