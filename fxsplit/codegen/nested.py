"""Hard-coded devices in an op's arguments and in the subgraphs it calls, pointed at the op's device.

``torch.export`` keeps some regions as subgraphs called by a higher-order op
(``wrap_with_autocast``, ``wrap_with_set_grad_enabled``: a Hugging Face rotary
embedding under ``torch.autocast(enabled=False)`` is one). Their nodes carry the
devices seen when tracing (``_assert_tensor_metadata(device=...)``,
``aten.to(x, device)``), which the split must not keep: a model traced with
weights on ``meta`` (to load a checkpoint later) or on ``cuda:0`` and placed on
``cuda:1`` would check or copy to the traced device. Codegen pins the devices
of the top graph's ops to their stage (:func:`pin_device_arguments`);
:func:`pin_subgraph_devices` does the same inside every subgraph, recursively,
copying a subgraph that ops on two devices share.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx

from fxsplit.attrpath import attr_at

__all__ = ["pin_device_arguments", "pin_subgraph_devices"]


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
    if subgraph is None:
        return
    for node in subgraph.graph.nodes:
        if node.op in ("call_function", "call_method"):
            pin_device_arguments(node, device)
        if node.op == "get_attr":
            _pin_graph(_subgraph(subgraph, str(node.target)), device)
    subgraph.recompile()


def _subgraph(root: torch.nn.Module, path: str) -> torch.fx.GraphModule | None:
    """The ``GraphModule`` at ``path`` under ``root``, or None when there is none."""
    obj = attr_at(root, path, None)
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


def pin_device_arguments(node: torch.fx.Node, device: str) -> None:
    """Point every hard-coded device in the node's arguments at ``device``."""
    if node.op == "call_method" and node.target in ("cuda", "cpu"):
        node.target = "to"
        node.args = (node.args[0], device)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k == "non_blocking"}
        return
    is_to = (node.op == "call_method" and node.target == "to") or (
        isinstance(node.target, torch._ops.OpOverload) and node.target._schema.name in ("aten::to", "aten::_to_copy")
    )
    target_device = torch.device(device)

    def fix(value: Any, positional_to: bool) -> Any:
        if isinstance(value, torch.device):
            return target_device
        if positional_to and isinstance(value, str) and _is_device_string(value):
            return device
        if positional_to and isinstance(value, torch.fx.Node) and _is_device_node(value):
            return device
        if isinstance(value, (list, tuple)) and not isinstance(value, torch.fx.Node):
            return type(value)(fix(v, False) for v in value)
        return value

    node.args = tuple(fix(a, is_to and i > 0) for i, a in enumerate(node.args))
    kwargs = dict(node.kwargs)
    if "device" in kwargs and kwargs["device"] is not None:
        kwargs["device"] = device if isinstance(kwargs["device"], str) else target_device
    node.kwargs = {k: (v if k == "device" else fix(v, False)) for k, v in kwargs.items()}


def _is_device_string(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, TypeError):
        return False
    return True


def _is_device_node(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is getattr and len(node.args) > 1 and node.args[1] == "device"
