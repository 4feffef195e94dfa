"""A saved plan applied to a graph traced on another kind of device: its copy ops may differ.

torch.export records ``x.contiguous()`` as an op only where ``x`` is not contiguous, and that depends on the
strides the device's kernels return: on ``meta``, ``scaled_dot_product_attention`` returns another layout than
on the CPU, so Hugging Face's GPT-2 or Llama planned on ``meta`` has two ``contiguous`` ops that its graph traced
on the CPU lacks (``attn_output.transpose(1, 2).contiguous()``), and a plan made on one could not be applied to
the other. A constant tensor made in ``forward`` (``torch.tensor(...)``) is copied by a ``lift_fresh_copy`` op on
the CPU and not on ``meta`` (Falcon, CPM-Ant). Such an op computes its input's values: :func:`layout_placement`
places every such op of the graph traced again with the op it copies and keeps the plan's device for every other
node, so that the caller can work out the plan's cuts anew on that graph.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import torch
import torch.fx

from fxsplit.callsite import user_stacklevel
from fxsplit.cost.build import GraphCosts
from fxsplit.errors import FxsplitWarning
from fxsplit.planning.graphcheck import implied_cuts
from fxsplit.planning.plan import Cut, Plan

__all__ = ["is_copy_op", "layout_placement", "with_layout"]

aten = torch.ops.aten
_NAME = re.compile(r"(contiguous|lift_fresh_copy)(_\d+)?")
_TARGETS = (aten.contiguous.default, aten.lift_fresh_copy.default, torch.Tensor.contiguous, "contiguous")


def is_copy_op(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a ``contiguous`` call (torch.export's ATen op, or torch.fx's method call), or torch.export's
    copy of a constant made in ``forward`` (``lift_fresh_copy``: on the CPU, not on ``meta``)."""
    return node.op in ("call_function", "call_method") and node.target in _TARGETS and bool(node.all_input_nodes)


def layout_placement(graph_module: torch.fx.GraphModule, placement: dict[str, str]) -> dict[str, str] | None:
    """Node name -> device for the nodes of ``graph_module``, from ``placement`` (a plan's), when the two differ
    only by copy ops (:func:`is_copy_op`): each such op of the graph goes where its input goes (numbered anew, a
    name in the plan may name another op), the rest where the plan puts them. None when they differ otherwise."""
    nodes = list(graph_module.graph.nodes)
    names = {node.name for node in nodes}
    extra = [node for node in nodes if node.name not in placement]
    missing = [name for name in placement if name not in names]
    if not (extra or missing):
        return None
    if not all(is_copy_op(node) for node in extra) or not all(_NAME.fullmatch(name) for name in missing):
        return None
    placed: dict[str, str] = {}
    for node in nodes:
        if is_copy_op(node):
            source = node.all_input_nodes[0]
            placed[node.name] = placed[source.name]
        else:
            placed[node.name] = placement[node.name]
    return placed


def with_layout(plan: Plan, placement: dict[str, str], graph_module: torch.fx.GraphModule, costs: GraphCosts) -> Plan:
    """``plan`` with ``placement`` (:func:`layout_placement`) and the cuts it implies on ``graph_module``; warns
    when they are other copies than the plan's (devices and bytes, in order)."""
    placed = dataclasses.replace(plan, placement=placement)
    cuts = tuple(implied_cuts(placed, graph_module, costs))
    made = dataclasses.replace(placed, cuts=cuts)
    if [_route(cut) for cut in cuts] == [_route(cut) for cut in plan.cuts]:
        return made  # the same copies (a cut of a copy op's value now of the value it copied): nothing to say
    ours = sum(1 for name in plan.placement if _NAME.fullmatch(name))
    here = sum(1 for node in graph_module.graph.nodes if is_copy_op(node))
    warnings.warn(
        FxsplitWarning(
            f"the plan was made on a graph with {ours} copy op(s) (contiguous, lift_fresh_copy), this one has {here} "
            "(traced where tensors are otherwise: on meta and on the CPU, scaled_dot_product_attention returns "
            "different strides, and a constant made in forward is copied on the CPU only); each is placed with the "
            f"op it copies and the copies are worked out anew: {len(cuts)} cut(s), {made._transfer_text()} per "
            f"forward (the plan said {len(plan.cuts)}, {plan._transfer_text()})"
        ),
        stacklevel=user_stacklevel(),
    )
    return made


def _route(cut: Cut) -> tuple[str, str, int | None, str]:
    """What a copy moves, and where, without the node that makes it (a copy op's or the value it copied)."""
    return cut.source, cut.destination, cut.nbytes, cut.kind
