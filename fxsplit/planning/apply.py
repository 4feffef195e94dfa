"""Use a saved plan: re-trace the model, check the plan describes it, emit the split without solving.

:func:`apply` rebuilds the ``GraphModule`` a plan was made with (the same
generated code), on this or another machine. :func:`check_plan` validates a
plan against a model and budgets without touching the weights (a ``meta``
model works). Both trust nothing the plan says that can be checked: the plan
must meet the rules of :mod:`fxsplit.planning.rules` (its fingerprint, tensors,
devices and tied groups agree), describe the model (parameters and buffers,
graph nodes), fit its budgets less its reserve with the bytes of the model's
own tensors (plus the rest of the memory the plan counts: the rule of
:func:`~fxsplit.planning.rules.budget_overruns`), and list the cuts its
placement implies on the re-traced graph.
They fail with :class:`PlanMismatchError` saying what differs, or
:class:`BudgetError` saying which device is short and by how much.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Mapping, overload

import torch
import torch.fx

from fxsplit.checkpoint import prepare, remember_non_persistent
from fxsplit.checkpoint.cast import CastForLoad, warn_uncast
from fxsplit.checkpoint.fed import retraced_as_fed
from fxsplit.checkpoint.unloaded import guard_meta_weights
from fxsplit.codegen.emitter import check_input_writes, emit, move_weights
from fxsplit.cost.build import GraphCosts
from fxsplit.devices import require_usable
from fxsplit.errors import FxsplitError, PlanMismatchError, SpecError
from fxsplit.options import Budgets, PipelineConfig
from fxsplit.pipeline.reuse import first_microbatch_of, in_process_pipeline
from fxsplit.planning.graphcheck import check_budgets, check_cuts, check_storage
from fxsplit.planning.plan import Plan
from fxsplit.planning.retrace import retrace
from fxsplit.planning.rules import device_needs
from fxsplit.stages import StageTimer
from fxsplit.tracing.capture import Traced
from fxsplit.units import format_size
from fxsplit.validate import refuse_meta, unwrapped

if TYPE_CHECKING:
    from fxsplit.pipeline.gpipe import Pipeline

__all__ = ["PlanCheck", "apply", "check_plan", "checked_retrace", "refuse_row_splits", "retrace"]


@overload
def apply(
    model: torch.nn.Module,
    plan: Plan,
    *,
    example_inputs: Any = None,
    checkpoint: Any = None,
    progress: bool | None = None,
    strict: bool = True,
    offload_dir: Any = None,
    pipeline: None = None,
    **options: Any,
) -> torch.fx.GraphModule: ...


@overload
def apply(
    model: torch.nn.Module,
    plan: Plan,
    *,
    example_inputs: Any = None,
    checkpoint: Any = None,
    progress: bool | None = None,
    strict: bool = True,
    offload_dir: Any = None,
    pipeline: PipelineConfig | Mapping[str, Any] | int,
    **options: Any,
) -> Pipeline: ...


def apply(
    model: torch.nn.Module,
    plan: Plan,
    *,
    example_inputs: Any = None,
    checkpoint: Any = None,
    progress: bool | None = None,
    strict: bool = True,
    offload_dir: Any = None,
    pipeline: Any = None,
    **options: Any,
) -> torch.fx.GraphModule | Pipeline:
    """Split ``model`` as ``plan`` says, without solving again: same plan, same generated code.

    The model is traced again (as the plan was: ``plan.trace``, its leaf
    modules) and must have the parameters, buffers and graph nodes the plan
    names. As with :func:`fxsplit.fxsplit`, the model's parameters and buffers
    are moved to their devices in place.

    Args:
        model: the module the plan was made for (or one with the same structure).
        plan: a :class:`Plan`, e.g. ``Plan.from_yaml(open("plan.yaml").read())``.
        example_inputs: positional inputs, needed when the plan was traced with
            ``torch.export``.
        **options: ``example_kwargs``, ``concrete_args``, ``leaf_modules`` (added
            to the plan's), ``dynamic_shapes`` (default: the plan's), as for
            :func:`fxsplit.fxsplit`.
        checkpoint: load the weights from this checkpoint onto the plan's
            devices, as for :func:`fxsplit.fxsplit` (``False``: a meta model
            gives a split with meta weights, for :func:`fxsplit.load_checkpoint`).
        progress: on stderr, the time spent tracing and a progress bar while
            loading (None: on a terminal only).
        strict: with ``checkpoint``, False loads what fits, as for :func:`fxsplit.fxsplit`.
        offload_dir: where to write the weights the plan stores on disk
            (default: the plan's ``offload["dir"]``), for a plan made on
            another machine; the split's plan records it.
        pipeline: run the split as a :class:`fxsplit.Pipeline` (a
            :class:`~fxsplit.PipelineConfig`, or its chunks), as
            ``fxsplit.fxsplit(..., pipeline=...)`` does: ``example_inputs`` is
            then a whole batch, traced on its first micro-batch. Best with a plan
            made with the same ``pipeline`` (its memory counts those
            micro-batches; other chunks warn).

    Before anything moves, the plan is checked as :func:`check_plan` checks
    it against its own budgets less its reserve.

    Raises:
        PlanMismatchError: the plan does not describe this model, or
            contradicts itself (was edited); says what differs.
        BudgetError: the model's parameters and buffers, placed as the plan
            says, do not fit a device's budget less its reserve.
        CheckpointError: the checkpoint does not fit the model; nothing was loaded.
        DeviceError: a device of the plan cannot be used here (checked before
            any work), or moving a weight failed (what was moved is put back).
        SpecError: an unknown option, or one of the wrong type.

    Example:
        >>> import torch, fxsplit
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
        >>> plan = fxsplit.plan(model, {"cpu:0": "20KiB", "cpu:1": "20KiB"}, trace="fx")
        >>> saved = plan.to_yaml()
        >>> gm = fxsplit.apply(model, fxsplit.Plan.from_yaml(saved))
        >>> gm.meta["fxsplit_plan"] == fxsplit.Plan.from_yaml(saved)
        True
        >>> fxsplit.apply(torch.nn.Sequential(torch.nn.Linear(64, 32)), plan)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        fxsplit.errors.PlanMismatchError: the plan was made for another model (fingerprint ...); 4 difference(s):
          missing: the plan has '2.weight' (float32[64, 64]), the model does not
          missing: the plan has '2.bias' (float32[64]), the model does not
          changed: '0.weight' is float32[32, 64] in the model, float32[64, 64] in the plan
          changed: '0.bias' is float32[32] in the model, float32[64] in the plan
    """
    model = unwrapped(model)
    _known_options(options, "apply")
    _require_plan(plan, "apply")
    refuse_row_splits(plan, "fxsplit.apply")
    config = in_process_pipeline(plan, pipeline)
    if config is not None:  # trace the first micro-batch, as the plan was
        example_inputs, options = first_microbatch_of(model, example_inputs, options, config)
    if offload_dir is not None:
        plan = dataclasses.replace(plan, offload={**plan.offload, "dir": os.fspath(offload_dir)})
    require_usable([*plan.devices, plan.output_device], plan.budgets)
    loading = prepare(model, checkpoint, progress, strict)
    with CastForLoad(model, checkpoint is not None) as cast:  # as the checkpoint fills it; undone if the call fails
        cast(plan.dtype)
        with StageTimer(enabled=progress).stage("fxsplit: tracing and checking the plan"):
            traced, costs, _, plan = cast.traced(
                lambda: retraced_as_fed(
                    lambda args, kwargs: checked_retrace(
                        model, plan, example_inputs=args, **{**options, "example_kwargs": kwargs}
                    ),
                    (example_inputs, options.get("example_kwargs")),
                    cast.dtype,
                    PlanMismatchError,
                    lambda made: made[0],
                ),
                lambda made: made[0],
            )
    with cast, loading.onto(plan, traced.graph_module) as loaded:  # undone if what follows fails
        if checkpoint is None:
            refuse_meta(model)
            warn_uncast(model, plan.dtype)
        moved = move_weights(traced.graph_module, plan, loaded.not_loaded(costs.weights + costs.unused), model)
        try:
            split = guard_meta_weights(remember_non_persistent(emit(traced.graph_module, plan, model), model))
            if config is not None:
                from fxsplit.pipeline.gpipe import pipelined  # the pipeline package builds on this one

                return guard_meta_weights(remember_non_persistent(pipelined(split, config), model))
            return split
        except BaseException:
            moved.undo()  # a failed call leaves the model as it was
            raise


_RETRACE_OPTIONS = ("example_kwargs", "concrete_args", "leaf_modules", "dynamic_shapes")


def refuse_row_splits(plan: Plan, caller: str) -> None:
    """Refuse to run a plan whose ops compute their outputs in row pieces in one process: each piece's rows are a
    parameter of their own there, whose gradient only :func:`fxsplit.pipeline_stages` sums back (its
    ``reduce_tied_grads``), so the model's weight would miss it."""
    if plan.row_splits:
        ops = ", ".join(f"{op!r} ({len(r.bounds) - 1} pieces of {r.weight})" for op, r in plan.row_splits.items())
        raise FxsplitError(
            f"{caller}: this plan computes {ops} in row pieces on several stages, for stages run one per process; "
            "run it with fxsplit.pipeline_stages(model, plan, ...), or plan again without "
            "pipeline=fxsplit.PipelineConfig(..., processes=True) to run the split in this process"
        )


def _require_plan(plan: Any, caller: str) -> None:
    if not isinstance(plan, Plan):
        hint = (
            f"; to use the plan file {plan!r}, pass fxsplit.Plan.from_yaml(Path({plan!r}).read_text())"
            if isinstance(plan, str) and len(plan) < 200
            else ""
        )
        raise SpecError(f"{caller}() takes a fxsplit.Plan (got {type(plan).__name__}){hint}")


def _known_options(options: Mapping[str, Any], caller: str) -> None:
    unknown = [name for name in options if name not in _RETRACE_OPTIONS]
    if unknown:
        raise SpecError(
            f"{caller}() takes no option {', '.join(map(repr, unknown))}; its options are "
            f"{', '.join(_RETRACE_OPTIONS)} (the rest comes from the plan)"
        )


@dataclasses.dataclass(frozen=True)
class PlanCheck:
    """What :func:`check_plan` verified: per device ``(device, usable bytes, bytes needed)``, and notes.

    The bytes needed are those of the model's parameters and buffers as
    placed, plus the rest of the memory the plan counts on the device
    (:func:`~fxsplit.planning.rules.device_needs`).
    """

    devices: tuple[tuple[str, int, int], ...]
    nodes: int
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        rows = [f"  {d}: {format_size(used)} of {format_size(limit)} usable" for d, limit, used in self.devices]
        return "\n".join(
            [
                f"plan matches the model ({self.nodes} graph nodes placed); budgets held:",
                *rows,
                *(f"note: {n}" for n in self.notes),
            ]
        )


def check_plan(
    model: torch.nn.Module,
    plan: Plan,
    budgets: Budgets | Mapping[Any, Any] | None = None,
    *,
    example_inputs: Any = None,
    **options: Any,
) -> PlanCheck:
    """Check that ``plan`` fits ``model`` and ``budgets`` (default: the plan's own, less its reserve).

    Verifies the plan's own rules, the structure and graph (as :func:`apply`),
    that each device's memory fits (every parameter and buffer's bytes,
    counted once per tensor at the plan's dtype, plus the gradients,
    optimizer state and activations the plan counts there), and that the
    plan's cuts are those its placement implies on the re-traced graph (one
    copy per value and destination, none to the same device). Moves nothing.

    Args:
        model: the model the plan was made for.
        plan: the plan.
        budgets: hold the plan to these instead of its own: a
            :class:`~fxsplit.options.Budgets` (with its reserves), or device ->
            bytes or size string as :func:`fxsplit.plan` takes them (nothing
            reserved). A device they leave out may hold nothing.
        example_inputs: as for :func:`apply`.
        **options: as for :func:`apply`.

    Raises:
        PlanMismatchError: the plan does not describe the model, or contradicts itself.
        BudgetError: a device holds more than its budget; says which and by how much.
    """
    model = unwrapped(model)
    _known_options(options, "check_plan")
    _require_plan(plan, "check_plan")
    return checked_retrace(model, plan, budgets, example_inputs=example_inputs, **options)[2]


def checked_retrace(
    model: torch.nn.Module,
    plan: Plan,
    budgets: Budgets | Mapping[Any, Any] | None = None,
    *,
    example_inputs: Any = None,
    **options: Any,
) -> tuple[Traced, GraphCosts, PlanCheck, Plan]:
    """:func:`retrace`, then the budget and cut checks of :func:`check_plan`; returns the graph, its costs, the
    check and the plan as :func:`retrace` returns it (its copy ops placed anew where only those differ).

    Raises:
        PlanMismatchError: as :func:`check_plan`.
        BudgetError: as :func:`check_plan`.
    """
    given = budgets if isinstance(budgets, Budgets) or budgets is None else Budgets.parse(budgets)
    traced, costs, plan = retrace(model, plan, example_inputs=example_inputs, **options)
    check_input_writes(traced.graph_module, plan)  # the most specific refusal first
    held = {d: 0 for d in plan.devices}
    for weight in [*costs.weights, *costs.unused]:
        for device in () if weight.names[0] in plan.streamed else plan.holders(weight.names[0]):  # replicas too
            held[device] += weight.nbytes
    check_budgets(plan, held, given)
    check_storage(plan, costs)
    notes = [
        f"plan.device_bytes says {format_size(plan.device_bytes.get(d))} on '{d}', the placement puts "
        f"{format_size(n)} there"
        for d, n in held.items()
        if plan.device_bytes.get(d) != n
    ]
    notes += check_cuts(plan, traced, costs)
    usable = plan.usable if given is None else given.usable
    needs = device_needs(plan, held)
    rows = tuple((d, usable.get(d, 0), needs[d]) for d in plan.devices)
    return traced, costs, PlanCheck(rows, len(plan.placement), tuple(notes)), plan
