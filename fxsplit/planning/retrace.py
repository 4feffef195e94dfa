"""Trace a model again the way a saved plan was made, and check that the plan describes it.

:func:`retrace` is the first step of :func:`~fxsplit.planning.apply.apply` and
:func:`~fxsplit.planning.apply.check_plan`: the plan must meet the rules of
:mod:`fxsplit.planning.rules`, name the model's parameters and buffers (its
fingerprint), and place exactly the nodes of the graph traced again, but for copy ops (``contiguous``,
``lift_fresh_copy``: :mod:`fxsplit.planning.layoutnodes`).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
import torch.fx

from fxsplit.cost.build import GraphCosts, build_problem
from fxsplit.cost.constraints import locator, resolve_leaf_modules
from fxsplit.errors import FxsplitError, PlanMismatchError
from fxsplit.planning.fingerprint import describe, differences
from fxsplit.planning.graphcheck import listing
from fxsplit.planning.layoutnodes import layout_placement, with_layout
from fxsplit.planning.plan import Plan
from fxsplit.planning.rules import validate_plan
from fxsplit.tracing.capture import Traced, trace
from fxsplit.tracing.dynamic import dynamic_shapes_for
from fxsplit.tracing.rowsplit import split_rows
from fxsplit.validate import check_concrete_args, check_option_types, require_module

__all__ = ["retrace"]


def _check_structure(model: torch.nn.Module, plan: Plan) -> None:
    found = differences(plan.tensors, plan.tied, model, dtype=plan.dtype)
    if found:
        ours = describe(model)[0]
        raise PlanMismatchError(
            listing(
                f"the plan was made for another model (fingerprint {plan.fingerprint} in the plan, {ours} for this "
                f"model); {len(found)} difference(s):",
                found,
            )
        )


def retrace(
    model: torch.nn.Module,
    plan: Plan,
    *,
    example_inputs: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
    concrete_args: Mapping[str, Any] | None = None,
    leaf_modules: Iterable[type | str] = (),
    dynamic_shapes: Any = None,
) -> tuple[Traced, GraphCosts, Plan]:
    """Trace ``model`` the way ``plan`` was made and check that the plan places exactly its nodes; returns the
    graph, its costs and the plan, with its copy ops placed anew where only those differ
    (:mod:`fxsplit.planning.layoutnodes`: a graph traced on another kind of device).

    Raises:
        PlanMismatchError: the plan breaks the rules of :mod:`fxsplit.planning.rules`
            (a :class:`~fxsplit.planning.rules.PlanProblems` listing each), or the
            model's parameters or graph differ from the plan's.
        TraceError: the model cannot be traced.
    """
    require_module(model)
    given = {"example_kwargs": example_kwargs, "concrete_args": concrete_args, "leaf_modules": leaf_modules}
    check_option_types({**given, "dynamic_shapes": dynamic_shapes})
    check_concrete_args(model, concrete_args)
    validate_plan(plan)
    _check_structure(model, plan)
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    if example_inputs is None and not example_kwargs:
        if plan.trace == "export":
            raise FxsplitError(
                "this plan was traced with torch.export; pass example_inputs=(...) (same shapes as "
                "when planning) so that the graph can be traced again"
            )
        if any(cut.nbytes is not None for cut in plan.cuts if cut.kind != "parameter"):
            raise FxsplitError(
                "this plan was made with example inputs (its cuts have sizes); pass the same "
                "example_inputs=(...) so that the generated code is the same"
            )
    leaves = resolve_leaf_modules(model, [*plan.leaf_modules, *leaf_modules], locator(None, ()))
    traced = trace(
        model,
        example_inputs=example_inputs,
        example_kwargs=example_kwargs,
        mode=plan.trace,
        leaf_modules=leaves,
        concrete_args=concrete_args,
        dynamic_shapes=dynamic_shapes_for(plan, dynamic_shapes),
    )
    if plan.row_splits:  # the ops the plan computes in row pieces, as it was made
        try:
            split_rows(traced.graph_module, {op: split.bounds for op, split in plan.row_splits.items()})
        except ValueError as error:
            raise PlanMismatchError(f"the plan's row_splits do not fit the traced graph: {error}") from None
    placement = layout_placement(traced.graph_module, plan.placement)  # only copy ops differ: re-placed
    if placement is None:
        _check_nodes(traced.graph_module, plan)
    dtype = getattr(torch, plan.dtype) if plan.dtype else None
    index = {d: i for i, d in enumerate(plan.devices)}
    costs = build_problem(traced.graph_module, model, device_index=index, dtype=dtype)
    missing = [n for w in [*costs.weights, *costs.unused] for n in w.names if n not in plan.param_devices]
    if missing:
        raise PlanMismatchError(listing("the plan does not say where these tensors of the graph go:", missing))
    if placement is not None:
        plan = with_layout(plan, placement, traced.graph_module, costs)
    return traced, costs, plan


def _check_nodes(graph_module: torch.fx.GraphModule, plan: Plan) -> None:
    names = [n.name for n in graph_module.graph.nodes]
    extra = [n for n in names if n not in plan.placement]
    missing = [n for n in plan.placement if n not in set(names)]
    if extra or missing:
        lines = [f"not in the plan: node '{n}'" for n in extra] + [f"not in the graph: node '{n}'" for n in missing]
        how = f"trace={plan.trace!r}" + (f", leaf_modules={list(plan.leaf_modules)}" if plan.leaf_modules else "")
        raise PlanMismatchError(
            listing(
                f"the traced graph has {len(extra)} node(s) the plan does not place and the plan places {len(missing)} "
                f"node(s) the graph does not have; was the model's code changed? (the plan was made with {how})",
                lines,
            )
        )
