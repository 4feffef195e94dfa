"""Tensors ``forward`` makes afresh at each call and torch.fx keeps as one constant: copied at each call when
the graph writes them in place.

torch.fx runs for real what involves no traced value: ``mask = torch.zeros(4)`` in ``forward`` makes one tensor
while tracing, and the graph holds it as a constant (``_tensor_constant0``). When the graph then writes it in
place (``mask[y.argmax()] = 1.0``), every call of the split wrote that same tensor, where every call of the model
starts from a new one: from the second call on, the split's mask still held the ones of earlier calls, and its
outputs differed from the model's, with no word. Plain ``torch.fx.symbolic_trace`` does the same.

:func:`fresh_written_constants` gives such a constant a copy at each call: the graph reads it once, clones it,
and every op that used the constant uses the clone, so each call starts, as the model's does, from the value the
tensor was made with. One the graph returns is cloned too: the model returns a new tensor at each call, which its
caller may write (``out.div_(t)``); the split returned one tensor at every call. Constants that are views of one
another (``zeros`` and ``zeros[:2]``, each kept by torch.fx) are left as they are: cloned apart, a write to one
would no longer reach the other. A tensor the model holds as state (an attribute of a module or of an object a
module holds, or a global of the model's code) is the same tensor from call to call, in the model as in the split:
it is left as it is (:mod:`fxsplit.tracing.heldstate` refuses state made while tracing).
"""

from __future__ import annotations

import functools
import operator
from collections import Counter

import torch
import torch.fx

from fxsplit.errors import TraceError
from fxsplit.tracing.graphinfo import alias_root
from fxsplit.tracing.heldstate import held_tensors
from fxsplit.tracing.modelcode import code_modules
from fxsplit.tracing.writers import writing_ops

__all__ = ["fresh_written_constants"]

_CONSTANT = "_tensor_constant"  # torch.fx's name for a tensor that is no attribute of the model's modules


def fresh_written_constants(graph_module: torch.fx.GraphModule, model: torch.nn.Module) -> list[str]:
    """Clone, at each call, the constants of ``graph_module`` (an fx trace of ``model``) that the graph writes in
    place or returns (a view of) and that are no state of ``model``; the names of those cloned."""
    graph = graph_module.graph
    reads: dict[str, list[torch.fx.Node]] = {}
    for node in graph.find_nodes(op="get_attr"):
        if _unregistered(model, str(node.target)):
            reads.setdefault(str(node.target), []).append(node)
    if not reads:
        return []
    modules = dict(graph_module.named_modules())
    writes = {
        str(root.target)
        for targets in writing_ops(list(graph.nodes), modules).values()
        for target in targets
        if (root := alias_root(target)).op == "get_attr" and str(root.target) in reads
    }
    written = set(writes)
    # returned: a caller may write it, where the model's is a new tensor at each call
    written.update(str(root.target) for node in _returned(graph) if (root := alias_root(node)).op == "get_attr")
    state = _state_tensors(model)
    kept = [
        state[id(getattr(graph_module, name))] for name in sorted(writes) if id(getattr(graph_module, name)) in state
    ]
    if kept:
        raise TraceError(_kept_message(kept))
    storages = Counter(_storage(getattr(graph_module, name)) for name in reads)
    fresh = [
        name
        for name in reads
        if name in written
        and name.startswith(_CONSTANT)
        and id(tensor := getattr(graph_module, name)) not in state
        and storages[_storage(tensor)] == 1  # views of one another (zeros, zeros[:2]): two clones would not be
    ]
    for name in fresh:
        first, *later = reads[name]
        with graph.inserting_after(first):
            copy = graph.call_method("clone", (first,))
        for node in (first, *later):
            node.replace_all_uses_with(copy, delete_user_cb=functools.partial(operator.is_not, copy))
        for node in later:
            graph.erase_node(node)
    if fresh:
        graph_module.recompile()
    return fresh


def _unregistered(model: torch.nn.Module, target: str) -> bool:
    """Whether ``target`` is a tensor that is no parameter or buffer of the module of ``model`` holding it (the
    graph module registers every tensor it reads as a buffer: asked of the model)."""
    path, _, name = target.rpartition(".")
    try:
        owner = model.get_submodule(path)
    except AttributeError:
        return False
    value = owner.__dict__.get(name)
    return isinstance(value, torch.Tensor) and name not in owner._parameters and name not in owner._buffers


def _storage(tensor: torch.Tensor) -> tuple[str, int]:
    try:
        return str(tensor.device), tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage of its own to share
        return str(tensor.device), id(tensor)


def _returned(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []

    def note(node: torch.fx.Node) -> torch.fx.Node:
        found.append(node)
        return node

    for output in graph.find_nodes(op="output"):
        torch.fx.node.map_arg(output.args, note)
    return found


def _state_tensors(model: torch.nn.Module) -> dict[int, str]:
    """``id -> where`` for the tensors ``model`` holds: its modules' attributes and buffers, what the objects they
    hold hold, and the globals of its code."""
    found = {id(tensor): path for tensor, path in held_tensors(model)}
    for path, module in model.named_modules():
        for name, value in vars(module).items():  # (torch.fx sets its constants on the traced module: not state)
            if isinstance(value, torch.Tensor) and not name.startswith(_CONSTANT):
                found.setdefault(id(value), f"{path}.{name}" if path else name)
        for name, value in module._buffers.items():
            if value is not None:
                found.setdefault(id(value), f"{path}.{name}" if path else name)
    for code in code_modules(list(model.modules())):
        for name, value in vars(code).items():
            if isinstance(value, torch.Tensor):
                found.setdefault(id(value), f"{code.__name__}.{name}")
    return found


def _kept_message(kept: list[str]) -> str:
    more = f" and {len(kept) - 3} more" if len(kept) > 3 else ""
    return (
        f"forward writes in place {', '.join(kept[:3])}{more}, a tensor the model holds outside its parameters and "
        "buffers: torch.fx keeps such a tensor as a constant, and computes for real, once while tracing, what "
        "reads it with no traced value (self.total.norm()), so a split could compute with the value it had then, "
        "where the model reads the value its last call left. Register it as a buffer "
        "(self.register_buffer('total', tensor)), which fxsplit traces at every read, or trace with torch.export "
        "(example_inputs=(...), trace='export')"
    )
