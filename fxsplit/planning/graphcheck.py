"""A saved plan against the re-traced graph: the budgets, the offload storage, the cuts and the output.

:func:`~fxsplit.planning.apply.checked_retrace` runs these after the plan's own
rules (:mod:`fxsplit.planning.rules`) and its structure check: each refuses, with
what differs, a plan that the model's tensors as placed would not fit, or whose
cuts or output are not those its placement implies on the graph (an edited plan).
"""

from __future__ import annotations

import torch.fx

from fxsplit.cost.build import GraphCosts
from fxsplit.errors import BudgetError, PlanMismatchError
from fxsplit.options import Budgets
from fxsplit.planning.build import cuts_for
from fxsplit.planning.plan import Cut, Plan
from fxsplit.planning.rules import budget_overruns
from fxsplit.tracing.capture import Traced
from fxsplit.tracing.graphinfo import tensor_origin
from fxsplit.units import format_size

__all__ = ["check_budgets", "check_cuts", "check_storage", "cut_text", "listing"]

_SHOWN = 12


def listing(title: str, lines: list[str]) -> str:
    shown = lines[:_SHOWN] + ([f"... and {len(lines) - _SHOWN} more"] if len(lines) > _SHOWN else [])
    return title + "\n  " + "\n  ".join(shown)


def cut_text(cut: Cut) -> str:
    return f"{cut.producer}: {cut.source} -> {cut.destination} ({format_size(cut.nbytes)}, {cut.kind})"


def check_budgets(plan: Plan, held: dict[str, int], budgets: Budgets | None) -> None:
    """Refuse when a device's memory, with the model's own tensors as placed, exceeds what it may hold."""
    over = budget_overruns(plan, held, budgets)
    if over:
        fix = (
            "the plan was edited or made for a smaller model: plan again for this model"
            if budgets is None
            else "plan again with these budgets"
        )
        raise BudgetError("the plan does not fit the budgets: " + "; ".join(map(str, over)) + f"; {fix}")


def check_storage(plan: Plan, costs: GraphCosts) -> None:
    """Refuse when the weights the plan stores off the devices, as the model has them, exceed a storage budget."""
    stored: dict[str, int] = {}
    for weight in [*costs.weights, *costs.unused]:
        tier = plan.streamed.get(weight.names[0])
        if tier is not None:
            stored[tier] = stored.get(tier, 0) + weight.nbytes
    over = [
        f"{tier} storage holds {format_size(nbytes)} ({nbytes} bytes) of streamed weights but its offload budget is "
        f"{format_size(plan.offload.get(tier))}"
        for tier, nbytes in stored.items()
        if plan.offload.get(tier) is None or nbytes > plan.offload[tier]
    ]
    if stored != {t: n for t, n in plan.stored_bytes.items() if n}:
        over.append(f"stored_bytes says {plan.stored_bytes}, the streamed weights add up to {stored}")
    if over:
        raise BudgetError(
            "the plan's offload storage does not fit: " + "; ".join(over) + "; the plan was edited or made for "
            "another model: plan again"
        )


def implied_cuts(plan: Plan, graph_module: torch.fx.GraphModule, costs: GraphCosts) -> list[Cut]:
    """The copies ``plan``'s placement, weight homes, streamed weights and replicas make on ``graph_module``."""
    weight_home = {w.names[0]: plan.param_devices[w.names[0]] for w in costs.weights}
    streamed = {w.names[0]: plan.streamed[w.names[0]] for w in costs.weights if w.names[0] in plan.streamed}
    replicas = {name: replica.devices for name, replica in plan.replicas.items()}
    return cuts_for(costs, graph_module, plan.placement, weight_home, streamed, replicas)


def check_cuts(plan: Plan, traced: Traced, costs: GraphCosts) -> list[str]:
    """Refuse cuts other than those the placement implies, or an output off ``output_device``; notes on sizes."""
    output = next(n.name for n in reversed(traced.graph_module.graph.nodes) if n.op == "output")
    if plan.placement.get(output) != plan.output_device:
        raise PlanMismatchError(
            f"output_device is {plan.output_device!r} but placement puts the output ({output!r}) on "
            f"{plan.placement.get(output)!r} (was it edited?); plan again with output_device={plan.output_device!r}"
        )
    expected = implied_cuts(plan, traced.graph_module, costs)
    if [_route(c) for c in expected] != [_route(c) for c in plan.cuts]:
        routes = {_route(c) for c in expected}
        stale = [f"plan lists {cut_text(c)}" for c in plan.cuts if _route(c) not in routes]
        listed = {_route(c) for c in plan.cuts}
        stale += [f"placement implies {cut_text(c)}" for c in expected if _route(c) not in listed]
        nodes = {n.name: n for n in traced.graph_module.graph.nodes}
        renamed = sorted(
            c.producer
            for c in plan.cuts
            if _route(c) not in routes
            and c.producer in nodes
            and tensor_origin(nodes[c.producer]) is not nodes[c.producer]
        )
        why = (
            f"the plan copies {', '.join(repr(n) for n in renamed)}, the result of an in-place write, apart from the "
            "tensor it wrote, as fxsplit did before it copied one tensor once per device: plan again"
            if renamed
            else "was it edited?"
        )
        raise PlanMismatchError(
            listing(
                f"the plan's cuts are not those its placement implies ({why}):", stale or ["same cuts, different order"]
            )
        )
    return [
        f"cut {cut_text(c)} is {format_size(e.nbytes)} with these inputs"
        for c, e in zip(plan.cuts, expected, strict=True)
        if c.nbytes != e.nbytes
    ]


def _route(cut: Cut) -> tuple[str, str, str, str]:
    return cut.producer, cut.source, cut.destination, cut.kind
