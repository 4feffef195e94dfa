"""The public entry points: wire trace -> cost -> partition -> plan -> codegen."""

from __future__ import annotations

import functools
import warnings
from contextlib import ExitStack
from typing import Any, Callable, Mapping, TypeVar, overload

import torch
import torch.fx

from fxsplit.callsite import user_stacklevel
from fxsplit.check import verify_split
from fxsplit.checkpoint import prepare, remember_non_persistent
from fxsplit.checkpoint.cast import CastForLoad, PlanningCast, warn_uncast
from fxsplit.checkpoint.standin import planning_inputs
from fxsplit.checkpoint.unloaded import guard_meta_weights
from fxsplit.codegen.emitter import emit, move_weights
from fxsplit.cost.constraints import (
    check_constraints,
    locator,
    placing_nothing,
    resolve_leaf_modules,
    together_groups,
)
from fxsplit.cost.walk import one_walk
from fxsplit.devices import require_usable
from fxsplit.errors import FxsplitError, FxsplitWarning, SpecError, TraceError
from fxsplit.gcpause import gc_paused
from fxsplit.optionparse import parse_options
from fxsplit.options import Budgets, PipelineConfig
from fxsplit.pipeline.gpipe import Pipeline, mixing_message, pipelined
from fxsplit.pipeline.microbatch import argument_names, first_microbatch, on_one_microbatch, one_microbatch_shapes
from fxsplit.plangraph import GraphPlanning, Planned, plan_graph
from fxsplit.planning.plan import Plan
from fxsplit.planning.rowsplits import try_row_splits, wants_row_splits
from fxsplit.planning.weightmap import device_map_homes, pins_as_device_map, refuse_with_map
from fxsplit.spec import load_spec, merge_spec, planning_dtype
from fxsplit.stages import StageTimer
from fxsplit.tracing.capture import Traced, trace
from fxsplit.tracing.checkpoints import checkpointing_message
from fxsplit.tracing.mixeddtypes import looking_inside, mixed_dtype_message, mixed_dtype_ops
from fxsplit.validate import (
    check_concrete_args,
    device_option,
    refuse_growing_state,
    refuse_meta,
    require_module,
    unwrapped,
)

__all__ = ["Planned", "fxsplit", "plan", "trace_and_plan"]


def trace_and_plan(
    model: torch.nn.Module,
    budgets: Any,
    example_inputs: Any,
    raw: Mapping[str, Any],
    *,
    runnable: bool = False,
    cast: CastForLoad | None = None,
) -> Planned:
    """Trace and plan; with ``runnable``, first refuse devices that cannot be used here (the split will run in
    this process, so it splits no op's rows: :mod:`fxsplit.planning.rowsplits`); ``cast`` is called with the
    plan's dtype just before tracing, and traces (:meth:`~fxsplit.checkpoint.cast.CastForLoad.traced`)."""
    return _planned(model, budgets, example_inputs, raw, runnable, keep=lambda planned: planned, cast=cast)


_Kept = TypeVar("_Kept")


def _planned(
    model: torch.nn.Module,
    budgets: Any,
    example_inputs: Any,
    raw: Mapping[str, Any],
    runnable: bool,
    keep: Callable[[Planned], _Kept],
    cast: CastForLoad | None = None,
) -> _Kept:
    """``keep`` of what :func:`trace_and_plan` makes.

    The cyclic collector is paused (:mod:`fxsplit.gcpause`) from the end of
    tracing until the rest of what planning made is dropped: resumed earlier,
    its next pass would walk every object planning made that is still alive.
    """
    with ExitStack() as planning:
        with one_walk():  # the model's tensors, walked once for the cost model, memory model and fingerprint
            planned = _trace_and_plan(model, budgets, example_inputs, raw, runnable, planning, cast)
        kept = keep(planned)
        del planned
    return kept


def _trace_and_plan(
    model: torch.nn.Module,
    budgets: Any,
    example_inputs: Any,
    raw: Mapping[str, Any],
    runnable: bool,
    planning: ExitStack,
    cast: CastForLoad | None = None,
) -> Planned:
    require_module(model)
    explicit = set(raw) - {"spec"}
    spec = load_spec(raw["spec"]) if raw.get("spec") is not None else None
    if spec is not None:
        budgets, raw = merge_spec(spec, budgets, {k: v for k, v in raw.items() if k != "spec"})
    options = parse_options(raw)
    if budgets is None:
        raise SpecError(
            "no budgets: pass budgets={'cuda:0': '20GiB', 'cuda:1': '20GiB'}, budgets='auto', or a spec with devices"
        )
    device_budgets = Budgets.parse(budgets, options.reserve)
    devices = list(device_budgets.devices)
    output_device = device_option("output_device", options.output_device) if options.output_device is not None else None
    if runnable:
        require_usable([*devices, *([output_device] if output_device else [])], device_budgets.limits)
    check_concrete_args(model, options.concrete_args)
    dtype = planning_dtype(options.dtype)
    locate = locator(spec, explicit)
    homes = None
    if options.device_map is not None:
        refuse_with_map(options)
        homes = device_map_homes(model, options.device_map, devices, locate)
    leaves = list(options.leaf_modules)
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    example_kwargs = options.example_kwargs
    whole = (example_inputs, example_kwargs)
    if isinstance(options.pipeline, PipelineConfig):  # trace one micro-batch: export fixes shapes
        example_inputs, example_kwargs = first_microbatch(
            example_inputs, example_kwargs, options.pipeline.chunks, options.pipeline.broadcast, argument_names(model)
        )
    as_traced = cast is not None and cast(dtype)  # the model as the checkpoint fills it: its graph of those dtypes
    at_dtype = (  # plan(): the model as it runs at the dtype (free: meta), till the end
        PlanningCast(model, dtype, (example_inputs, example_kwargs), stand_in=not options.profile)
        if cast is None
        else None
    )
    if at_dtype is not None:
        planning.callback(at_dtype.undo)

    def tracing(inputs: Any, kwargs: Mapping[str, Any] | None) -> Traced:
        return trace(
            model,
            example_inputs=inputs,
            example_kwargs=kwargs,
            mode=options.trace,
            leaf_modules=resolve_leaf_modules(model, leaves, locate),
            concrete_args=options.concrete_args,
            dynamic_shapes=options.dynamic_shapes,
        )

    fed_at_dtype = False
    try:
        planning.enter_context(looking_inside(bool(dtype)))  # into leaf modules, for ops that mix dtypes
        if at_dtype is not None:
            traced = at_dtype.traced(tracing)
        elif cast is not None:  # (its computed buffers too, where the cast graph needs them at the dtype)
            given = (example_inputs, example_kwargs)
            traced, fed = cast.fed(tracing, given, lambda made: made)
            (example_inputs, example_kwargs), fed_at_dtype = fed, fed is not given
        else:
            traced = tracing(example_inputs, example_kwargs)
    except TraceError as error:  # torch.export's own failure too (a reshape to the whole batch's size)
        if isinstance(options.pipeline, PipelineConfig) and options.pipeline.chunks > 1:
            raise type(error)(on_one_microbatch(str(error), options.pipeline.chunks)) from error
        raise
    if at_dtype is not None:  # what was traced: floating inputs as given or at the dtype (checkpoint/fed.py)
        example_inputs, example_kwargs = at_dtype.inputs
    as_traced = as_traced or (at_dtype is not None and at_dtype.cast)
    if as_traced and dtype and (mixed := mixed_dtype_ops(traced.graph_module)):  # fake kernels let it trace
        warnings.warn(FxsplitWarning(mixed_dtype_message(mixed, dtype)), stacklevel=user_stacklevel())
    if traced.shapes_missing and isinstance(options.pipeline, PipelineConfig) and options.pipeline.chunks > 1:
        cast_inputs = fed_at_dtype or (at_dtype is not None and at_dtype.fed_at_dtype)  # (as the micro-batch was)
        whole = planning_inputs(whole, getattr(torch, dtype)) if cast_inputs and dtype else whole
        traced = one_microbatch_shapes(traced, whole, options.pipeline.chunks)
    pipeline_recomputes = isinstance(options.pipeline, PipelineConfig) and options.pipeline.checkpoint != "never"
    if traced.checkpointed and options.mode == "training" and not pipeline_recomputes:
        warnings.warn(FxsplitWarning(checkpointing_message(traced.checkpointed)), stacklevel=user_stacklevel())
    planning.enter_context(gc_paused())  # until the caller has dropped what it does not keep
    refuse_growing_state(traced.graph_module)
    pins = {str(k): device_option(f"pins[{str(k)!r}]", v) for k, v in (options.pins or {}).items()}
    vacuous = placing_nothing(traced.graph_module, model, pins) if pins else set()
    pins = {k: v for k, v in pins.items() if k not in vacuous}
    together = together_groups(options.together)
    try:
        check_constraints(traced.graph_module, model, devices, pins, together, locate)
    except SpecError as error:
        if not pins or homes is not None:
            raise
        homes, pins = pins_as_device_map(model, pins, devices, error, options, locate), {}

    job = GraphPlanning(
        model,
        traced,
        options,
        device_budgets,
        output_device,
        dtype,
        leaves,
        pins,
        together,
        locate,
        homes,
        (example_inputs, example_kwargs),
        as_traced=as_traced,
        given=at_dtype.given if at_dtype is not None else None,
    )
    planned = plan_graph(job)
    if not runnable and wants_row_splits(options, homes):  # stages in processes of their own
        planned = try_row_splits(planned, traced.graph_module, functools.partial(plan_graph, job))
    return planned


def plan(model: torch.nn.Module, budgets: Any = None, *, example_inputs: Any = None, **options: Any) -> Plan:
    """Decide where every op, parameter and buffer of ``model`` goes; run nothing.

    Works on models built on the ``meta`` device (no weights needed). Takes the
    same arguments as :func:`fxsplit`. The model is not modified: with ``dtype=``,
    the model as it runs at the dtype is traced and planned (a ``meta`` model
    cast, free; empty meta tensors standing in for real weights), and the model's
    own tensors are put back (:class:`~fxsplit.checkpoint.cast.PlanningCast`).

    Example:
        >>> import torch, fxsplit
        >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
        >>> p = fxsplit.plan(model, {"cpu:0": "300KiB", "cpu:1": "300KiB"}, example_inputs=(torch.randn(2, 256),))
        >>> p.param_devices["0.weight"], p.param_devices["2.weight"]
        ('cpu:0', 'cpu:1')
        >>> [(c.producer, c.destination, c.nbytes) for c in p.cuts]
        [('relu', 'cpu:1', 2048)]
    """
    return _planned(unwrapped(model), budgets, example_inputs, options, False, keep=_plan_checked_for_rows)


def _plan_checked_for_rows(planned: Planned) -> Plan:
    """The plan; for a pipeline, warn (or raise, with ``batch_stats="error"``) where the model mixes the rows of
    the batch, as the pipeline itself would: a plan made to decide what to rent should say so before."""
    config = planned.options.pipeline if planned.options is not None else None
    if isinstance(config, PipelineConfig) and config.batch_stats != "allow":
        said = mixing_message(planned.traced.graph_module, config.chunks, config.broadcast)
        if said and config.batch_stats == "error":
            raise FxsplitError(said)
        if said:
            warnings.warn(FxsplitWarning(said), stacklevel=user_stacklevel())
    return planned.plan


@overload
def fxsplit(
    model: torch.nn.Module,
    budgets: Mapping[Any, Any] | None = None,
    *,
    example_inputs: Any = None,
    pipeline: None = None,
    **options: Any,
) -> torch.fx.GraphModule: ...


@overload
def fxsplit(
    model: torch.nn.Module,
    budgets: Mapping[Any, Any] | None = None,
    *,
    example_inputs: Any = None,
    pipeline: PipelineConfig | Mapping[str, Any] | int,
    **options: Any,
) -> Pipeline: ...


def fxsplit(
    model: torch.nn.Module,
    budgets: Mapping[Any, Any] | None = None,
    *,
    example_inputs: Any = None,
    checkpoint: Any = None,
    progress: bool | None = None,
    strict: bool = True,
    **options: Any,
) -> torch.fx.GraphModule | Pipeline:
    """Split ``model`` over devices under per-device memory budgets.

    Traces the model, assigns every op to a device so that what each device
    holds (as ``mode`` counts it: by default parameters, buffers and the
    activation peak) fits its budget less its reserve, while the bytes copied
    between devices are as few as possible, and returns a ``GraphModule`` whose
    ``forward`` runs each op on its device with ``.to(device)`` copies at the
    cut edges. ``gm.meta["fxsplit_plan"]`` is the :class:`Plan`.

    What happens to ``model``: like ``model.to()``, its parameters and buffers
    are moved to their planned devices *in place* (the same ``Parameter``
    objects, so an optimizer built on ``model.parameters()`` keeps working),
    and the returned module shares them; no second copy of the weights is
    made. The module's structure, ``forward`` and hooks are not changed.

    Args:
        model: the module to split.
        budgets: device -> bytes (int) or a size string (``"20GiB"``, ``"2GB"``).
            Keys: ``"cuda:1"``, ``"cpu:0"``, ``torch.device`` or an int meaning
            ``cuda:N``. The mapping's order is the order of the stages. Or
            ``"auto"``: the free memory of every visible GPU less 1 GiB
            (:func:`fxsplit.auto_budgets`). A budget holds everything
            ``mode`` counts, not only the parameters. May be None when a
            ``spec`` names the devices.
        example_inputs: a tuple of positional inputs (real or meta tensors).
            With them, ``torch.export`` traces the model and every cut knows its
            bytes; without, ``torch.fx.symbolic_trace`` does.
        **options: ``example_kwargs`` (keyword inputs for tracing), ``trace`` (``"auto"`` | ``"fx"`` |
            ``"export"``), ``leaf_modules`` (module types or qualified names fx must not trace into),
            ``concrete_args``, ``output_device`` (default: the device of the last op), ``objective``
            (``"min_transfer"``, the default, or ``"balanced"``), ``pins`` (module path or glob -> device; pins
            that cannot be op pins but place every weight are read as a ``device_map``), ``device_map`` (module
            or tensor name -> device, as Accelerate writes it: the weights stay where it says, the ops go where
            they copy least; see docs/ACCELERATE.md), ``mode`` (``"inference"``, the default: parameters,
            buffers and the activation peak of a forward; ``"training"``: also gradients, ``optimizer`` state
            (``"adam"``, the default, ``"adamw"``, ``"sgd_momentum"``, ``"sgd"`` or bytes per parameter element)
            and what autograd saves; ``"weights"``: parameters and buffers only; see :mod:`fxsplit.memory`),
            ``together`` (groups of module patterns that must share a device), ``reserve`` (headroom kept free:
            a size, ``"10%"`` of the budget, or a mapping device -> either), ``dtype`` (plan as if floating
            tensors were ``"bfloat16"``/``"float16"``/``"float32"``; the model is cast only when a
            ``checkpoint`` fills it, else cast it yourself before splitting), ``pipeline`` (a
            :class:`~fxsplit.PipelineConfig`, or ``{"chunks": k, ...}``: run micro-batches through the stages in
            a pipeline; the model is then traced on one micro-batch of the example inputs; implies
            ``contiguous=True``), ``contiguous`` (keep every device's ops one consecutive run of the graph, in
            device order; by default single ops may then move out of order where that copies fewer bytes, e.g. a
            tied head beside its embedding) and ``spec`` (a :class:`~fxsplit.spec.Spec`, a spec file or YAML
            text; its devices are the budgets when ``budgets`` is None, and explicit keyword arguments override
            its fields). ``check=True`` verifies the invariants of the plan and of the generated graph
            (:mod:`fxsplit.check`), raising :class:`~fxsplit.InvariantError` on a violation; for debugging
            fxsplit.
        checkpoint: load the weights from this checkpoint (safetensors or
            ``torch.save`` file, index ``.json``, or ``save_pretrained``
            directory) straight onto their planned devices, as the plan's
            ``dtype`` when one is given; for models built on ``meta`` (see
            docs/CHECKPOINTS.md). Checked against the model before tracing.
            The model's meta tensors are replaced by the loaded ones (as
            ``load_state_dict(assign=True)`` does; model and split share
            them); real ones keep their objects and get the loaded data.
            ``False``: return a split of a meta model with meta weights, to
            fill later with :func:`fxsplit.load_checkpoint`.
        progress: on stderr, the time spent tracing and planning and a
            progress bar while loading: None (default) on a terminal only,
            True always, False never.
        strict: with ``checkpoint``, False loads what fits: the checkpoint's tensors the model lacks are
            skipped; the model's tensors it lacks keep their values, or on ``meta`` are initialized as the model
            initializes them (a Hugging Face model's ``_init_weights``, else ``reset_parameters()``); a warning
            lists both (docs/CHECKPOINTS.md).

    Returns:
        The split ``torch.fx.GraphModule``. Call it like ``model``. With
        ``pipeline=...``, a :class:`~fxsplit.Pipeline` (an ``nn.Module``
        with the same ``meta["fxsplit_plan"]``; its ``code`` is the code of
        each stage, ``stages[i].code`` that of stage ``i``).

    Raises:
        BudgetError: it does not fit; says what, where and by how much.
        TraceError: the model cannot be traced; says why and what to try.
        SpecError: a malformed argument.
        CheckpointError: the checkpoint does not fit the model; lists every
            problem; nothing was loaded.
        DeviceError: a device cannot be used here (checked before any work),
            or moving a weight failed (what was moved is put back first).

    Example:
        >>> import torch, fxsplit
        >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
        >>> gm = fxsplit.fxsplit(model, {"cpu:0": "300KiB", "cpu:1": "300KiB"},
        ...                      example_inputs=(torch.randn(2, 256),), trace="fx")
        >>> print(gm.code.strip())
        def forward(self, input):
            input_1 = input
            to = input_1.to('cpu:0');  input_1 = None
            _0 = getattr(self, "0")(to);  to = None
            _1 = getattr(self, "1")(_0);  _0 = None
            to_1 = _1.to('cpu:1');  _1 = None
            _2 = getattr(self, "2")(to_1);  to_1 = None
            return _2
    """
    model = unwrapped(model)
    loading = prepare(model, checkpoint, progress, strict)  # checks the checkpoint before the (long) trace
    with CastForLoad(model, checkpoint is not None) as cast:  # cast to the plan's dtype; undone if the call fails
        with StageTimer(enabled=progress).stage("fxsplit: tracing and planning"):
            planned = trace_and_plan(model, budgets, example_inputs, options, runnable=True, cast=cast)
    with cast, loading.onto(planned.plan, planned.traced.graph_module) as loaded:  # undone if what follows fails
        if checkpoint is None:
            refuse_meta(model)
            warn_uncast(model, planned.plan.dtype)
        moved = move_weights(
            planned.traced.graph_module,
            planned.plan,
            loaded.not_loaded(planned.costs.weights + planned.costs.unused),
            model,
        )
        try:
            emitted = emit(planned.traced.graph_module, planned.plan, model)
            split = guard_meta_weights(remember_non_persistent(emitted, model))
            if planned.options is not None and planned.options.check:
                verify_split(split)
            if planned.options is not None and isinstance(planned.options.pipeline, PipelineConfig):
                return guard_meta_weights(remember_non_persistent(pipelined(split, planned.options.pipeline), model))
            return split
        except BaseException:
            moved.undo()  # a failed call leaves the model as it was
            raise
