"""The tensors a traced graph reads by name, and the same graph reading others in their place.

:func:`graph_tensors` lists them (parameters, buffers, the constants ``get_attr`` nodes read);
:func:`replace_graph_tensors` makes a stand-in for each (fake tensors, for the activation profile and the
compute profile), for ``torch.nn.utils.stateless._reparametrize_module``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx

from fxsplit.attrpath import attr_at

__all__ = ["graph_tensors", "replace_graph_tensors"]


def graph_tensors(graph_module: torch.fx.GraphModule) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor the graph reads by name: parameters, buffers and the tensors
    ``get_attr`` nodes read (constants), under each of their names (a tied one several times)."""
    named = [
        *graph_module.named_parameters(remove_duplicate=False),
        *graph_module.named_buffers(remove_duplicate=False),
    ]
    for node in graph_module.graph.nodes:
        if node.op == "get_attr":
            attr = attr_at(graph_module, str(node.target), None)
            if isinstance(attr, torch.Tensor):
                named.append((str(node.target), attr))
    return [(name, tensor) for name, tensor in named if tensor is not None]


def replace_graph_tensors(
    graph_module: torch.fx.GraphModule, make: Callable[[str, torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Every tensor the graph reads by name (:func:`graph_tensors`) -> ``make(name, tensor)``, for
    ``_reparametrize_module``. ``make`` is called once per tensor, with its first name, and tied names share what
    it made. The graph is not modified.
    """
    made: dict[str, torch.Tensor] = {}
    by_id: dict[int, torch.Tensor] = {}
    for name, tensor in graph_tensors(graph_module):
        if name in made:
            continue
        replacement = by_id.get(id(tensor))
        if replacement is None:
            replacement = by_id[id(tensor)] = make(name, tensor)
        made[name] = replacement
    return made
