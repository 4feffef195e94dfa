"""Turn a user's ``nn.Module`` into an FX graph, without changing the module.

Two tracers:

* ``"fx"``: :func:`torch.fx.symbolic_trace` semantics with a tracer that honours ``leaf_modules`` and
  ``concrete_args``; with example inputs, shapes come from fake-tensor propagation (no real compute, no memory
  for weights).
* ``"export"``: :func:`torch.export.export` with ``strict=False`` on example inputs; the only route for models
  with data-dependent Python (Hugging Face transformers 5.x, for instance). Its graph is in ATen ops, and
  input/output structure (tuples, dicts, ``ModelOutput``) is restored by its codegen.

``"auto"`` uses export when example inputs are given, else fx. When export fails, the example inputs are checked
(:mod:`fxsplit.tracing.example_inputs`): inputs the model cannot run are an
:class:`~fxsplit.errors.ExampleInputError`; otherwise fx traces the model, with a
:class:`~fxsplit.errors.FxsplitWarning` that says why.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxsplit.callsite import user_stacklevel
from fxsplit.errors import FxsplitWarning, TraceError
from fxsplit.options import TRACE_MODES
from fxsplit.tracing.checkpoints import Checkpointed, plain_checkpoints
from fxsplit.tracing.customgrad import FunctionCalls, note_aliases, recording_functions, unfollowed_message
from fxsplit.tracing.dynamic import TRACED_INPUTS, check_kept_dynamic, describe_inputs, export_spec
from fxsplit.tracing.example_inputs import check_example_inputs, quiet_fake_tensor_log
from fxsplit.tracing.example_inputs import first_line as _first_line
from fxsplit.tracing.exportprint import partial_graphs_unprinted
from fxsplit.tracing.fixedreads import refuse_fixed_reads
from fxsplit.tracing.freshconstants import fresh_written_constants
from fxsplit.tracing.functionop import holding_call_sites
from fxsplit.tracing.fxcheckpoint import fold_regions
from fxsplit.tracing.fxshapes import propagate_shapes
from fxsplit.tracing.gradmode import modes_kept, recording_grad_mode, refusing_inference_mode
from fxsplit.tracing.graphkey import GraphKey
from fxsplit.tracing.heldstate import held_state_kept
from fxsplit.tracing.keyworddefaults import default_constant_keywords
from fxsplit.tracing.leaftracer import LeafTracer
from fxsplit.tracing.leftovers import clearing_leftovers
from fxsplit.tracing.metaweights import fake_weights_on, inputs_device
from fxsplit.tracing.modereads import AUTOCAST_DEVICES, MODE_READS, modes_fixed, recording_mode_reads
from fxsplit.tracing.modulehooks import keep_backward_hooks, warn_global_hooks
from fxsplit.tracing.proxykeys import recording_proxy_keys, refuse_lost_outputs
from fxsplit.tracing.pythonstate import python_state_kept
from fxsplit.tracing.randomdraws import recording_draws
from fxsplit.tracing.registered import registrations_undone
from fxsplit.tracing.tracefailures import export_message, fx_message, scripted_modules, scripted_note
from fxsplit.tracing.trainingreads import TRAINING_READS, mode_dependent, recording_training_reads

__all__ = ["TRACE_MODES", "Traced", "trace"]


@dataclass
class Traced:
    """An FX graph of the model and how it was obtained.

    Attributes:
        graph_module: the traced module; its parameters *are* the model's
            (shared, not copied).
        method: ``"fx"`` or ``"export"``.
        has_shapes: whether nodes carry ``meta["val"]`` with shapes and dtypes.
        notes: what happened on the way (e.g. why export fell back to fx).
        shapes_missing: why nodes carry no shapes, when ``has_shapes`` is False.
        checkpointed: what the forward ran under ``torch.utils.checkpoint`` (module paths), traced as plain calls
            (:mod:`fxsplit.tracing.checkpoints`); checkpoint_kept: what it kept whole, recomputed by the split.
        custom_kept: the custom autograd Functions the forward called, kept whole, one node per call
            (:mod:`fxsplit.tracing.customgrad`).
    """

    graph_module: torch.fx.GraphModule
    method: str
    has_shapes: bool
    notes: tuple[str, ...] = ()
    shapes_missing: str | None = None
    checkpointed: tuple[str, ...] = ()
    checkpoint_kept: tuple[str, ...] = ()
    custom_kept: tuple[str, ...] = ()
    proxy_keys: tuple[str, ...] = ()  # fx: where the model's code keyed a dict by a traced value (proxykeys.py)


def trace(
    model: torch.nn.Module,
    *,
    example_inputs: tuple[Any, ...] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    mode: str = "auto",
    leaf_modules: Iterable[type | str] = (),
    concrete_args: Mapping[str, Any] | None = None,
    dynamic_shapes: Any = None,
) -> Traced:
    """Trace ``model`` into an FX graph. The model is not modified.

    ``dynamic_shapes`` (``"batch"``, ``"all"`` or a torch.export spec; see
    :mod:`fxsplit.tracing.dynamic`) says which input sizes an export graph keeps
    variable; fx graphs take any size anyway.

    Raises:
        TraceError: neither tracer worked; says why and what to try.
        ExampleInputError: the model cannot run on the example inputs.

    Warns:
        FxsplitWarning: export failed and fx traced the model instead.
    """
    if mode not in TRACE_MODES:
        raise TraceError(f"trace mode must be one of {', '.join(TRACE_MODES)} (got {mode!r})")
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"model must be a torch.nn.Module (got {type(model).__name__})")
    has_examples = example_inputs is not None or bool(example_kwargs)
    if mode == "export" and not has_examples:
        raise TraceError("trace mode 'export' needs example_inputs (a tuple of the forward's positional inputs)")
    # Around the traces: what forward registers, put back (registered.py); the caches the traces fill with their
    # own values, emptied (leftovers.py); the model's generators stood in for (randomdraws.py); what forward
    # assigns, put back and said (pythonstate.py); what it stores on objects the modules hold, put back and refused
    with (
        held_state_kept(model) as held,  # (heldstate.py)
        registrations_undone(model),
        clearing_leftovers(model),
        recording_draws(model) as draws,
        python_state_kept(model),
    ):
        leaves = list(leaf_modules)  # and the modules whose backward hooks only a call of them runs (modulehooks.py)
        mode, leaves = keep_backward_hooks(model, mode, leaves, LeafTracer.of(leaves).is_leaf_module)
        warn_global_hooks()
        routed = functools.partial(
            _routed, model, leaves, example_inputs, example_kwargs, concrete_args, dynamic_shapes
        )
        with recording_mode_reads(model) as reads:  # the graph keeps one branch
            traced = routed(mode)  # of the grad mode, autocast and random draws (modereads.py, randomdraws.py)
            held.traced = (traced.graph_module, traced.method)
            draws.refuse_if_fixed(traced.graph_module, functools.partial(_again, routed, traced.method))
        if traced.proxy_keys and traced.has_shapes:  # what fx lost to them, found on fakes (proxykeys.py)
            refuse_lost_outputs(
                traced.graph_module, model, tuple(example_inputs or ()), example_kwargs or {}, traced.proxy_keys
            )
        key = GraphKey(traced.graph_module, model) if reads else None
        if reads and (read := modes_fixed(reads[0], key, _under(routed, traced.method, model), model)):
            traced.graph_module.meta[MODE_READS] = read  # (modereads.py)
        return traced


def _again(
    routed: Callable[[str], Traced], method: str, flip: Callable[[], None] = lambda: None
) -> torch.fx.GraphModule:
    """The graph that ``routed(method)`` traces after ``flip()`` changed the modes (then put back; its warnings
    unsaid)."""
    with modes_kept(AUTOCAST_DEVICES), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flip()
        return routed(method).graph_module


def _under(routed: Callable[[str], Traced], method: str, model: torch.nn.Module) -> Callable[..., GraphKey]:
    """The :class:`GraphKey` of the graph that ``routed(method)`` traces after ``flip()`` changed the modes."""
    return lambda flip: GraphKey(_again(routed, method, flip), model)


def _routed(
    model: torch.nn.Module,
    leaves: list[type | str],
    example_inputs: tuple[Any, ...] | None,
    example_kwargs: Mapping[str, Any] | None,
    concrete_args: Mapping[str, Any] | None,
    dynamic_shapes: Any,
    mode: str,
) -> Traced:
    """The model traced by ``mode`` (``"auto"``: export, then fx if export fails, with a warning)."""
    if mode == "export" or (mode == "auto" and (example_inputs is not None or bool(example_kwargs))):
        export_error: Exception | None = None
        for attempt in _export_attempts(model, tuple(example_inputs or ()), dict(example_kwargs or {}), dynamic_shapes):
            try:
                with quiet_fake_tensor_log():
                    return attempt()
            except TraceError:
                raise  # ours, already specific (dynamic_shapes not kept)
            except Exception as error:  # noqa: BLE001 - torch raises many kinds
                export_error = export_error or error
        assert export_error is not None  # every variant raised
        check_example_inputs(model, tuple(example_inputs or ()), example_kwargs or {}, export_error)
        scripted = scripted_modules(model)
        if mode == "export":
            raise TraceError(export_message(export_error, scripted)) from export_error
        try:
            traced = _symbolic(model, leaves, concrete_args, example_inputs, example_kwargs, checked=True)
        except TraceError as fx_error:
            raise TraceError(f"{export_message(export_error, scripted)}\n\nfx also failed: {fx_error}") from fx_error
        note = f"torch.export failed, used torch.fx: {_first_line(export_error)}"
        message = _fallback_message(export_error, traced, scripted)
        warnings.warn(FxsplitWarning(message), stacklevel=user_stacklevel())
        return dataclasses.replace(traced, notes=(note,))
    return _symbolic(model, leaves, concrete_args, example_inputs, example_kwargs)


def _export_attempts(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_shapes: Any
) -> Iterator[Callable[[], Traced]]:
    """Export on the example inputs as given. A model with weights on ``meta`` and real inputs is first exported
    with its weights as fakes on the inputs' device (:mod:`fxsplit.tracing.metaweights`: the code it runs there),
    then as given, and last with the inputs on ``meta`` too (:func:`_example_variants`)."""
    device = inputs_device(model, args, kwargs)
    if device is not None:

        def on_fake_weights() -> Traced:
            with fake_weights_on(model, device) as (mode, restore):
                fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
                traced = _export(model, fake_args, fake_kwargs, dynamic_shapes)
            restore(traced.graph_module)
            return traced

        yield on_fake_weights
    yield functools.partial(_export, model, args, kwargs, dynamic_shapes)
    for meta_args, meta_kwargs in list(_example_variants(model, args, kwargs))[1:]:
        yield functools.partial(_export, model, meta_args, meta_kwargs, dynamic_shapes)


def _example_variants(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The example inputs as given; then, for a model with weights on ``meta`` (built to be loaded from a
    checkpoint) and real inputs, the same inputs on ``meta``: export cannot mix meta weights with real
    inputs, and only the inputs' sizes and dtypes matter to the graph."""
    yield args, kwargs
    on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    leaves = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    if on_meta and any(not t.is_meta for t in leaves):
        yield pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))


def _fallback_message(export_error: BaseException, traced: Traced, scripted: list[str]) -> str:
    if traced.has_shapes:
        outcome = "its sizes come from running the fx graph on fake tensors"
    else:
        outcome = f"that graph has no sizes ({traced.shapes_missing}), so the plan counts no activations or cut sizes"
    why = f"{scripted_note(scripted)}: {_first_line(export_error)}" if scripted else _first_line(export_error)
    return (
        f"torch.export could not trace the model ({why}); fxsplit traced it with torch.fx "
        f"instead: {outcome}. Pass trace='fx' to choose fx (no warning), or fix what export reports "
        "(trace='export' raises it in full)"
    )


_FLAT_WEIGHTS_ONLY = r"The tensor attributes (?:self\.[\w.]*_flat_weights\[\d+\](?:, )?)+ were assigned during export"
"""torch.export's warning when every attribute it names is an RNN's list of its own parameters."""


def _export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_shapes: Any) -> Traced:
    spec = export_spec(model, args, kwargs, dynamic_shapes) if dynamic_shapes is not None else None
    with (
        refusing_inference_mode("torch.export"),
        warnings.catch_warnings(),
        plain_checkpoints(model, keep="export") as met,
        recording_functions(keep="export") as functions,
        holding_call_sites() as attach,
        partial_graphs_unprinted(),  # fxsplit reports a failure itself
    ):
        # RNNs' _flat_weights, which export would have registered as buffers: the split holds them as parameters
        warnings.filterwarnings("ignore", message=_FLAT_WEIGHTS_ONLY, category=UserWarning)
        exported = torch.export.export(model, args, kwargs or None, strict=False, dynamic_shapes=spec)
        attach(graph_module := exported.module())
    if not isinstance(graph_module, torch.fx.GraphModule):  # pragma: no cover - torch internals
        raise TraceError("torch.export returned an unflattened module; fxsplit needs a flat graph")
    graph_module.training = model.training  # the mode export baked into the graph
    check_kept_dynamic(graph_module, dynamic_shapes)
    refuse_fixed_reads(graph_module)  # a number export read from a changing tensor and fixed (fixedreads.py)
    graph_module.meta[TRACED_INPUTS] = describe_inputs(graph_module.graph)
    default_constant_keywords(graph_module, kwargs)
    if functions.kept or met.kept:
        note_aliases(graph_module)
    return Traced(graph_module, "export", True, **_met(met, functions))


def _symbolic(
    model: torch.nn.Module,
    leaves: list[type | str],
    concrete_args: Mapping[str, Any] | None,
    example_inputs: tuple[Any, ...] | None,
    example_kwargs: Mapping[str, Any] | None,
    *,
    checked: bool = False,
) -> Traced:
    """Trace with torch.fx; with example inputs, shapes from fake tensors.

    ``checked``: the example inputs were already checked (do not run the model again).

    Raises:
        ExampleInputError: shapes could not be found because the model cannot run the example inputs.
    """

    def trace_once(flipped: Mapping[str, bool] | None = None) -> tuple[Any, ...]:
        tracer = LeafTracer.of(leaves)
        with (
            recording_grad_mode(tracer),
            plain_checkpoints(model, "fx") as met,
            recording_functions(keep="fx") as functions,
            recording_training_reads(model, flipped) as training_reads,
            recording_proxy_keys() as keyed,
        ):
            graph = tracer.trace(model, concrete_args=dict(concrete_args) if concrete_args else None)
        return tracer, graph, met, functions, training_reads, tuple(keyed)

    held = [(path, m, dict(m._parameters), dict(m._buffers)) for path, m in model.named_modules(remove_duplicate=False)]
    try:
        tracer, graph, met, functions, training_reads, keyed = trace_once()
        training_reads = mode_dependent(training_reads, graph, lambda: trace_once(training_reads)[1])
    except TraceError:
        raise  # ours: names the construct fx cannot keep
    except Exception as error:  # noqa: BLE001 - tracing user code raises anything
        given = example_inputs is not None or bool(example_kwargs)
        raise TraceError(fx_message(error, "tried" if checked else "given" if given else None)) from error
    finally:
        assigned = _put_back(held)
    if assigned:
        raise TraceError(
            f"the forward assigns to {', '.join(map(repr, assigned))} (like `self.steps += 1` on a buffer), which "
            "torch.fx records as a new value, not as a change of the model's tensor; write it in place "
            "(`self.steps.add_(1)`), or trace with torch.export (example_inputs=(...), trace='export'), which "
            "keeps such updates (the model is as it was)"
        )
    folded, left = fold_regions(graph, met.regions, tracer.root, met.paths)
    met.kept, met.plain = folded, [*met.plain, *left]
    graph_module = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    fresh_written_constants(graph_module, model)  # made afresh at each call, written in place (freshconstants.py)
    graph_module.meta[TRAINING_READS] = training_reads  # the modes the graph fixed (codegen/splitmodule.py)
    traced = Traced(graph_module, "fx", True, proxy_keys=keyed, **_met(met, functions))
    if example_inputs is None and not example_kwargs:
        missing = "no example_inputs, so the graph has no sizes"
        return dataclasses.replace(traced, has_shapes=False, shapes_missing=missing)
    failures = []  # the first says what went wrong with the inputs as given
    for args, kwargs in _example_variants(model, tuple(example_inputs or ()), dict(example_kwargs or {})):
        failures.append(propagate_shapes(graph_module, args, kwargs))
        if failures[-1] is None:
            break
    failure = failures[0] if failures[-1] is not None else None
    args, kwargs = tuple(example_inputs or ()), dict(example_kwargs or {})
    if failure is None:
        if (functions.kept or met.kept) and (unfollowed := note_aliases(graph_module)):
            raise TraceError(unfollowed_message(unfollowed))
        return traced
    if not checked:
        check_example_inputs(model, args, kwargs)
    missing = f"running the fx graph on fake tensors failed: {failure}"
    return dataclasses.replace(traced, has_shapes=False, shapes_missing=missing)


def _met(met: Checkpointed, functions: FunctionCalls) -> dict[str, Any]:
    """:class:`Traced`'s fields for the checkpoint calls and custom Functions a trace met."""
    return {"checkpointed": tuple(met.plain), "checkpoint_kept": tuple(met.kept), "custom_kept": tuple(functions.kept)}


def _put_back(held: list[tuple[str, torch.nn.Module, dict[str, Any], dict[str, Any]]]) -> list[str]:
    """Restore every parameter and buffer that tracing replaced (fx runs ``self.steps += 1`` by setting the
    buffer to a Proxy); returns their qualified names."""
    assigned = []
    for path, module, parameters, buffers in held:
        for table, kept in ((module._parameters, parameters), (module._buffers, buffers)):
            for name, tensor in kept.items():
                if (table[name] if name in table else None) is not tensor:  # (a ScriptModule's table has no get)
                    table[name] = tensor
                    assigned.append(f"{path}.{name}" if path else name)
    return assigned
