"""Numbers torch.export read out of a changing tensor and kept as constants: refused.

Code that turns a tensor into a Python number (``.item()``, ``int(t)``, a 0-d tensor passed as a size,
``torch.ones(1, t)``) makes torch.export either keep the number as a symbol of the graph or, when it cannot,
fail. One case does neither: a tensor the model holds outside its modules (a plain attribute of an object,
such as a cache's step counter) is exported as a constant whose value export knows, and the number read from it
becomes a constant of the graph, even when the graph first writes that tensor from the inputs (``copy_``) or
from its own state (``add_``). The graph then holds an ``item`` op whose result nothing uses, and shapes fixed
at the example inputs' value: Hugging Face's BioGPT under ``TorchExportableModuleWithStaticCache`` built its
attention mask at one position for every call, and its split (like ``torch.export(...).module()`` itself)
gave wrong logits from the second token on, with no word.

:func:`refuse_fixed_reads` finds such reads in an export graph (a scalar read with no symbol and no user, of a
tensor that depends on an input or on a tensor the graph writes) and raises a :class:`TraceError` that names the
line of the model's code and how to keep the number variable. A read of a tensor nothing writes (a constant of
the model) is the same at every call and is left alone.
"""

from __future__ import annotations

import torch
import torch.fx

from fxsplit.errors import TraceError
from fxsplit.tracing.graphinfo import alias_root
from fxsplit.tracing.nodesource import source_line
from fxsplit.tracing.writers import writing_ops

__all__ = ["fixed_reads", "refuse_fixed_reads"]

_aten = torch.ops.aten
_SCALAR_READS = (_aten.item.default, _aten._local_scalar_dense.default, _aten.is_nonzero.default)
_SYMBOLS = (torch.SymInt, torch.SymFloat, torch.SymBool)


def fixed_reads(graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The scalar reads of ``graph_module`` (an export graph) whose value the graph fixed although the tensor
    read changes from call to call."""
    graph = graph_module.graph
    unkept = [
        node
        for target in _SCALAR_READS
        for node in graph.find_nodes(op="call_function", target=target)
        if not node.users and not isinstance(node.meta.get("val"), _SYMBOLS)
    ]
    if not unkept:
        return []
    modules = dict(graph_module.named_modules())
    written = {alias_root(target) for targets in writing_ops(list(graph.nodes), modules).values() for target in targets}
    return [node for node in unkept if _varies(node, written)]


def _varies(read: torch.fx.Node, written: set[torch.fx.Node]) -> bool:
    """Whether what ``read`` reads depends on an input of the graph or on a tensor the graph writes."""
    seen: set[torch.fx.Node] = set()
    todo = list(read.all_input_nodes)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder" or node in written or alias_root(node) in written:
            return True
        todo.extend(node.all_input_nodes)
    return False


def refuse_fixed_reads(graph_module: torch.fx.GraphModule) -> None:
    """Raise :class:`TraceError` when ``graph_module`` (an export graph) fixed a number read from a tensor that
    changes from call to call (:func:`fixed_reads`)."""
    reads = fixed_reads(graph_module)
    if not reads:
        return
    lines = list(dict.fromkeys(source_line(node) or f"op {node.name}" for node in reads))
    where = "; ".join(lines[:3]) + (f"; and {len(lines) - 3} more" if len(lines) > 3 else "")
    raise TraceError(
        "forward() turns a tensor into a Python number (`.item()`, `int(t)`, a tensor passed as a size) where "
        f"that tensor changes from call to call ({where}). The tensor depends on the inputs or on state the model "
        "writes, but it is held outside the model's modules (a plain attribute of an object, such as a cache), "
        "so torch.export read its value at the example inputs and fixed it in the graph: the graph (and "
        "torch.export.export(...).module() alike) is only right for inputs that give that same number. To fix: "
        "compute the number from the inputs' shapes, or pass it (or the tensor it builds, e.g. an attention "
        "mask) as an input; a tensor the model registers as a buffer (register_buffer) is traced as data"
    )
