"""Checkpoint calls kept under torch.fx: traced as plain calls, then each folded into one node that checkpoints it.

torch.fx runs no code while it traces, so what a kept call would return (a
tensor, a tuple) is known only once the call has been traced. So under fx,
:func:`~fxsplit.tracing.checkpoints.plain_checkpoints` traces each call that
:func:`~fxsplit.tracing.keptcheckpoint.checkpointed_call` keeps as a plain
call and records the nodes it made (a :class:`Region`); after the trace,
:func:`fold_regions` replaces those nodes with one ``call_function`` node,
``checkpointed_<path>(weights..., inputs...)``, whose function runs the
:class:`~fxsplit.tracing.keptcheckpoint.CheckpointedCall` and returns the
call's traced results as a tuple, read by ``getitem`` nodes. A region whose
nodes another node reads (other than through its results), or that writes a
value made outside it in place, is left as traced (a plain call).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxsplit.tracing.graphinfo import mutated_inputs
from fxsplit.tracing.keptcheckpoint import CheckpointedCall

__all__ = ["Region", "fold_regions"]


@dataclass
class Region:
    """One checkpoint call traced as a plain call, to fold.

    Attributes:
        call: how to run it again.
        arguments: its ``(bound, args, kwargs)`` as traced (proxies among them).
        result: what it returned (proxies among it).
        nodes: the nodes it made, in order.
    """

    call: CheckpointedCall
    arguments: tuple[Any, Any, Any]
    result: Any
    nodes: list[torch.fx.Node]


def fold_regions(
    graph: torch.fx.Graph, regions: Sequence[Region], root: torch.nn.Module, paths: Mapping[int, str]
) -> tuple[list[str], list[str]]:
    """Fold each region into one node (see the module docstring); ``(paths of those folded, of those left)``.
    ``root``: the traced module; ``paths``: its modules by id."""
    modules = dict(root.named_modules())
    folded: list[str] = []
    left: list[str] = []
    renamed: dict[torch.fx.Node, torch.fx.Node] = {}  # a folded call's result -> the item of its node that holds it
    for region in regions:
        (folded if _fold(graph, region, modules, paths, renamed) else left).append(region.call.path)
    return folded, left


def _fold(
    graph: torch.fx.Graph,
    region: Region,
    modules: Mapping[str, torch.nn.Module],
    paths: Mapping[int, str],
    renamed: dict[torch.fx.Node, torch.fx.Node],
) -> bool:
    inside = set(region.nodes)
    if not inside:
        return False
    leaves, spec = tree_flatten(region.arguments)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.fx.Proxy)]
    # an argument that an earlier folded call returned (blocks chained call to call) is now that call's item
    inputs = [renamed.get(leaves[i].node, leaves[i].node) for i in positions]
    results, _ = tree_flatten(region.result)
    outputs = [i for i, leaf in enumerate(results) if isinstance(leaf, torch.fx.Proxy) and leaf.node in inside]
    made = {results[i].node for i in outputs}
    for node in region.nodes:
        if any(user not in inside for user in node.users) and node not in made:
            return False  # read outside other than as a result
        if any(target not in inside for target in mutated_inputs(node, modules)):
            return False  # writes a value made outside it
    if any(node in inside for node in inputs):
        return False
    owners = [paths[id(owner)] for owner in region.call.owners]
    read = _weights_read(region.nodes, modules)  # only these: a function closing over the model runs a part of it
    names = tuple((at, name) for at, name in region.call.names if _path(owners[at], name) in read)
    call = dataclasses.replace(region.call, names=names)
    constants = [None if i in positions else leaf for i, leaf in enumerate(leaves)]
    first = region.nodes[0]
    with graph.inserting_before(first):
        weights = [graph.get_attr(_path(owners[at], name)) for at, name in call.names]
        node = graph.call_function(_runner(call, spec, constants, positions, outputs), (*weights, *inputs))
        node.meta["nn_module_stack"] = dict(first.meta.get("nn_module_stack") or {})
        items = [graph.call_function(operator.getitem, (node, k)) for k in range(len(outputs))]
    for item, i in zip(items, outputs, strict=True):
        results[i].node.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
        renamed[results[i].node] = item
    for old in reversed(region.nodes):
        graph.erase_node(old)
    return True


def _path(owner: str, name: str) -> str:
    return f"{owner}.{name}" if owner else name


def _weights_read(nodes: Sequence[torch.fx.Node], modules: Mapping[str, torch.nn.Module]) -> set[str]:
    """The qualified names of the parameters and buffers ``nodes`` read (``get_attr``, a ``call_module``'s own)."""
    read = set()
    for node in nodes:
        if node.op == "get_attr":
            read.add(str(node.target))
        elif node.op == "call_module":
            module = modules[str(node.target)]
            read.update(_path(str(node.target), name) for name, _ in module.named_parameters(remove_duplicate=False))
            read.update(_path(str(node.target), name) for name, _ in module.named_buffers(remove_duplicate=False))
    return read


def _runner(
    call: CheckpointedCall, spec: Any, constants: list[Any], positions: list[int], outputs: list[int]
) -> Callable[..., tuple[Any, ...]]:
    """The function of a folded call's node: ``(weights..., inputs...)`` -> the call's results at ``outputs``."""
    count = len(call.names)

    def checkpointed(*values: Any) -> tuple[Any, ...]:
        given = list(constants)
        for position, value in zip(positions, values[count:], strict=True):
            given[position] = value
        bound, args, kwargs = tree_unflatten(given, spec)
        flat, _ = tree_flatten(call(list(values[:count]), bound, args, kwargs))
        return tuple(flat[i] for i in outputs)

    label = "".join(c if c.isalnum() else "_" for c in call.path)
    checkpointed.__name__ = checkpointed.__qualname__ = f"checkpointed_{label}"
    checkpointed.__module__ = "fxsplit"
    checkpointed.fxsplit_checkpoint = call  # type: ignore[attr-defined]
    return checkpointed
