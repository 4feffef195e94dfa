"""One pass over a traced graph's nodes: the ops to place, their module paths, and the tensors each node reads.

The cost model needs several facts per node; on graphs of 100k ops each
separate walk over the nodes costs as much as the partitioner's own work on
them, so :func:`scan_graph` gathers them in one (measured in
``benchmarks/plan_stages.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.fx

from fxsplit.cost.walk import ModulePaths, named_tensors

__all__ = ["GraphScan", "Read", "module_tensors", "scan_graph"]


Read = tuple[list[str], torch.Tensor, bool, list[int], list[str]]
"""One tensor the graph reads: its names (the model's, else the graph's path), the tensor, whether it is a buffer,
the ops that read it (with repeats), the nodes that read it (``get_attr`` and ``call_module``)."""


@dataclass
class GraphScan:
    """What one pass over the nodes found.

    Attributes:
        ops: the nodes the partitioner places: every node but placeholders, ``get_attr``, the output and
            torch.export's input guard, in graph order.
        index: op -> its position in ``ops``.
        labels: each op's module path (:func:`~fxsplit.tracing.graphinfo.module_path`).
        valued: the placeholders and ops in graph order (the nodes whose values can cross devices).
        read: ``id(tensor) ->`` :data:`Read` for each tensor a node reads from the module, in order of first
            read (the reads of :func:`~fxsplit.cost.build.tensor_reads`, by tensor).
        module_buffers: the buffers a ``call_module`` op reads (its module may write them).
        known_read: how many of ``read`` the model's tensors hold.
    """

    ops: list[torch.fx.Node]
    index: dict[torch.fx.Node, int]
    labels: tuple[str, ...]
    valued: list[torch.fx.Node]
    read: dict[int, Read]
    module_buffers: set[int]
    known_read: int


def scan_graph(
    graph_module: torch.fx.GraphModule,
    modules: ModulePaths,
    known: Mapping[int, tuple[list[str], torch.Tensor, bool]],
) -> GraphScan:
    """The ops, labels and tensor reads of ``graph_module``'s graph.

    Args:
        graph_module: the traced graph.
        modules: its submodules by path (:class:`ModulePaths` of ``graph_module``).
        known: the model's tensors (:func:`~fxsplit.cost.build.model_tensors`), for their names.
    """
    ops: list[torch.fx.Node] = []
    labels: list[str] = []
    valued: list[torch.fx.Node] = []
    read: dict[int, Read] = {}
    module_buffers: set[int] = set()
    attr_reads: list[tuple[list[int], torch.fx.Node]] = []  # get_attr: its readers are ops further on
    known_read = 0

    def entry(node: torch.fx.Node, tensor: torch.Tensor, owner: str, name: str = "") -> Read:
        """The tensor's :data:`Read`, with ``node`` among its nodes (made at its first read). Its graph path,
        ``owner.name`` (or ``owner`` alone), names it only when the model does not."""
        nonlocal known_read
        key = id(tensor)
        found = read.get(key)
        if found is None:
            names = known.get(key)
            if names is None:
                path = f"{owner}.{name}" if name else owner
                found = read[key] = ([path], tensor, not isinstance(tensor, torch.nn.Parameter), [], [node.name])
            else:
                known_read += 1
                found = read[key] = (names[0], tensor, names[2], [], [node.name])
        else:
            found[4].append(node.name)
        return found

    for node in graph_module.graph.nodes:
        op = node.op
        if op == "call_module":
            target = str(node.target)
            if target.startswith("_guards"):  # torch.export's input check: no compute, no placement
                continue
            at, module = len(ops), modules[target]
            for name, tensor in module_tensors(module) if module._modules else _leaf_tensors(module):
                found = entry(node, tensor, target, name)
                found[3].append(at)
                if found[2]:  # a buffer (known from the model's walk: the tensor itself is not touched again)
                    module_buffers.add(id(tensor))
            label = target
        elif op == "call_function" or op == "call_method":
            stack = node.meta.get("nn_module_stack")
            label = str(next(reversed(stack.values()))[0]) if stack else ""
            if label.startswith("_empty_nn_module_stack"):  # export's marker for nodes made outside any module
                label = ""
        else:
            if op == "placeholder":
                valued.append(node)
            elif op == "get_attr":
                attr = modules.attribute(str(node.target))
                if isinstance(attr, torch.Tensor):
                    attr_reads.append((entry(node, attr, str(node.target))[3], node))
            continue
        ops.append(node)
        labels.append(label)
        valued.append(node)
    index = {node: i for i, node in enumerate(ops)}
    for readers, node in attr_reads:
        readers.extend(index[user] for user in node.users if user in index)
    return GraphScan(ops, index, tuple(labels), valued, read, module_buffers, known_read)


def _leaf_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    found: list[tuple[str, torch.Tensor]] = [
        (name, tensor) for name, tensor in module._parameters.items() if tensor is not None
    ]
    if module._buffers:
        found += [(name, tensor) for name, tensor in module._buffers.items() if tensor is not None]
    return found


def module_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each parameter then buffer of ``module`` and its submodules (a tied one under each
    of its names): what a ``call_module`` node reads."""
    if not module._modules:  # a leaf (most call_module targets): its own parameters, then buffers
        return _leaf_tensors(module)
    return [(name, tensor) for name, tensor, _ in named_tensors(module)]
