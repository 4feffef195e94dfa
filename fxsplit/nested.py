"""Devices inside the subgraphs of higher-order ops, pointed at the device of the op that calls them.

``torch.export`` keeps some regions as subgraphs called by a higher-order op
(``wrap_with_autocast``, ``wrap_with_set_grad_enabled``: a Hugging Face rotary
embedding under ``torch.autocast(enabled=False)`` is one). Their nodes carry the
devices seen when tracing (``_assert_tensor_metadata(device=...)``,
``aten.to(x, device)``), which the split must not keep: a model traced with
weights on ``meta`` (to load a checkpoint later) or on ``cuda:0`` and placed on
``cuda:1`` would check or copy to the traced device. Codegen pins the devices
of the top graph's ops to their stage; :func:`pin_subgraph_devices` does the
same inside every subgraph, recursively, copying a subgraph that ops on two
devices share.
"""

from __future__ import annotations

import copy

import torch
import torch.fx

__all__ = ["pin_subgraph_devices"]


def pin_subgraph_devices(graph_module: torch.fx.GraphModule, device_of: dict[str, str]) -> None:
    """Pin the hard-coded devices in the subgraphs each node of ``graph_module`` calls to that node's device.

    ``device_of``: node name -> device, for the nodes of ``graph_module.graph``
    that run on one. Subgraphs are modules reached through ``get_attr`` nodes
    passed to an op. Changes ``graph_module`` in place (not recompiled).
    """
    owner: dict[str, str] = {}
    for node in graph_module.graph.nodes:
        device = device_of.get(node.name)
        if node.op != "call_function" or device is None:
            continue
        for arg in node.all_input_nodes:
            target = str(arg.target)
            if arg.op != "get_attr" or _subgraph(graph_module, target) is None:
                continue
            if owner.setdefault(target, device) != device:  # shared with an op on another device: its own copy
                target = _copy_subgraph(graph_module, target, device)
                owner[target] = device
                node.replace_input_with(arg, _get_attr_before(graph_module.graph, node, target))
            _pin_graph(_subgraph(graph_module, target), device)


def _pin_graph(subgraph: torch.fx.GraphModule | None, device: str) -> None:
    from fxsplit.codegen import _pin_device_arguments  # codegen imports this module

    if subgraph is None:
        return
    for node in subgraph.graph.nodes:
        if node.op in ("call_function", "call_method"):
            _pin_device_arguments(node, device)
        if node.op == "get_attr":
            _pin_graph(_subgraph(subgraph, str(node.target)), device)
    subgraph.recompile()


def _subgraph(root: torch.nn.Module, path: str) -> torch.fx.GraphModule | None:
    """The ``GraphModule`` at ``path`` under ``root``, or None when there is none."""
    obj: object = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.fx.GraphModule) else None


def _copy_subgraph(graph_module: torch.fx.GraphModule, target: str, device: str) -> str:
    original = _subgraph(graph_module, target)
    assert original is not None
    name = f"{target.replace('.', '_')}_{device.replace(':', '_')}"
    clone = torch.fx.GraphModule(original, copy.deepcopy(original.graph), type(original).__name__)
    graph_module.add_submodule(name, clone)
    return name


def _get_attr_before(graph: torch.fx.Graph, node: torch.fx.Node, target: str) -> torch.fx.Node:
    with graph.inserting_before(node):
        return graph.get_attr(target)
